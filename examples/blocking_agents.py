"""The spec's typical flow with two agents in threads (blocking API).

Run a relay (``static serve --allow-anonymous``), then::

    python examples/blocking_agents.py --relay grpc://127.0.0.1:50051

With an API key instead of anonymous access: ``STATIC_API_KEY=sk_live_... python
examples/blocking_agents.py --relay ... --api-url http://127.0.0.1:8080``.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable

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


Agent = Callable[[Options, "queue.Queue[bytes]", "queue.Queue[bytes]"], None]


def main() -> int:
    opts = parse(__doc__ or "")
    key_packages: queue.Queue[bytes] = queue.Queue()
    welcomes: queue.Queue[bytes] = queue.Queue()
    # Each agent's outcome: None, or its failure (then the other one may wait forever: the
    # program ends at the first failure, with a non-zero exit code).
    outcomes: queue.Queue[BaseException | None] = queue.Queue()

    def run(agent: Agent) -> None:
        try:
            agent(opts, key_packages, welcomes)
        except Exception as exc:  # noqa: BLE001 - any failure ends the program non-zero
            traceback.print_exc()
            outcomes.put(exc)
        else:
            outcomes.put(None)

    for agent in (alice, bob):
        threading.Thread(target=run, args=(agent,), daemon=True).start()
    for _ in range(2):
        try:
            failure = outcomes.get(timeout=60)
        except queue.Empty:
            print("the agents did not finish within 60 s", file=sys.stderr)
            return 1
        if failure is not None:
            return 1
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
