"""A requester in its own process, for the requester-crash test.

Usage: python -m tests.sdk.request_agent RELAY DATA_DIR IDENTITY CHANNEL PAYLOAD

Reopens CHANNEL from DATA_DIR, prints "sending", then sends PAYLOAD as a request and waits for
its reply (printing "reply PAYLOAD" if it ever comes), until killed.
"""

from __future__ import annotations

import sys

from static_sdk import StaticClient


def main() -> None:
    relay, data_dir, identity, name, payload = sys.argv[1:6]
    client = StaticClient(relay, data_dir, identity.encode())
    channel = client.open_channel(name)
    print("sending", flush=True)
    reply = channel.request(payload.encode(), 60)
    print(f"reply {reply.payload.decode()}", flush=True)


if __name__ == "__main__":
    main()
