"""Tests that hang on purpose in their teardown, each run by a pytest of its own from
tests/test_hang_backstop.py (the suite never collects this file: its name does not start with
``test_``). ``STATIC_HANG_PIDS`` names the file where a test writes the pid of the server it
started, for the caller to check that the server did not outlive the run."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

#: Far longer than any timeout the caller sets: only the backstop ends these.
FOREVER = 3600


@pytest.fixture
def backend() -> str:
    return "sqlite"


@pytest.fixture
def server_then_sleep(start_server: Callable[..., ServerProcess]) -> Iterator[None]:
    """A server (stopped by ``start_server``'s teardown, which runs after this one's), then a
    teardown asleep in C: no Python code runs until it returns."""
    server = start_server()
    assert server.proc is not None
    Path(os.environ["STATIC_HANG_PIDS"]).write_text(str(server.proc.pid))
    yield
    time.sleep(FOREVER)


@pytest.fixture
def wait_for_nothing() -> Iterator[None]:
    yield
    threading.Event().wait()


@pytest.fixture
def sleep_holding_the_gil() -> Iterator[None]:
    yield
    # libc's sleep through PyDLL, which keeps the GIL: no other Python thread runs meanwhile,
    # as in a native call that does not release it.
    ctypes.PyDLL(None).sleep(FOREVER)


def test_fails_then_hangs_in_teardown(server_then_sleep: None) -> None:
    # Issue 28's case: the failure cancelled pytest-timeout's timer before the teardown hung.
    raise AssertionError("failed on purpose; the teardown hangs next")


def test_hangs_in_teardown_on_an_event(wait_for_nothing: None) -> None:
    pass


def test_hangs_in_teardown_holding_the_gil(sleep_holding_the_gil: None) -> None:
    pass
