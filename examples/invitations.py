"""Two agents of two accounts meet through the relay: no key package or Welcome passes between
them, only Bob's printed address. Each runs in its own process with its own account's key::

    STATIC_API_KEY=<bob's key> python examples/invitations.py bob ./bob-data
    STATIC_API_KEY=<alice's key> python examples/invitations.py alice ./alice-data <bob's address>

``STATIC_RELAY_URL`` and ``STATIC_API_URL`` say where the server is (defaults: ``static serve``'s).
"""

import os
import sys
import uuid

from static_sdk import StaticClient

relay = os.environ.get("STATIC_RELAY_URL", "grpc://127.0.0.1:50051")
api_url = os.environ.get("STATIC_API_URL", "http://127.0.0.1:8080")
role, data_dir = sys.argv[1], sys.argv[2]
with StaticClient(relay, data_dir, role.encode(), os.environ["STATIC_API_KEY"], api_url) as me:
    if role == "bob":
        me.allow_invitations(["*"])  # by default only Bob's own account may invite him
        print(me.address, flush=True)  # the one thing Bob tells the world
        channel = next(me.invitations()).accept()
        question = channel.receive_message(timeout=30)
        channel.send(b"hi " + question.account.encode() if question.account else b"hi")
    else:
        channel = me.create_channel(f"alice-{uuid.uuid4().hex[:8]}/demo/meet")
        channel.invite(sys.argv[3])  # claims Bob's key package, adds him, leaves the invitation
        channel.send(b"hello, Bob")
        print("bob says:", channel.receive(timeout=30).decode(), flush=True)
