"""The spec's typical flow with two agents as asyncio tasks (async API, no thread per waiter).

Run a relay (``static serve --allow-anonymous``), then::

    python examples/asyncio_agents.py --relay grpc://127.0.0.1:50051
"""

from __future__ import annotations

import asyncio

from _common import Options, parse

from static_sdk import StaticClient


async def alice(
    opts: Options, key_packages: asyncio.Queue[bytes], welcomes: asyncio.Queue[bytes]
) -> None:
    client = await StaticClient.create_async(
        opts.relay, opts.data_dir / "alice", b"alice", api_key=opts.api_key, api_url=opts.api_url
    )
    async with client:
        channel = await client.create_channel_async(opts.channel)
        welcome = await channel.add_member_async(await key_packages.get())
        await welcomes.put(welcome)
        answers = channel.messages_async()
        for i in range(opts.rounds):
            await channel.send_async(f"question {i}".encode())
            print(f"alice got: {(await anext(answers)).decode()}", flush=True)
        await channel.send_async(b"bye")


async def bob(
    opts: Options, key_packages: asyncio.Queue[bytes], welcomes: asyncio.Queue[bytes]
) -> None:
    client = await StaticClient.create_async(
        opts.relay, opts.data_dir / "bob", b"bob", api_key=opts.api_key, api_url=opts.api_url
    )
    async with client:
        await key_packages.put(await client.generate_key_package_async())
        channel = await client.join_channel_async(opts.channel, await welcomes.get())
        async for message in channel.messages_async():
            print(f"bob got: {message.decode()}", flush=True)
            if message == b"bye":
                break
            await channel.send_async(b"answer to " + message)


async def main() -> None:
    opts = parse(__doc__ or "")
    key_packages: asyncio.Queue[bytes] = asyncio.Queue()
    welcomes: asyncio.Queue[bytes] = asyncio.Queue()
    async with asyncio.timeout(60):
        await asyncio.gather(alice(opts, key_packages, welcomes), bob(opts, key_packages, welcomes))
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
