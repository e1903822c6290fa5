"""``StaticClient.close`` returns within its bound whatever other threads are doing (issue 28).

The relay is made to hang (SIGSTOP: its connections stay open, nothing answers) while threads
are blocked in ``send``, ``rotate_keys`` and a ``messages()`` iteration; the main thread then
closes the client. ``close`` must return within the core's bound (5 s) and every blocked call
must end soon after: the calls with ``RuntimeError`` (``runtime error:``, or ``transport
error:`` had the relay been given up on first), the iterator by ending.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from static_sdk import StaticClient
from tests.sdk.conftest import Clients, channel_name
from tests.support.process import stop_process
from tests.support.server import ServerProcess

#: The core's bound on close (``CLOSE_TIMEOUT``), and slack for a loaded machine.
CLOSE_BOUND = 5.0 + 3.0
#: How long a blocked call may take to end after close returned.
END_BOUND = 10.0


class Blocked:
    """A call run on a daemon thread; what it returned or raised."""

    def __init__(self, what: str, call: Callable[[], object]) -> None:
        self.what = what
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), name=what, daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            self.result = call()
        except BaseException as exc:  # noqa: BLE001 - examined by the test
            self.error = exc

    def ended(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def test_close_returns_while_calls_are_stuck_on_a_hung_relay(
    relay: ServerProcess, clients: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Patient enough that no call gives up on the relay by itself during the test.
    monkeypatch.setenv("STATIC_SDK_RETRY_TIMEOUT", "600")
    alice: StaticClient = clients(relay, b"alice")
    channel = alice.create_channel(channel_name())
    channel.send(b"before")
    assert relay.proc is not None
    pid = relay.proc.pid
    stop_process(pid)
    try:
        calls = [
            Blocked("send", lambda: channel.send(b"stuck")),
            Blocked("rotate_keys", channel.rotate_keys),
            Blocked("messages", lambda: list(channel.messages())),
        ]
        # Let each call reach the relay and wait for its answer.
        time.sleep(1.0)
        assert all(call.thread.is_alive() for call in calls), [
            (call.what, call.error) for call in calls if not call.thread.is_alive()
        ]

        started = time.monotonic()
        closer = Blocked("close", alice.close)
        assert closer.ended(CLOSE_BOUND), f"close did not return within {CLOSE_BOUND} s"
        assert closer.error is None, closer.error
        took = time.monotonic() - started

        for call in calls:
            assert call.ended(END_BOUND), f"{call.what} still blocked {END_BOUND} s after close"
        for call in calls[:2]:
            assert isinstance(call.error, RuntimeError), (call.what, call.error)
            assert str(call.error).startswith(("runtime error:", "transport error:")), (
                call.what,
                str(call.error),
            )
        assert calls[2].error is None and calls[2].result == [], (calls[2].error, calls[2].result)
        assert took < CLOSE_BOUND
    finally:
        os.kill(pid, signal.SIGCONT)
