"""A program may end while threads are blocked in the SDK: it must exit cleanly (code 0).

On Python 3.11-3.13 a daemon thread that takes the GIL back during interpreter finalization is
ended with a forced unwind, which used to abort the process ("FATAL: exception not rethrown",
code 134) when it came back from the native core. Each case runs a real program against a real
relay, as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.sdk.conftest import channel_name
from tests.support.server import ServerProcess

PROGRAM = textwrap.dedent(
    """
    import sys, threading, time
    from static_sdk import StaticClient

    relay, data, name, mode = sys.argv[1:5]
    alice = StaticClient(relay, data + "/alice", b"alice")
    bob = StaticClient(relay, data + "/bob", b"bob")
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    alices.send(b"first")
    assert next(iter(bobs.messages())) == b"first"

    def iterate():
        for _ in bobs.messages():
            pass

    def receive():
        while True:
            try:
                bobs.receive(timeout=0.01)
            except TimeoutError:
                pass

    def send():
        while True:
            alices.send(b"x" * 100)

    def wait_async():
        import trio

        async def run():
            async for _ in bobs.messages_async():
                pass

        trio.run(run)

    workers = {
        "idle-iterator": [iterate],
        "busy-iterator": [iterate, send, send],
        "receive-timeouts": [receive, send],
        "async-iterator": [wait_async, send],
    }[mode]
    for work in workers:
        threading.Thread(target=work, daemon=True).start()
    time.sleep(0.3)
    print("exiting", flush=True)
    if mode == "receive-timeouts":
        sys.exit(0)
    """
)


@pytest.mark.parametrize(
    "mode", ["idle-iterator", "busy-iterator", "receive-timeouts", "async-iterator"]
)
def test_exit_with_threads_blocked_in_the_sdk_is_clean(
    relay: ServerProcess, tmp_path: Path, mode: str
) -> None:
    # Busy modes race the exit against threads coming back from the core: a few runs each.
    for run in range(1 if mode == "idle-iterator" else 3):
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                PROGRAM,
                relay.relay_url,
                str(tmp_path / str(run)),
                channel_name(),
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "FATAL" not in result.stderr
        assert result.returncode == 0, result.stderr
        assert result.stdout == "exiting\n"
