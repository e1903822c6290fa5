"""Membership commits through the SDK: add_member and rotate_keys latency against group size.

    .venv/bin/python bench/membership.py [--sizes 2,32,128,512] [--repeat N] [--warmup N]
                                         [--no-member] [--no-engine]

Starts a real ``static serve --allow-anonymous`` (embedded SQLite, temporary data directory,
loopback only, ports picked by the OS; stopped at the end, on failure and on Ctrl-C too). The
server is ``sys.executable -m static serve`` with this process's environment, run from the
temporary directory, so it imports the same ``static`` package as this script (checked: the
``_native`` library mapped into the server process is printed).

One SDK client (identity ``creator``) creates ``bench/membership/group``. A second SDK client
(identity ``member``, in its own process) joins it at once and stays a live member: every
commit is also received and applied by it (``--no-member`` leaves it out). The group is then
grown, size by size in increasing order, with ``Channel.add_member`` (one commit each, through
the relay) of synthetic key packages (``static._native.bench.synthetic_key_packages``: throwaway
identities ``member-<i>`` built like ``generate_key_package``'s, whose private keys are
dropped; they never join). N counts every leaf: creator, live member and synthetic members.

At each size N, timed from the call to its return (the commit is in the relay's log and
merged by the creator's applier):

* ``add_member`` of a fresh key package of a real ``StaticClient`` (identity ``joiner``,
  generated before the timer), followed, untimed for the add, by ``remove_member(b"joiner")``,
  so every sample is taken at exactly N members (the remove is timed too and shown);
* ``rotate_keys`` by the creator.

Then the creator sends ``SENDS`` 1 KiB messages and the size of its SQLite WAL file is shown
(with the largest seen after an add while growing): what the client keeps on disk beside its
database.

Each is repeated ``--repeat`` times after ``--warmup`` uncounted ones. After each call the
script waits until the live member has reached the new epoch (polling ``Channel.epoch()``,
started once the call returned), so calls never overlap with the member's processing of the
previous one; that wait is shown as the member's lag. Around each call it reads the CPU time
of the three processes (creator, relay, member; Linux ``/proc/<pid>/task/*/schedstat``).

Only the creator ever commits, so the tree's parent nodes off its own path stay blank and each
of its commits (an add carries an update path too) encrypts the new path secrets to every other
leaf: N - 1 HPKE encryptions, the worst case of RFC 9420's tree. A group whose members also
commit now and then fills those nodes in and costs less; this measures the bound.

For reference, the same commits by the MLS engine alone (``static._native.mls.Engine``: create +
merge, durable SQLite writes, no relay, no SDK) on a group of the same size built in one
commit (``--no-engine`` skips it).

Prints a table of medians and p90 (ms) per size, with each size's median as a ratio of the
N=2 median (of the smallest size when 2 is not measured), then where the time goes, and the
machine's floor in the same run: the latency of one durable 4 KiB write (``fdatasync``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http,
# here and in the spawned member process, which is why the imports below come after this
# (E402). The repository root is appended, not put first: a ``static`` package on PYTHONPATH
# (another build under test) must win over this checkout's sources.
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any, cast

from tests.support.server import ServerProcess

CHANNEL = "bench/membership/group"
MEMBER = b"member"
JOINER = b"joiner"
#: 1 KiB messages the creator sends at each size once the commits are measured; then its WAL
#: file's size is read.
SENDS = 200


# -- the live member, in its own process --------------------------------------------------------


def member(relay: str, data_dir: str, conn: Connection) -> None:
    """Joins the channel, then answers each ``("epoch", target, timeout)`` with ``("ok",
    perf_counter when its channel reached epoch >= target)`` or ``("error", text)``."""
    # Ctrl-C reaches the whole process group: the driver reports it, quietly here.
    with contextlib.suppress(KeyboardInterrupt):
        _member(relay, data_dir, conn)


def _member(relay: str, data_dir: str, conn: Connection) -> None:
    from static import _native
    from static_sdk import StaticClient

    with StaticClient(relay, data_dir, MEMBER) as client:
        conn.send((client.generate_key_package(), _native.__file__))
        channel = client.join_channel(CHANNEL, conn.recv())
        conn.send("joined")
        while True:
            command = conn.recv()
            if command == "stop":
                return
            _, target, timeout = command
            deadline = time.perf_counter() + timeout
            try:
                while (epoch := channel.epoch()) < target:
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"still at epoch {epoch} < {target} after {timeout} s")
                    time.sleep(0.0002)
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which prints it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("ok", time.perf_counter()))


# -- figures of a process (Linux /proc) ---------------------------------------------------------


def _cpu_ns(pid: int) -> int:
    """CPU time (ns) of a process's live threads (``/proc/<pid>/task/*/schedstat``); threads
    that have ended are not counted, which is why the relay's and clients' long-lived worker
    threads are what this sees."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def _machine_busy_s() -> float:
    """CPU time (s) the whole machine has spent busy so far, all cores (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return 0.0
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait.
    ticks = [int(v) for v in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _filesystem(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (longest mount-point prefix)."""
    best, kind = "", "?"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    real = os.path.realpath(path)
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1]
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, parts[2]
    return kind


def _git_revision(directory: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(directory), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{rev}{' (+ uncommitted changes)' if dirty else ''}"


def _sqlite_source_id(library: str) -> str:
    """The SQLite source id compiled into ``library`` (rusqlite's bundled SQLite), or '?'."""
    try:
        data = Path(library).read_bytes()
    except OSError:
        return "?"
    found = re.search(rb"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d [0-9a-f]{40,64}", data)
    return found.group().decode()[:30] + "..." if found else "?"


def _durable_write_ms(directory: str, count: int = 100, pause: float = 0.001) -> list[float]:
    """Latencies (ms) of writing 4 KiB over allocated space in ``directory`` and waiting for the
    disk (``fdatasync``), one write every ``pause``: the floor of one durable commit (as in
    bench/e2e.py). A commit through the SDK holds about three: the creator's pending commit,
    the relay's append, the creator's merge."""
    path = os.path.join(directory, "durable-write-probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, bytes(count * 4096))
        os.fsync(fd)
        block = os.urandom(4096)
        spans = []
        for i in range(count):
            time.sleep(pause)
            started = time.perf_counter()
            os.pwrite(fd, block, i * 4096)
            os.fdatasync(fd)
            spans.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    return spans


def _mapped_native(pid: int) -> str:
    """The ``_native`` extension mapped into process ``pid``."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "?"
    paths = {line.split()[-1] for line in maps.splitlines() if "_native" in line}
    return ", ".join(sorted(paths)) or "none"


# -- measuring ----------------------------------------------------------------------------------


def _wal_kib(data_dir: str) -> float:
    """The size of the SQLite write-ahead log of the client or engine under ``data_dir``."""
    wal = Path(data_dir) / "mls.sqlite3-wal"
    return wal.stat().st_size / 1024 if wal.exists() else 0.0


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


@dataclass
class Op:
    """The samples of one kind of call at one size."""

    ms: list[float] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)  # member's epoch reached after return
    cpu_ms: dict[str, float] = field(default_factory=dict)  # summed over the samples

    def median(self) -> float:
        return statistics.median(self.ms) if self.ms else float("nan")

    def p90(self) -> float:
        return _p90(self.ms) if self.ms else float("nan")

    def cpu_per_call(self, name: str) -> float:
        return self.cpu_ms.get(name, 0.0) / len(self.ms) if self.ms else float("nan")


@dataclass
class Size:
    """Everything measured at one group size."""

    n: int
    grow_s: float = 0.0
    others_cores: float = float("nan")  # other processes' CPU while measuring, in cores
    add: Op = field(default_factory=Op)
    remove: Op = field(default_factory=Op)
    rotate: Op = field(default_factory=Op)
    welcome_bytes: int = 0
    engine_add: list[float] = field(default_factory=list)
    engine_rotate: list[float] = field(default_factory=list)
    engine_commit_bytes: int = 0
    mlsrs_add: list[float] = field(default_factory=list)
    # CPU time of this process (all its threads) per add, ms: without the disk's waits, which
    # dominate the engine's wall time on a busy disk (mls-rs writes nothing).
    engine_add_cpu: list[float] = field(default_factory=list)
    mlsrs_add_cpu: list[float] = field(default_factory=list)
    # The creator's SQLite WAL file after the measured calls and SENDS messages.
    wal_kib: float = float("nan")
    wal_peak_kib: float = 0.0  # its largest size seen after an add while growing to this size


class Failed(Exception):
    """A call or the member failed: the run ends."""


class Driver:
    """The creator's channel, the live member's pipe, and the processes' CPU counters."""

    def __init__(
        self, channel: object, conn: Connection | None, pids: dict[str, int], timeout: float
    ) -> None:
        from static_sdk import Channel

        assert isinstance(channel, Channel)
        self.channel = channel
        self.conn = conn
        self.pids = pids
        self.timeout = timeout

    def cpu(self) -> dict[str, int]:
        return {name: _cpu_ns(pid) for name, pid in self.pids.items()}

    def member_caught_up(self) -> float:
        """Waits until the member has the creator's epoch; perf_counter when it had it."""
        if self.conn is None:
            return time.perf_counter()
        target = self.channel.epoch()
        self.conn.send(("epoch", target, self.timeout))
        if not self.conn.poll(self.timeout + 10):
            raise Failed(f"the member did not answer within {self.timeout + 10:g} s")
        answer = self.conn.recv()
        if answer[0] != "ok":
            raise Failed(f"the member did not reach epoch {target}: {answer[1]}")
        seen: float = answer[1]
        return seen

    def timed(self, call: Callable[[], object], op: Op | None) -> object:
        """``call()``; with ``op``, its latency, the member's lag and the CPU go into ``op``."""
        before = self.cpu()
        started = time.perf_counter()
        result = call()
        ended = time.perf_counter()
        seen = self.member_caught_up()
        after = self.cpu()
        if op is not None:
            op.ms.append((ended - started) * 1000)
            op.lag_ms.append((seen - ended) * 1000)
            for name in self.pids:
                op.cpu_ms[name] = op.cpu_ms.get(name, 0.0) + (after[name] - before[name]) / 1e6
        return result


def measure_size(driver: Driver, joiner: object, size: Size, repeat: int, warmup: int) -> None:
    from static_sdk import StaticClient

    assert isinstance(joiner, StaticClient)
    channel = driver.channel
    machine, ours, started = _machine_busy_s(), driver.cpu(), time.perf_counter()
    for i in range(warmup + repeat):
        counted = i >= warmup
        key_package = joiner.generate_key_package()
        welcome = driver.timed(
            partial(channel.add_member, key_package), size.add if counted else None
        )
        assert isinstance(welcome, bytes)
        size.welcome_bytes = len(welcome)
        driver.timed(partial(channel.remove_member, JOINER), size.remove if counted else None)
    for i in range(warmup + repeat):
        driver.timed(channel.rotate_keys, size.rotate if i >= warmup else None)
    wall = time.perf_counter() - started
    ours_s = sum(driver.cpu().values()) / 1e9 - sum(ours.values()) / 1e9
    size.others_cores = (_machine_busy_s() - machine - ours_s) / wall
    members = len(channel.members())
    if members != size.n:
        raise Failed(f"the group has {members} members at N={size.n}")


def engine_reference(root: Path, size: Size, repeat: int, warmup: int) -> None:
    """The same commits by the MLS engine alone (create + merge; durable; no relay)."""
    from static._native.bench import synthetic_key_packages
    from static._native.mls import Engine

    channel = "bench/membership/engine"
    creator = Engine(root / f"engine-{size.n}", b"creator")
    joiner = Engine(root / f"engine-joiner-{size.n}", JOINER)
    try:
        creator.create_group(channel)
        if size.n > 1:
            creator.add_members(channel, synthetic_key_packages(size.n - 1))
            creator.merge_pending_commit(channel)
        for i in range(warmup + repeat):
            key_package = joiner.generate_key_package()
            started, cpu = time.perf_counter(), time.process_time()
            commit, _ = creator.add_member(channel, key_package)
            creator.merge_pending_commit(channel)
            if i >= warmup:
                size.engine_add.append((time.perf_counter() - started) * 1000)
                size.engine_add_cpu.append((time.process_time() - cpu) * 1000)
                size.engine_commit_bytes = len(commit)
            creator.remove_member(channel, JOINER)
            creator.merge_pending_commit(channel)
        for i in range(warmup + repeat):
            started = time.perf_counter()
            creator.self_update(channel)
            creator.merge_pending_commit(channel)
            if i >= warmup:
                size.engine_rotate.append((time.perf_counter() - started) * 1000)
    finally:
        creator.close()
        joiner.close()


def mlsrs_reference(size: Size, repeat: int, warmup: int) -> None:
    """The same add by mls-rs (``agentvault-mls-rs-uniffi``, the dev extra): its creator adds a
    member to a group of the same size built in one commit and applies its commit (in memory, no
    disk, no relay); the commit is then undone by removing the member again."""
    try:
        import mls_rs_uniffi as mls  # type: ignore[import-untyped]
    except ImportError:
        return
    suite = mls.CipherSuite.CURVE25519_AES128

    def client(name: bytes) -> object:
        keys = mls.generate_signature_keypair(suite)
        return mls.Client(name, keys, mls.client_config_default())

    creator: Any = client(b"creator")
    group: Any = creator.create_group(None)
    if size.n > 1:
        packages = [
            mls.Message.from_bytes(
                cast(Any, client(f"member-{i}".encode())).generate_key_package_message().to_bytes()
            )
            for i in range(size.n - 1)
        ]
        group.process_incoming_message(group.add_members(packages).commit_message)
    joiner: Any = client(JOINER)
    for i in range(warmup + repeat):
        key_package = joiner.generate_key_package_message()
        started, cpu = time.perf_counter(), time.process_time()
        group.process_incoming_message(group.add_members([key_package]).commit_message)
        if i >= warmup:
            size.mlsrs_add.append((time.perf_counter() - started) * 1000)
            size.mlsrs_add_cpu.append((time.process_time() - cpu) * 1000)
        removal = group.remove_members([joiner.signing_identity()])
        group.process_incoming_message(removal.commit_message)


def run(args: argparse.Namespace, sizes: list[int], tmp: str) -> tuple[list[Size], list[float]]:
    import static
    from static import _native
    from static._native.bench import synthetic_key_packages
    from static_sdk import StaticClient

    native_path = _native.__file__ or "?"
    print(
        f"code under test: {Path(static.__file__ or '?').parent}"
        f" (git {_git_revision(Path(static.__file__ or '.').parent)})"
    )
    print(f"  extension: {native_path}")
    print(f"bench script:    {_HERE.parent} (git {_git_revision(_HERE.parent)})")
    print(f"python {sys.version.split()[0]} ({sys.executable}); {os.cpu_count()} CPUs")

    server = ServerProcess(
        Path(f"{tmp}/server"),
        extra_args=["--allow-anonymous", "--relay-publish-rate", "0"],
        cwd=Path(tmp),  # ``-m static`` puts the cwd first on sys.path: not a checkout's sources
    )
    receiver = None
    ours, theirs = mp.get_context("spawn").Pipe()
    results: list[Size] = []
    disk = _durable_write_ms(tmp)
    try:
        server.start()
        assert server.proc is not None
        relay_pid = server.proc.pid
        server_native = _mapped_native(relay_pid)
        print(
            f"static serve (pid {relay_pid}) relay at {server.relay_url}, anonymous,"
            f" no publish rate limit; its extension: {server_native}"
        )
        if server_native != native_path:
            print("  WARNING: the server runs another build than this process", flush=True)
        print(
            f"store: embedded SQLite, {tmp}/server/static.db ({_filesystem(tmp)});"
            f" relay and clients use rusqlite's bundled SQLite"
            f" (source id {_sqlite_source_id(native_path)}), the HTTP API Python's sqlite3"
            f" {sqlite3.sqlite_version}; clients' commits are fsynced"
        )
        pids = {"creator": os.getpid(), "relay": relay_pid}
        if not args.no_member:
            receiver = mp.get_context("spawn").Process(
                target=member, args=(server.relay_url, f"{tmp}/member", theirs), daemon=True
            )
            receiver.start()
            assert receiver.pid is not None
            pids["member"] = receiver.pid
        filler = synthetic_key_packages(max(sizes))
        with (
            StaticClient(server.relay_url, f"{tmp}/creator", b"creator") as client,
            StaticClient(server.relay_url, f"{tmp}/joiner", JOINER) as joiner,
        ):
            channel = client.create_channel(CHANNEL)
            members = 1
            conn: Connection | None = None
            if receiver is not None:
                if not ours.poll(60):
                    raise Failed("the member sent no key package within 60 s")
                key_package, member_native = ours.recv()
                if member_native != native_path:
                    print(f"  WARNING: the member runs another build: {member_native}")
                ours.send(channel.add_member(key_package))
                if not ours.poll(60) or ours.recv() != "joined":
                    raise Failed("the member did not join within 60 s")
                members = 2
                conn = ours
            print(
                f"creator + {'live member (own process) + ' if conn else ''}synthetic members"
                f" (key packages of static._native.bench.synthetic_key_packages, added one by one"
                f" with Channel.add_member); measured adds: fresh key packages of a real"
                f" StaticClient, removed again after each add (N held)",
                flush=True,
            )
            driver = Driver(channel, conn, pids, args.op_timeout)
            next_filler = 0
            for n in sizes:
                size = Size(n)
                started = time.perf_counter()
                while members < n:
                    channel.add_member(filler[next_filler])
                    next_filler += 1
                    members += 1
                    size.wal_peak_kib = max(size.wal_peak_kib, _wal_kib(f"{tmp}/creator"))
                driver.member_caught_up()
                size.grow_s = time.perf_counter() - started
                measure_size(driver, joiner, size, args.repeat, args.warmup)
                # A run of application messages, as a chat would send between two commits.
                for _ in range(SENDS):
                    channel.send(bytes(1024))
                size.wal_kib = _wal_kib(f"{tmp}/creator")
                if not args.no_engine:
                    engine_reference(Path(tmp), size, args.repeat, args.warmup)
                    mlsrs_reference(size, args.repeat, args.warmup)
                results.append(size)
                print(
                    f"  N={n:<4} grown in {size.grow_s:5.1f} s; add {size.add.median():7.2f} ms,"
                    f" rotate {size.rotate.median():7.2f} ms (medians of {args.repeat}),"
                    f" epoch {channel.epoch()}; creator's WAL {size.wal_kib:.0f} KiB (at most"
                    f" {size.wal_peak_kib:.0f} KiB while growing);"
                    f" other processes used {size.others_cores:.2f} cores meanwhile",
                    flush=True,
                )
            if receiver is not None:
                ours.send("stop")
                receiver.join(30)
    finally:
        if receiver is not None and receiver.is_alive():
            receiver.terminate()
            receiver.join(5)
        server.stop(30)
    disk += _durable_write_ms(tmp)
    return results, disk


# -- the report ---------------------------------------------------------------------------------


def report(results: list[Size], disk: list[float], args: argparse.Namespace) -> None:
    if not results:
        return
    base = next((s for s in results if s.n == 2), results[0])
    member = not args.no_member
    print()
    print(
        f"latency of one call (ms), {args.repeat} samples per cell after {args.warmup} warm-up"
        f" calls; ratio = median / median at N={base.n}"
        + ("; each commit also applied by the live member" if member else "")
    )
    header = (
        f"{'N':>5} | {'add median':>10} {'p90':>7} {'ratio':>6} | {'rotate median':>13}"
        f" {'p90':>7} {'ratio':>6} | {'remove median':>13} | {'welcome KiB':>11}"
        f" | {'creator WAL KiB':>15}"
    )
    print(header)
    print("-" * len(header))
    for s in results:
        print(
            f"{s.n:>5} | {s.add.median():>10.2f} {s.add.p90():>7.2f}"
            f" {s.add.median() / base.add.median():>5.2f}x | {s.rotate.median():>13.2f}"
            f" {s.rotate.p90():>7.2f} {s.rotate.median() / base.rotate.median():>5.2f}x |"
            f" {s.remove.median():>13.2f} | {s.welcome_bytes / 1024:>11.1f}"
            f" | {s.wal_kib:>15.0f}"
        )
    print()
    print(
        "where the time goes (medians, ms; CPU: ms per call, summed over each process's"
        " threads, from the call until the member had the epoch)"
    )
    names = ["creator", "relay"] + (["member"] if member else [])
    cpu_head = " ".join(f"{name:>7}" for name in names)
    header = (
        f"{'N':>5} | {'engine add':>10} {'rotate':>7} {'commit KiB':>10}"
        f" {'mls-rs add':>10} {'engine/mls-rs':>13} {'CPU engine':>10} {'mls-rs':>6} {'ratio':>6} |"
        f" {'add: SDK-engine':>15} {'rotate: SDK-engine':>18} |"
        + (f" {'member lag add':>14} {'rotate':>6} |" if member else "")
        + f" add CPU {cpu_head} | rotate CPU {cpu_head} | {'grow s':>6} {'others':>6}"
    )
    print(header)
    print("-" * len(header))
    for s in results:
        if s.engine_add:
            ea, er = statistics.median(s.engine_add), statistics.median(s.engine_rotate)
            engine = f"{ea:>10.2f} {er:>7.2f} {s.engine_commit_bytes / 1024:>10.1f}"
            if s.mlsrs_add:
                rs = statistics.median(s.mlsrs_add)
                ec, rc = statistics.median(s.engine_add_cpu), statistics.median(s.mlsrs_add_cpu)
                engine += (
                    f" {rs:>10.2f} {ea / rs:>12.2f}x {ec:>10.2f} {rc:>6.2f} {ec / rc:>5.2f}x |"
                )
            else:
                engine += f" {'-':>10} {'-':>13} {'-':>10} {'-':>6} {'-':>6} |"
            over = f" {s.add.median() - ea:>15.2f} {s.rotate.median() - er:>18.2f} |"
        else:
            engine = (
                f"{'-':>10} {'-':>7} {'-':>10} {'-':>10} {'-':>13} {'-':>10} {'-':>6} {'-':>6} |"
            )
            over = f" {'-':>15} {'-':>18} |"
        lag = ""
        if member:
            lag = (
                f" {statistics.median(s.add.lag_ms):>14.2f}"
                f" {statistics.median(s.rotate.lag_ms):>6.2f} |"
            )
        add_cpu = " ".join(f"{s.add.cpu_per_call(name):>7.2f}" for name in names)
        rot_cpu = " ".join(f"{s.rotate.cpu_per_call(name):>7.2f}" for name in names)
        print(
            f"{s.n:>5} | {engine}{over}{lag} add CPU {add_cpu} | rotate CPU {rot_cpu} |"
            f" {s.grow_s:>6.1f} {s.others_cores:>6.2f}"
        )
    print(
        "engine = static._native.mls.Engine alone (create the commit + merge it, durable SQLite"
        " writes; no relay, no SDK) on a group of the same size; mls-rs add = the same add by"
        " mls-rs (agentvault-mls-rs-uniffi, in memory: no disk) and its commit applied; CPU ="
        " this process's CPU time per add (all threads; without the disk's waits);"
        " SDK-engine = what the relay"
        " round trip, the SDK's commit protocol and its applier add."
        + (
            " member lag = from the creator's call returning until the member's Channel.epoch()"
            " showed the new epoch (polled every 0.2 ms)."
            if member
            else ""
        )
        + " others = CPU of every other process on the machine while this size was measured,"
        " in cores (of os.cpu_count()): what competed with the run."
    )
    print(
        f"this machine, same run: a durable 4 KiB write (fdatasync) median"
        f" {statistics.median(disk):.2f} ms, p90 {_p90(disk):.2f} ms ({len(disk)} writes, half"
        f" before and half after; an SDK commit holds about 3: creator's pending commit,"
        f" relay's append, creator's merge)"
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="2,32,128,512",
        help="comma-separated group sizes N >= 2 (members, creator included), measured in"
        " increasing order (default %(default)s)",
    )
    parser.add_argument(
        "--repeat", type=int, default=20, help="timed calls per operation and size (default 20)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed calls before them (default 2)"
    )
    parser.add_argument(
        "--no-member", action="store_true", help="no live member: the creator alone applies"
    )
    parser.add_argument(
        "--no-engine", action="store_true", help="skip the engine-alone reference figures"
    )
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=120.0,
        help="seconds the member may take to reach an epoch (default %(default)s)",
    )
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    if not sizes or sizes[0] < (1 if args.no_member else 2) or args.repeat < 1:
        parser.error("--sizes must be >= 2 (>= 1 with --no-member) and --repeat >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    signal.signal(signal.SIGTERM, _terminate)
    status = 0
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="static-membership-") as tmp:
            results, disk = run(args, sizes, tmp)
        report(results, disk, args)
    except Failed as failure:
        print(f"FAILED: {failure}", flush=True)
        status = 1
    except KeyboardInterrupt as exc:
        print(f"interrupted ({str(exc) or 'Ctrl-C'}); the server is stopped", file=sys.stderr)
        status = 130
    print(f"total {time.perf_counter() - started:.0f} s")
    sys.exit(status)


if __name__ == "__main__":
    main()
