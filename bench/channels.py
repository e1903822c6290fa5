"""Channels per client: how many channels one SDK client holds, and what each one costs.

    .venv/bin/python bench/channels.py [--channels N] [--checkpoints N,N,...] [--samples N]
                                       [--receive-timeout S] [--op-timeout S]

Starts a real ``static serve --allow-anonymous`` (SQLite, temporary data directory, loopback
only, ports picked by the OS; stopped at the end, on failure and on Ctrl-C too) and one SDK
client (identity ``many``) that creates ``bench/many/c0``, ``bench/many/c1``, ... one by one up
to ``--channels``. A second client (identity ``peer``, in its own process, so that the figures
below are the first client's alone) is added to the oldest channel, ``c0``, at the start.

At each checkpoint (a number of channels created) it prints:

* the time elapsed since the first ``create_channel``;
* the client process's OS threads (``/proc/self/task``, also counted by name) and RSS
  (``VmRSS``);
* the relay server process's RSS and threads (``/proc/<pid>/status``);
* channels that ended on their own (``Channel.closed``; should be 0);
* the send -> receive latency on the oldest channel, median and p90 of ``--samples`` messages
  sent one at a time: from the start of the many-client's ``send`` to the peer's ``receive``
  returning (both clocks are ``perf_counter``, system-wide on Linux).

At the end, a table of every checkpoint: the latencies as a ratio of the first checkpoint's
(the baseline of the same run), and threads and RSS per channel (the growth since before the
first channel, divided by the channels held). A ``create_channel`` or ``send`` that fails (or
does not return within ``--op-timeout``) ends the run: the error, the channels reached and the
figures at that point are printed, then the table, and the exit status is 1. Waits are bounded
everywhere: this script never hangs on the SDK.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http,
# which is why the imports below come after this (E402).
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import contextlib
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from types import FrameType
from typing import TypeVar

from tests.support.server import ServerProcess

_T = TypeVar("_T")

PREFIX = "bench/many/c"
OLDEST = f"{PREFIX}0"
MIB = 1024 * 1024
#: Longest uninterrupted wait of the main thread (s).
_SLICE = 0.2
#: Set when closing the client did not return: its threads may keep the interpreter from exiting.
_stuck = threading.Event()


# -- the peer: the oldest channel's receiver, in its own process -------------------------------


def peer(relay: str, data_dir: str, conn: Connection) -> None:
    """Joins the oldest channel, then answers each ``("receive", timeout)`` with
    ``("ok", perf_counter_ns at receipt, payload)`` or ``("error", text)``, until ``"stop"``."""
    # Ctrl-C reaches the whole process group: the driver reports it, quietly here.
    with contextlib.suppress(KeyboardInterrupt):
        _peer(relay, data_dir, conn)


def _peer(relay: str, data_dir: str, conn: Connection) -> None:
    from static_sdk import StaticClient

    with StaticClient(relay, data_dir, b"peer") as client:
        conn.send(client.generate_key_package())
        channel = client.join_channel(OLDEST, conn.recv())
        conn.send("joined")
        while True:
            command = conn.recv()
            if command == "stop":
                return
            _, timeout = command
            try:
                payload = channel.receive(timeout)
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which prints it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("ok", time.perf_counter_ns(), payload))


# -- figures of a process (Linux /proc) --------------------------------------------------------


def _status(pid: int | str) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _rss(pid: int | str) -> int:
    """Resident set size in bytes (0 if the process is gone)."""
    value = _status(pid).get("VmRSS", "0 kB").split()[0]
    return int(value) * 1024


def _threads(pid: int | str) -> int:
    return int(_status(pid).get("Threads", "0"))


def _thread_names(pid: int | str = "self") -> str:
    """The process's threads counted by name (``comm``), most common first."""
    names: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ""
    for task in tasks:
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    ranked = sorted(names.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{name} {count}" for name, count in ranked)


# -- bounded calls -----------------------------------------------------------------------------


class OpTimeout(Exception):
    """An SDK call did not return in time."""


def bounded(fn: Callable[[], _T], timeout: float, what: str) -> _T:
    """``fn()`` in a daemon thread, waiting at most ``timeout`` s for it (the SDK's calls take no
    timeout of their own). The thread is gone again once it returns, so it does not show in the
    thread counts taken between calls."""
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, re-raised there
            error.append(exc)

    thread = threading.Thread(target=run, name=f"bench: {what}", daemon=True)
    thread.start()
    # In slices: a signal (Ctrl-C) may land on one of the SDK's threads, and the main thread
    # only raises it once it runs Python code again.
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(min(_SLICE, max(0.0, deadline - time.monotonic())))
    if thread.is_alive():
        raise OpTimeout(f"{what} did not return within {timeout:g} s")
    if error:
        raise error[0]
    return result[0]


def answered(conn: Connection, timeout: float) -> bool:
    """``conn.poll(timeout)`` in slices, for the same reason as :func:`bounded`."""
    deadline = time.monotonic() + timeout
    while not conn.poll(min(_SLICE, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return False
    return True


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Point:
    """The figures at one checkpoint."""

    channels: int
    elapsed: float
    threads: int
    rss: int
    relay_rss: int
    relay_threads: int
    ended: int
    latencies: list[float] = field(default_factory=list)  # ms, sorted
    latency_error: str = ""
    thread_names: str = ""

    def median(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    def p90(self) -> float | None:
        if not self.latencies:
            return None
        return self.latencies[min(len(self.latencies) - 1, int(len(self.latencies) * 0.9))]


class Failed(Exception):
    """A create_channel or a send failed: the run ends."""


def latency(
    channel: object, conn: Connection, samples: int, timeout: float, op_timeout: float
) -> tuple[list[float], str]:
    """``samples`` send -> receive latencies (ms, sorted) on the oldest channel, one message at a
    time, and the error that cut them short ("" if none). A failed send raises :class:`Failed`."""
    from static_sdk import Channel

    assert isinstance(channel, Channel)
    spans: list[float] = []
    for seq in range(samples):
        conn.send(("receive", timeout))
        started = time.perf_counter_ns()
        payload = f"{seq}:{started}".encode()
        try:
            bounded(partial(channel.send, payload), op_timeout, f"send on {OLDEST}")
        except Exception as exc:  # any failure ends the run, with its text
            # The peer is still waiting for it: collect its answer (a timeout) before going on.
            if answered(conn, timeout + 10):
                conn.recv()
            raise Failed(f"send on {OLDEST} failed: {type(exc).__name__}: {exc}") from exc
        while True:
            if not answered(conn, timeout + 10):
                return sorted(spans), f"the peer did not answer within {timeout + 10:g} s"
            answer = conn.recv()
            if answer[0] == "error":
                return sorted(spans), f"peer's receive: {answer[1]}"
            _, received, got = answer
            if got == payload:
                spans.append((received - started) / 1e6)
                break
            # A late message of an earlier sample that timed out: wait for ours.
            conn.send(("receive", timeout))
    return sorted(spans), ""


def snapshot(
    channels: list[object], started: float, relay_pid: int
) -> tuple[int, float, int, int, int, int, int]:
    from static_sdk import Channel

    ended = sum(1 for c in channels if isinstance(c, Channel) and c.closed)
    return (
        len(channels),
        time.perf_counter() - started,
        len(os.listdir("/proc/self/task")),
        _rss("self"),
        _rss(relay_pid),
        _threads(relay_pid),
        ended,
    )


def checkpoint(
    channels: list[object],
    started: float,
    relay_pid: int,
    conn: Connection,
    args: argparse.Namespace,
) -> Point:
    """The figures now; the thread and RSS figures are taken before the latency's sends."""
    count, elapsed, threads, rss, relay_rss, relay_threads, ended = snapshot(
        channels, started, relay_pid
    )
    point = Point(count, elapsed, threads, rss, relay_rss, relay_threads, ended)
    point.thread_names = _thread_names()
    point.latencies, point.latency_error = latency(
        channels[0], conn, args.samples, args.receive_timeout, args.op_timeout
    )
    return point


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def show(point: Point) -> None:
    line = (
        f"  {point.channels:>6} channels  {point.elapsed:8.1f} s  threads {point.threads:>6}"
        f"  client RSS {point.rss / MIB:8.1f} MiB  relay RSS {point.relay_rss / MIB:8.1f} MiB"
        f" ({point.relay_threads} threads)  ended {point.ended}"
        f"  | c0 send->receive median {_ms(point.median())} ms, p90 {_ms(point.p90())} ms"
        f" ({len(point.latencies)} samples)"
    )
    print(line, flush=True)
    if point.thread_names:
        print(f"    client threads by name: {point.thread_names}", flush=True)
    if point.latency_error:
        print(f"    latency cut short: {point.latency_error}", flush=True)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def summary(points: list[Point], start: tuple[int, int, int]) -> None:
    """The table; ``start`` is (threads, client RSS, relay RSS) before the first channel."""
    threads0, rss0, relay0 = start
    print()
    print(
        f"before the first channel: {threads0} threads, client RSS {rss0 / MIB:.1f} MiB,"
        f" relay RSS {relay0 / MIB:.1f} MiB"
    )
    print("per-channel columns (/ch): growth since the previous row over the channels added")
    header = (
        f"{'channels':>8} {'elapsed s':>9} {'threads':>7} {'thr/ch':>6} {'RSS MiB':>8}"
        f" {'KiB/ch':>7} {'relay MiB':>9} {'KiB/ch':>7} {'ended':>5}"
        f" {'median ms':>9} {'p90 ms':>7} {'median/1st':>10} {'p90/1st':>8}"
    )
    print(header)
    print("-" * len(header))
    base = next((p for p in points if p.latencies), None)
    before = (0, threads0, rss0, relay0)
    for p in points:
        added = p.channels - before[0]

        def per(value: float, width: int, fmt: str, added: int = added) -> str:
            # "-" on a row with no channels added (the failure point after a checkpoint).
            return f"{value / added:>{width}{fmt}}" if added > 0 else f"{'-':>{width}}"

        relay = f"{'gone':>9} {'-':>7}"  # the server process has exited
        if p.relay_rss:
            relay = f"{p.relay_rss / MIB:>9.1f} {per((p.relay_rss - before[3]) / 1024, 7, '.1f')}"
        print(
            f"{p.channels:>8} {p.elapsed:>9.1f} {p.threads:>7}"
            f" {per(p.threads - before[1], 6, '.2f')}"
            f" {p.rss / MIB:>8.1f} {per((p.rss - before[2]) / 1024, 7, '.1f')} {relay}"
            f" {p.ended:>5} {_ms(p.median()):>9} {_ms(p.p90()):>7}"
            f" {_ratio(p.median(), base.median() if base else None):>10}"
            f" {_ratio(p.p90(), base.p90() if base else None):>8}"
        )
        before = (p.channels, p.threads, p.rss, p.relay_rss or before[3])
    if base is not None:
        print(f"(latency ratios against the first checkpoint with a latency: {base.channels})")
    if points:
        last = points[-1]
        n = max(last.channels, 1)
        print(
            f"overall per channel ({last.channels} channels against none):"
            f" {(last.threads - threads0) / n:.2f} threads,"
            f" client {(last.rss - rss0) / 1024 / n:.1f} KiB"
            + (f", relay {(last.relay_rss - relay0) / 1024 / n:.1f} KiB" if last.relay_rss else "")
        )


def run(args: argparse.Namespace, checkpoints: list[int], tmp: str) -> int:
    """The whole measurement; returns the exit status."""
    from static_sdk import Channel, StaticClient

    server = ServerProcess(
        Path(f"{tmp}/server"),
        extra_args=["--allow-anonymous", "--relay-publish-rate", "0"],
    )
    receiver = None
    ours, theirs = mp.get_context("spawn").Pipe()
    points: list[Point] = []
    status = 0
    try:
        server.start()
        assert server.proc is not None
        relay_pid = server.proc.pid
        print(f"static serve (pid {relay_pid}) relay at {server.relay_url}; SQLite in {tmp}")
        receiver = mp.get_context("spawn").Process(
            target=peer, args=(server.relay_url, f"{tmp}/peer", theirs), daemon=True
        )
        receiver.start()
        client = StaticClient(server.relay_url, f"{tmp}/many", b"many")
        try:
            start = (len(os.listdir("/proc/self/task")), _rss("self"), _rss(relay_pid))
            channels: list[object] = []

            def create() -> None:
                name = f"{PREFIX}{len(channels)}"
                try:
                    made = bounded(
                        partial(client.create_channel, name),
                        args.op_timeout,
                        f"create_channel({name!r})",
                    )
                except Exception as exc:  # reported, then the run ends
                    raise Failed(
                        f"create_channel({name!r}) failed: {type(exc).__name__}: {exc}"
                    ) from exc
                channels.append(made)

            started = time.perf_counter()
            try:
                create()
                if not answered(ours, 60):
                    raise Failed("the peer sent no key package within 60 s")
                key_package = ours.recv()
                oldest = channels[0]
                assert isinstance(oldest, Channel)
                try:
                    welcome = bounded(
                        partial(oldest.add_member, key_package), args.op_timeout, "add_member"
                    )
                except Exception as exc:  # reported, then the run ends
                    raise Failed(f"add_member failed: {type(exc).__name__}: {exc}") from exc
                ours.send(welcome)
                if not answered(ours, 60) or ours.recv() != "joined":
                    raise Failed("the peer did not join the oldest channel within 60 s")
                # Warm-up (the first sends open the publishing call), not counted.
                latency(oldest, ours, 3, args.receive_timeout, args.op_timeout)
                print(f"peer joined {OLDEST}; creating channels up to {args.channels}", flush=True)
                for n in checkpoints:
                    while len(channels) < n:
                        create()
                    points.append(checkpoint(channels, started, relay_pid, ours, args))
                    show(points[-1])
            except Failed as failure:
                status = 1
                print(f"FAILED: {failure}", flush=True)
                print(f"  channels reached: {len(channels)}", flush=True)
                if channels:
                    print("  figures at that point:", flush=True)
                    try:
                        point = checkpoint(channels, started, relay_pid, ours, args)
                    except Failed as again:
                        c, el, th, rss, rrss, rth, ended = snapshot(channels, started, relay_pid)
                        point = Point(c, el, th, rss, rrss, rth, ended, [], str(again))
                    show(point)
                    points.append(point)
            summary(points, start)
        finally:
            if receiver.is_alive():
                ours.send("stop")
                receiver.join(15)
            # Closing stops every channel's background work; bounded, like every SDK call here.
            try:
                bounded(client.close, 60, "closing the client")
            except OpTimeout as exc:
                print(f"warning: {exc}", file=sys.stderr)
                status = status or 1
                _stuck.set()
    finally:
        if receiver is not None and receiver.is_alive():
            receiver.terminate()
            receiver.join(5)
        server.stop(30)
    return status


def _checkpoints(text: str, channels: int) -> list[int]:
    wanted = sorted({int(n) for n in text.split(",") if n.strip()} | {channels})
    return [n for n in wanted if 1 <= n <= channels]


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--channels", type=int, default=10_000, help="default %(default)s")
    parser.add_argument(
        "--checkpoints",
        default="1,10,100,1000,5000,10000",
        help="comma-separated channel counts to measure at (--channels is always one; default"
        " %(default)s; the first one's latency is the baseline of the ratios)",
    )
    parser.add_argument(
        "--samples", type=int, default=20, help="latency samples per checkpoint (default 20)"
    )
    parser.add_argument(
        "--receive-timeout",
        type=float,
        default=10.0,
        help="seconds the peer waits for each sample (default %(default)s)",
    )
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=120.0,
        help="seconds a create_channel, add_member or send may take before the run ends"
        " (default %(default)s)",
    )
    args = parser.parse_args()
    if args.channels < 1 or args.samples < 1:
        parser.error("--channels and --samples must be >= 1")
    checkpoints = _checkpoints(args.checkpoints, args.channels)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        with tempfile.TemporaryDirectory(prefix="static-channels-") as tmp:
            status = run(args, checkpoints, tmp)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({str(exc) or 'Ctrl-C'}); the server is stopped", file=sys.stderr)
        status = 130
    sys.stdout.flush()
    if _stuck.is_set():
        os._exit(status)  # the server is stopped and the directory removed: nothing is left
    sys.exit(status)


if __name__ == "__main__":
    main()
