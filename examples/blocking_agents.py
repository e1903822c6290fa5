"""The spec's typical flow with two agents in threads (blocking API).

Run a relay (``static serve --allow-anonymous``), then::

    python examples/blocking_agents.py --relay grpc://127.0.0.1:50051

With an API key instead of anonymous access: ``STATIC_API_KEY=sk_live_... python
examples/blocking_agents.py --relay ... --api-url http://127.0.0.1:8080``.
"""

from __future__ import annotations

import queue
import threading

from _common import Options, parse

from static_sdk import StaticClient


def alice(opts: Options, key_packages: queue.Queue[bytes], welcomes: queue.Queue[bytes]) -> None:
    client = StaticClient(
        opts.relay, opts.data_dir / "alice", b"alice", api_key=opts.api_key, api_url=opts.api_url
    )
    with client:
        channel = client.create_channel(opts.channel)  # A creates the channel
        welcome = channel.add_member(key_packages.get(timeout=30))  # adds B with B's key package
        welcomes.put(welcome)  # and hands B the Welcome
        answers = channel.messages()
        for i in range(opts.rounds):
            channel.send(f"question {i}".encode())
            print(f"alice got: {next(answers).decode()}", flush=True)
        channel.send(b"bye")


def bob(opts: Options, key_packages: queue.Queue[bytes], welcomes: queue.Queue[bytes]) -> None:
    client = StaticClient(
        opts.relay, opts.data_dir / "bob", b"bob", api_key=opts.api_key, api_url=opts.api_url
    )
    with client:
        key_packages.put(client.generate_key_package())  # B makes a key package
        channel = client.join_channel(opts.channel, welcomes.get(timeout=30))  # joins
        for message in channel.messages():  # blocks until a message arrives
            print(f"bob got: {message.decode()}", flush=True)
            if message == b"bye":
                break
            channel.send(b"answer to " + message)


def main() -> None:
    opts = parse(__doc__ or "")
    key_packages: queue.Queue[bytes] = queue.Queue()
    welcomes: queue.Queue[bytes] = queue.Queue()
    threads = [
        threading.Thread(target=agent, args=(opts, key_packages, welcomes))
        for agent in (alice, bob)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", flush=True)


if __name__ == "__main__":
    main()
