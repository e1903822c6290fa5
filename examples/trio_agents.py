"""The spec's typical flow with two agents as trio tasks (async API, no thread per waiter).

Run a relay (``static serve --allow-anonymous``), then::

    python examples/trio_agents.py --relay grpc://127.0.0.1:50051
"""

from __future__ import annotations

import trio
from _common import Options, parse

from static_sdk import StaticClient


async def alice(
    opts: Options,
    key_packages: trio.MemoryReceiveChannel[bytes],
    welcomes: trio.MemorySendChannel[bytes],
) -> None:
    client = await StaticClient.create_async(
        opts.relay, opts.data_dir / "alice", b"alice", api_key=opts.api_key, api_url=opts.api_url
    )
    async with client:
        channel = await client.create_channel_async(opts.channel)
        welcome = await channel.add_member_async(await key_packages.receive())
        await welcomes.send(welcome)
        answers = channel.messages_async()
        for i in range(opts.rounds):
            await channel.send_async(f"question {i}".encode())
            print(f"alice got: {(await anext(answers)).decode()}", flush=True)
        await channel.send_async(b"bye")


async def bob(
    opts: Options,
    key_packages: trio.MemorySendChannel[bytes],
    welcomes: trio.MemoryReceiveChannel[bytes],
) -> None:
    client = await StaticClient.create_async(
        opts.relay, opts.data_dir / "bob", b"bob", api_key=opts.api_key, api_url=opts.api_url
    )
    async with client:
        await key_packages.send(await client.generate_key_package_async())
        channel = await client.join_channel_async(opts.channel, await welcomes.receive())
        async for message in channel.messages_async():
            print(f"bob got: {message.decode()}", flush=True)
            if message == b"bye":
                break
            await channel.send_async(b"answer to " + message)


async def main() -> None:
    opts = parse(__doc__ or "")
    kp_send, kp_receive = trio.open_memory_channel[bytes](1)
    welcome_send, welcome_receive = trio.open_memory_channel[bytes](1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(alice, opts, kp_receive, welcome_send)
            nursery.start_soon(bob, opts, kp_send, welcome_receive)
    print("done", flush=True)


if __name__ == "__main__":
    trio.run(main)
