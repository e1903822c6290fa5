"""Bounded at scale (issue 20): one table of the figures that must stay flat as channels, groups
and logs grow. Prints figures; asserts nothing.

    .venv/bin/python bench/scale.py [--quick] [--sections rss,mls,members,publish,prune]
                                    [--idle SECONDS] [--relay-arg=--flag=value ...]

Sections (each a function below; ``--sections`` picks some, always in this order):

* ``rss``: a real ``static serve`` (SQLite, temporary directory, loopback; a fresh one per
  size, stopped at the end, on failure and on Ctrl-C too) whose relay gets 10, 100 and 1,000
  channels (each created from a real MLS group), then 256 messages of 1 KiB on every one of
  them (pipelined PublishBatches), then nothing for ``--idle`` seconds (30). Its RSS from
  ``/proc/<pid>/status`` at the start (after one channel's traffic: the first use's fixed
  costs paid), right after the traffic (busy), at its peak (VmHWM) and after the idle wait;
  ratios against the start.
* ``mls``: encrypt and decrypt of a 1 KiB application message at N = 2, 32, 128, 512 members,
  by the MLS engine (``static._native.mls.Engine``: durable, each call an fsync'd SQLite write) and
  by mls-rs (``mls_rs_uniffi``, the ``agentvault-mls-rs-uniffi`` package of the dev extra, its
  state in memory) in the same run: wall time, and this process's CPU time (what the calls
  compute, without the disk's waits, which dominate the wall time on a busy disk); ratios
  against N=2 and against mls-rs.
* ``members``: add (the commit made and merged; wall and CPU), join (the Welcome processed by a
  new joiner) and rotate (an empty commit with an update path, made and merged) at N members,
  by the engine and by mls-rs; the add commit's size. The group is made in one commit and held
  at N (each added joiner removed again); medians.
* ``publish``: the relay's CPU per publish (``/proc/<pid>/stat``: utime + stime of the whole
  ``static serve`` process, 10 ms ticks) and the pipelined rate on one channel at an empty log,
  then after the log was filled to 400k entries (how long that takes is printed), and the
  relay's disk (:func:`relay_disk`: the SQLite database file plus its WAL) at the end.
* ``prune``: the relay's disk before and after pruning under a 1-hour policy, set through the
  relay's retention RPC (found by name in ``proto/relay.proto``'s Relay service, its request
  filled by field names: ``channel`` and a max-age field), and unary publish latency while it
  prunes: the channel created at the real time, half the entries written by the relay restarted
  with its wall clock 2 hours behind (libfaketime), the other half after a restart at the real
  time. Prints "n/a (no retention RPC)" while the proto has none, and "n/a (no libfaketime)"
  without libfaketime (``apt-get install libfaketime``).

``--relay-arg`` passes flags to every ``static serve`` (e.g. a shorter idle timeout, a cache
budget). ``--quick`` runs smaller sizes (a smoke run, about 15 s). Every figure is from one run
of one build on this machine: the load is printed at the start and at the end, and figures on
a shared 2-core machine vary from run to run (compare the ratios of one run).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http,
# which is why the imports below come after this (E402). The repository root is appended, not
# put first: a ``static`` package on PYTHONPATH (another build under test) must win over this
# checkout's sources.
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

import argparse
import glob
import os
import signal
import sqlite3
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from types import FrameType
from typing import Any, TypeVar

from static import _native
from static._native.bench import synthetic_key_packages
from static._native.mls import Engine
from static.store import relay_database, sqlite_url
from tests.relay._generated import relay_pb2 as pb
from tests.relay.client import Relay
from tests.relay.mls_vectors import sized_application
from tests.support.server import ServerProcess

_T = TypeVar("_T")

PAYLOAD = 1024
KIB = 1024
MIB = 1024 * 1024
SERVICE = "static.relay.v1.Relay"
#: Messages per PublishBatches request (as the SDK's pipelined sends and bench/relay.py).
BATCH = 64
CHANNEL = "bench/scale/log"
#: The rss section's first channel, served before its start figure.
WARM = "bench/scale/warm"
#: The retention policy the prune section sets, and how far behind the old half's clock is.
POLICY_S = 3600
BACKDATE_S = 7200


@dataclass(frozen=True)
class Sizes:
    """What each section measures at; ``--quick`` takes the smaller set."""

    channels: tuple[int, ...]
    #: Messages published on each channel of the rss section.
    per_channel: int
    #: Seconds the rss section leaves the channels idle before measuring again.
    idle: float
    groups: tuple[int, ...]
    #: Messages encrypted and decrypted per group size.
    messages: int
    #: Timed adds, joins and rotates per group size (after one untimed of each).
    repeats: int
    #: Entries in the log when the publish section measures again.
    log: int
    #: Publishes per measuring window of the publish section.
    window: int
    #: Entries written before and after the prune section's restart (each half).
    prune_half: int
    #: Seconds the prune section waits for the background pruning.
    prune_wait: float


FULL = Sizes(
    channels=(10, 100, 1000),
    per_channel=256,
    idle=30.0,
    groups=(2, 32, 128, 512),
    messages=300,
    repeats=5,
    log=400_000,
    window=50_000,
    prune_half=50_000,
    prune_wait=120.0,
)
QUICK = Sizes(
    channels=(10, 100),
    per_channel=16,
    idle=1.0,
    groups=(2, 32),
    messages=20,
    repeats=2,
    log=5_000,
    window=1_000,
    prune_half=1_000,
    prune_wait=10.0,
)
SECTIONS = ("rss", "mls", "members", "publish", "prune")


# -- the table ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: a figure at one size, its ratio against the start of the run
    (the smallest size, or the state before), and a reference (mls-rs) where there is one."""

    figure: str
    size: str
    value: str
    vs_start: str = ""
    reference: str = ""
    vs_reference: str = ""


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def show(rows: Sequence[Row]) -> None:
    """``rows`` as a Markdown table."""
    head = ("figure", "size", "value", "vs start", "mls-rs", "vs mls-rs")
    cells = [head] + [
        (r.figure, r.size, r.value, r.vs_start, r.reference, r.vs_reference) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]

    def line(cols: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |"

    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells[1:]:
        print(line(c))
    sys.stdout.flush()


def say(text: str) -> None:
    print(text, flush=True)


# -- figures of a process and of the machine (Linux /proc) -------------------------------------


def status_kib(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` figure in KiB (VmRSS, VmHWM...); 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads, ended ones too), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def git_revision() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(_HERE.parent), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{rev}{' (+ uncommitted changes)' if dirty else ''}"


# -- the relay's disk ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Disk:
    """What a relay on SQLite holds on disk: its database file, its WAL, and how much of the
    database file is free pages (space SQLite reuses, but does not give back without VACUUM)."""

    database: int
    wal: int
    free: int

    @property
    def total(self) -> int:
        return self.database + self.wal

    def __str__(self) -> str:
        return (
            f"{self.total / MIB:.1f} MiB (database {self.database / MIB:.1f}, WAL"
            f" {self.wal / MIB:.1f}, free pages {self.free / MIB:.1f})"
        )


def relay_disk(database: Path) -> Disk:
    """The relay's disk on SQLite: ``database`` (``<data-dir>/static-relay.db``) and its ``-wal``
    file, in bytes, and the free pages (read through a read-only connection of its own, which
    the running server does not notice; 0 when the database cannot be read)."""

    def size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0

    free = 0
    try:
        conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
        try:
            pages = conn.execute("PRAGMA freelist_count").fetchone()[0]
            free = int(pages) * int(conn.execute("PRAGMA page_size").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        pass
    return Disk(size(database), size(Path(f"{database}-wal")), free)


def log_entries(database: Path, channel: str) -> int:
    """Entries of ``channel`` in the relay's SQLite log (read-only)."""
    conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
    try:
        row = conn.execute(
            "SELECT COUNT(*) FROM relay_entries e JOIN relay_channels c ON c.id = e.channel_id"
            " WHERE c.name = ?",
            (channel,),
        ).fetchone()
        return int(row[0])
    finally:
        conn.close()


# -- a relay and its traffic -------------------------------------------------------------------


class Server:
    """A real ``static serve --allow-anonymous`` without a publish rate limit, on loopback, on
    SQLite in ``directory``; restartable on the same data (``env``: e.g. libfaketime)."""

    def __init__(self, directory: Path, extra: Sequence[str], env: dict[str, str] | None = None):
        self.directory = directory
        self.process = ServerProcess(
            directory,
            extra_args=["--allow-anonymous", "--relay-publish-rate", "0", *extra],
            env=env,
            cwd=directory.parent,  # ``-m static`` puts the cwd first on sys.path
        )

    def start(self) -> Server:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop(60)

    @property
    def pid(self) -> int:
        assert self.process.proc is not None
        return self.process.proc.pid

    @property
    def url(self) -> str:
        return self.process.relay_url

    @property
    def database(self) -> Path:
        """The relay's SQLite file (a file of its own, beside the accounts' ``static.db``)."""
        return Path(relay_database(sqlite_url(str(self.directory / "static.db"))))

    def rss(self) -> int:
        """VmRSS in bytes."""
        return status_kib(self.pid, "VmRSS") * KIB

    def peak(self) -> int:
        """VmHWM (the highest RSS so far) in bytes."""
        return status_kib(self.pid, "VmHWM") * KIB

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Creator:
    """Creates channels on a relay from real MLS groups of one engine (its groups at epoch 0,
    its leaf bound to the anonymous account), as the relay requires."""

    def __init__(self, directory: Path) -> None:
        self.engine = Engine(directory, b"bench-scale")

    def create(self, relay: Relay, channel: str) -> None:
        self.engine.create_group(channel)
        group_info, tree = self.engine.public_state(channel)
        leaf, signature = self.engine.leaf_binding(channel, "")
        relay.create_raw(
            channel, group_info, tree, pb.LeafBinding(leaf_index=leaf, signature=signature)
        )

    def close(self) -> None:
        self.engine.close()


@dataclass
class Published:
    """What one pipelined run of publishes took."""

    count: int
    accepted: int
    seconds: float
    relay_cpu: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        return self.relay_cpu / self.count * 1e6 if self.count else 0.0


def publish(
    relay: Relay, server: Server, channels: Sequence[str], count: int, start: int = 0
) -> Published:
    """``count`` distinct 1 KiB messages (numbered from ``start``), pipelined on one
    PublishBatches call in batches of :data:`BATCH` (each batch to one channel, the channels in
    turn): the wall time until the last answer and the relay's CPU meanwhile."""

    def batches() -> Iterator[Any]:
        n, turn = start, 0
        while n < start + count:
            channel = channels[turn % len(channels)]
            size = min(BATCH, start + count - n)
            yield pb.PublishBatchRequest(
                requests=[
                    pb.PublishRequest(
                        channel=channel,
                        message=sized_application(channel, (n + i).to_bytes(8, "big"), PAYLOAD),
                    )
                    for i in range(size)
                ]
            )
            n += size
            turn += 1

    accepted = 0
    refusals: dict[str, int] = {}
    cpu = server.cpu()
    started = time.perf_counter()
    for response in relay.stub.PublishBatches(
        batches(), timeout=max(600.0, count / 500), metadata=relay.metadata
    ):
        for result in response.results:
            if result.WhichOneof("outcome") == "accepted":
                accepted += 1
            else:
                text = f"{result.refused.code}: {result.refused.message}"
                refusals[text] = refusals.get(text, 0) + 1
    seconds = time.perf_counter() - started
    if accepted != count:
        # The figures would be of refusals, not of publishes.
        raise RuntimeError(f"{accepted} of {count} publishes accepted; refused: {refusals}")
    return Published(count, accepted, seconds, server.cpu() - cpu)


def _mib(value: float) -> str:
    return f"{value / MIB:.1f} MiB"


# -- rss: relay memory with busy, then idle channels -------------------------------------------


def section_rss(sizes: Sizes, tmp: Path, extra: Sequence[str]) -> list[Row]:
    say(
        f"rss: per size a fresh relay (start: after one channel's traffic), N channels,"
        f" {sizes.per_channel} x 1 KiB messages on each (pipelined), then {sizes.idle:g} s idle"
    )
    rows: list[Row] = []
    for n in sizes.channels:
        directory = tmp / f"rss-{n}"
        creator = Creator(tmp / f"rss-{n}-creator")
        try:
            with Server(directory / "server", extra) as server, Relay(server.url) as relay:
                # The start: a relay that has served one channel (its first use's fixed costs
                # paid: threads, caches, SQLite's page cache), so the rows are per channel.
                creator.create(relay, WARM)
                publish(relay, server, [WARM], sizes.per_channel)
                time.sleep(0.5)
                start = server.rss()
                names = [f"bench/scale/c{i}" for i in range(n)]
                made = time.perf_counter()
                for name in names:
                    creator.create(relay, name)
                made = time.perf_counter() - made
                created = server.rss()
                sent = publish(relay, server, names, n * sizes.per_channel)
                busy = server.rss()
                peak = server.peak()
                idle_samples = []
                deadline = time.monotonic() + sizes.idle
                while time.monotonic() < deadline:
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                    idle_samples.append(server.rss())
                idle = server.rss()
                say(
                    f"  {n:>5} channels: created in {made:.1f} s; RSS at start {_mib(start)},"
                    f" with the channels {_mib(created)}, busy {_mib(busy)} (peak {_mib(peak)};"
                    f" {sent.count} publishes at {sent.rate:,.0f}/s), after {sizes.idle:g} s"
                    f" idle {_mib(idle)} (lowest {_mib(min(idle_samples, default=idle))})"
                )
        finally:
            creator.close()
        per = f" ({(busy - start) / n / KIB:,.0f} KiB/channel)"
        rows.append(Row("relay RSS, start", f"{n:,} channels", _mib(start)))
        rows.append(Row("relay RSS, busy", f"{n:,} channels", _mib(busy) + per, ratio(busy, start)))
        rows.append(
            Row("relay RSS, peak (VmHWM)", f"{n:,} channels", _mib(peak), ratio(peak, start))
        )
        idle_per = f" ({(idle - start) / n / KIB:,.0f} KiB/channel)"
        rows.append(
            Row(
                f"relay RSS, idle {sizes.idle:g} s",
                f"{n:,} channels",
                _mib(idle) + idle_per,
                ratio(idle, start),
            )
        )
    return rows


# -- mls: encrypt and decrypt at N members -----------------------------------------------------


def _mls_rs() -> Any:
    """The mls-rs binding, or None when the dev extra is not installed."""
    try:
        import mls_rs_uniffi  # type: ignore[import-untyped]
    except ImportError:
        return None
    return mls_rs_uniffi


class MlsRs:
    """mls-rs clients (basic credentials, cipher suite 1 as the engine's, state in memory)."""

    def __init__(self, mls: Any) -> None:
        self.mls = mls
        self.suite = mls.CipherSuite.CURVE25519_AES128
        self._pool: list[bytes] = []

    def client(self, identity: bytes) -> Any:
        keys = self.mls.generate_signature_keypair(self.suite)
        return self.mls.Client(identity, keys, self.mls.client_config_default())

    def key_packages(self, n: int) -> list[bytes]:
        """``n`` key packages of distinct clients (made once, reused across groups)."""
        while len(self._pool) < n:
            client = self.client(f"filler-{len(self._pool)}".encode())
            self._pool.append(bytes(client.generate_key_package_message().to_bytes()))
        return self._pool[:n]

    def message(self, data: bytes) -> Any:
        return self.mls.Message.from_bytes(data)

    def group(self, members: int, second: Any = None) -> tuple[Any, Any]:
        """A group of ``members`` made in one commit by a new client (the creator), with
        ``second`` (a client) in it, joined, when given: (creator's group, second's group)."""
        creator = self.client(b"creator")
        group = creator.create_group(None)
        joined = None
        if members > 1:
            kps = self.key_packages(members - 1 - (second is not None))
            if second is not None:
                kps = [bytes(second.generate_key_package_message().to_bytes()), *kps]
            out = group.add_members([self.message(kp) for kp in kps])
            group.process_incoming_message(out.commit_message)
            if second is not None:
                joined = second.join_group(None, out.welcome_message).group
        return group, joined


def _pair(root: Path, n: int) -> tuple[Engine, Engine]:
    """Two engines in a group of ``n`` (the others synthetic), made in one commit."""
    a = Engine(root / f"a-{n}", b"alice")
    b = Engine(root / f"b-{n}", b"bob")
    a.create_group(CHANNEL)
    kps = [b.generate_key_package(), *synthetic_key_packages(n - 2)]
    _, welcome = a.add_members(CHANNEL, kps)
    a.merge_pending_commit(CHANNEL)
    b.join_group(CHANNEL, welcome)
    return a, b


@dataclass(frozen=True)
class PerMessage:
    """Per encrypt and per decrypt: the median wall time (us), the median CPU time of this
    process (us; what the call computes, without the waits for the disk, which dominate the
    wall time on a busy disk), and the bytes this process wrote (``/proc/self/io`` wchar: the
    state each call makes durable), on average."""

    enc: float
    dec: float
    enc_cpu: float
    dec_cpu: float
    enc_written: float
    dec_written: float

    @property
    def both(self) -> float:
        return self.enc + self.dec

    @property
    def both_cpu(self) -> float:
        return self.enc_cpu + self.dec_cpu

    @property
    def both_written(self) -> float:
        return self.enc_written + self.dec_written


def written() -> int:
    """Bytes this process has passed to write(2) and its kind so far (``/proc/self/io``)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _timed(call: Callable[[], _T], wall: list[float], cpu: list[float]) -> _T:
    """``call()``, its wall and CPU time (us) appended to ``wall`` and ``cpu``."""
    started, cpu_started = time.perf_counter(), time.process_time()
    result = call()
    cpu.append((time.process_time() - cpu_started) * 1e6)
    wall.append((time.perf_counter() - started) * 1e6)
    return result


def _measure(
    encrypt: Callable[[], bytes], decrypt: Callable[[bytes], object], count: int
) -> PerMessage:
    """``count`` encrypts, then as many decrypts of what they made (after 5 of each untimed)."""
    for _ in range(5):
        decrypt(encrypt())
    enc: list[float] = []
    enc_cpu: list[float] = []
    dec: list[float] = []
    dec_cpu: list[float] = []
    before = written()
    messages = [_timed(encrypt, enc, enc_cpu) for _ in range(count)]
    between = written()
    for m in messages:
        _timed(partial(decrypt, m), dec, dec_cpu)
    after = written()
    med = statistics.median
    return PerMessage(
        med(enc),
        med(dec),
        med(enc_cpu),
        med(dec_cpu),
        (between - before) / count,
        (after - between) / count,
    )


def _mls_rs_per_message(ref: MlsRs, n: int, count: int) -> PerMessage:
    """As the engine's figures, by mls-rs (bytes in and out, as the engine's calls)."""
    payload = bytes(PAYLOAD)
    a, b = ref.group(n, ref.client(b"bob"))
    return _measure(
        lambda: bytes(a.encrypt_application_message(payload).to_bytes()),
        lambda m: b.process_incoming_message(ref.message(m)),
        count,
    )


def section_mls(sizes: Sizes, tmp: Path, extra: Sequence[str]) -> list[Row]:
    del extra
    count = sizes.messages
    say(
        f"mls: per size, {count} messages of 1 KiB encrypted by one member and decrypted by"
        f" another: medians of wall and CPU time (this process's: no disk waits), bytes written"
    )
    mls = _mls_rs()
    ref = MlsRs(mls) if mls is not None else None
    payload = bytes(PAYLOAD)
    results: list[tuple[int, PerMessage, PerMessage | None]] = []
    for n in sizes.groups:
        a, b = _pair(tmp / f"mls-{n}", n)
        try:
            ours = _measure(
                partial(a.encrypt, CHANNEL, payload), partial(b.process_incoming, CHANNEL), count
            )
        finally:
            a.close()
            b.close()
        theirs = None if ref is None else _mls_rs_per_message(ref, n, count)
        results.append((n, ours, theirs))
        line = (
            f"  N={n:<4} engine encrypt {ours.enc:6.0f} us (CPU {ours.enc_cpu:4.0f},"
            f" {ours.enc_written / KIB:5.1f} KiB written), decrypt {ours.dec:6.0f} us"
            f" (CPU {ours.dec_cpu:4.0f}, {ours.dec_written / KIB:5.1f} KiB written)"
        )
        if theirs is not None:
            line += (
                f"; mls-rs {theirs.enc:4.0f} us (CPU {theirs.enc_cpu:4.0f}),"
                f" {theirs.dec:4.0f} us (CPU {theirs.dec_cpu:4.0f})"
            )
        say(line)
    rows: list[Row] = []
    base = results[0][1]
    for n, ours, theirs in results:
        size = f"N={n}"
        rows.append(Row("encrypt 1 KiB", size, f"{ours.enc:.0f} us", ratio(ours.enc, base.enc)))
        rows.append(Row("decrypt 1 KiB", size, f"{ours.dec:.0f} us", ratio(ours.dec, base.dec)))
        rows.append(
            Row(
                "encrypt + decrypt",
                size,
                f"{ours.both:.0f} us",
                ratio(ours.both, base.both),
                "-" if theirs is None else f"{theirs.both:.0f} us",
                "-" if theirs is None else ratio(ours.both, theirs.both),
            )
        )
        rows.append(
            Row(
                "encrypt + decrypt, CPU",
                size,
                f"{ours.both_cpu:.0f} us",
                ratio(ours.both_cpu, base.both_cpu),
                "-" if theirs is None else f"{theirs.both_cpu:.0f} us",
                "-" if theirs is None else ratio(ours.both_cpu, theirs.both_cpu),
            )
        )
        rows.append(
            Row(
                "encrypt + decrypt, written",
                size,
                f"{ours.both_written / KIB:.1f} KiB",
                ratio(ours.both_written, base.both_written),
            )
        )
    if ref is None:
        say("  (mls-rs missing: install the dev extra for the reference)")
    say("  (the engine's every call is a durable SQLite write; mls-rs keeps its state in memory)")
    return rows


# -- members: add, join, rotate at N members ---------------------------------------------------


@dataclass
class Ops:
    """Timings (ms) of one implementation at one size."""

    add: list[float] = field(default_factory=list)
    #: This process's CPU time of each add (ms): what it computes, without the disk's waits.
    add_cpu: list[float] = field(default_factory=list)
    #: Bytes this process wrote for each add (``/proc/self/io`` wchar: the state made durable).
    add_written: list[float] = field(default_factory=list)
    join: list[float] = field(default_factory=list)
    rotate: list[float] = field(default_factory=list)
    commit_bytes: int = 0
    welcome_bytes: int = 0


def _engine_ops(root: Path, n: int, repeats: int) -> Ops:
    ops = Ops()
    creator = Engine(root / f"creator-{n}", b"creator")
    try:
        creator.create_group(CHANNEL)
        if n > 1:
            creator.add_members(CHANNEL, synthetic_key_packages(n - 1))
            creator.merge_pending_commit(CHANNEL)
        for i in range(repeats + 1):  # the first of each untimed
            joiner = Engine(root / f"joiner-{n}-{i}", b"joiner")
            try:
                kp = joiner.generate_key_package()
                started, cpu, wrote = time.perf_counter(), time.process_time(), written()
                commit, welcome = creator.add_member(CHANNEL, kp)
                creator.merge_pending_commit(CHANNEL)
                added, cpu = time.perf_counter(), time.process_time() - cpu
                wrote = written() - wrote
                joiner.join_group(CHANNEL, welcome)
                joined = time.perf_counter()
            finally:
                joiner.close()
            creator.remove_member(CHANNEL, b"joiner")
            creator.merge_pending_commit(CHANNEL)
            started_rotate = time.perf_counter()
            creator.self_update(CHANNEL)
            creator.merge_pending_commit(CHANNEL)
            rotated = time.perf_counter()
            if i:
                ops.add.append((added - started) * 1000)
                ops.add_cpu.append(cpu * 1000)
                ops.add_written.append(wrote)
                ops.join.append((joined - added) * 1000)
                ops.rotate.append((rotated - started_rotate) * 1000)
                ops.commit_bytes, ops.welcome_bytes = len(commit), len(welcome)
    finally:
        creator.close()
    return ops


def _mls_rs_ops(ref: MlsRs, n: int, repeats: int) -> Ops:
    ops = Ops()
    group, _ = ref.group(n)
    for i in range(repeats + 1):
        joiner = ref.client(b"joiner")
        kp = ref.message(bytes(joiner.generate_key_package_message().to_bytes()))
        started, cpu = time.perf_counter(), time.process_time()
        out = group.add_members([kp])
        commit = bytes(out.commit_message.to_bytes())
        group.process_incoming_message(out.commit_message)
        added, cpu = time.perf_counter(), time.process_time() - cpu
        welcome = bytes(out.welcome_message.to_bytes())
        joiner.join_group(None, ref.message(welcome))
        joined = time.perf_counter()
        removed = group.remove_members([joiner.signing_identity()])
        group.process_incoming_message(removed.commit_message)
        started_rotate = time.perf_counter()
        group.process_incoming_message(group.commit().commit_message)
        rotated = time.perf_counter()
        if i:
            ops.add.append((added - started) * 1000)
            ops.add_cpu.append(cpu * 1000)
            ops.join.append((joined - added) * 1000)
            ops.rotate.append((rotated - started_rotate) * 1000)
            ops.commit_bytes, ops.welcome_bytes = len(commit), len(welcome)
    return ops


def section_members(sizes: Sizes, tmp: Path, extra: Sequence[str]) -> list[Row]:
    del extra
    say(
        f"members: per size, {sizes.repeats} timed adds (commit made and merged), joins (Welcome"
        " processed) and rotates (empty commit with a path, made and merged); medians"
    )
    mls = _mls_rs()
    ref = MlsRs(mls) if mls is not None else None
    results: list[tuple[int, Ops, Ops | None]] = []
    for n in sizes.groups:
        ours = _engine_ops(tmp / f"members-{n}", n, sizes.repeats)
        theirs = _mls_rs_ops(ref, n, sizes.repeats) if ref is not None else None
        results.append((n, ours, theirs))
        med = statistics.median
        line = (
            f"  N={n:<4} engine add {med(ours.add):7.2f} ms (CPU {med(ours.add_cpu):.2f}),"
            f" join {med(ours.join):7.2f} ms,"
            f" rotate {med(ours.rotate):7.2f} ms, add commit {ours.commit_bytes:,} B, add wrote"
            f" {med(ours.add_written) / KIB:.1f} KiB"
        )
        if theirs is not None:
            line += (
                f"; mls-rs {med(theirs.add):6.2f} (CPU {med(theirs.add_cpu):.2f}),"
                f" {med(theirs.join):6.2f},"
                f" {med(theirs.rotate):6.2f} ms, {theirs.commit_bytes:,} B"
            )
        say(line)
    rows: list[Row] = []
    base = results[0][1]
    med = statistics.median
    for n, ours, theirs in results:
        size = f"N={n}"
        for what, mine, first, other in (
            ("add (commit + merge)", ours.add, base.add, theirs.add if theirs else None),
            ("add, CPU", ours.add_cpu, base.add_cpu, theirs.add_cpu if theirs else None),
            ("join (Welcome)", ours.join, base.join, theirs.join if theirs else None),
            (
                "rotate (commit + merge)",
                ours.rotate,
                base.rotate,
                theirs.rotate if theirs else None,
            ),
        ):
            rows.append(
                Row(
                    what,
                    size,
                    f"{med(mine):.2f} ms",
                    ratio(med(mine), med(first)),
                    "-" if other is None else f"{med(other):.2f} ms",
                    "-" if other is None else ratio(med(mine), med(other)),
                )
            )
        rows.append(
            Row(
                "add, written",
                size,
                f"{med(ours.add_written) / KIB:.1f} KiB",
                ratio(med(ours.add_written), med(base.add_written)),
            )
        )
        rows.append(
            Row(
                "add commit size",
                size,
                f"{ours.commit_bytes:,} B",
                ratio(ours.commit_bytes, base.commit_bytes),
                "-" if theirs is None else f"{theirs.commit_bytes:,} B",
                "-" if theirs is None else ratio(ours.commit_bytes, theirs.commit_bytes),
            )
        )
    say("  (the engine's every call is a durable SQLite write; mls-rs keeps its state in memory)")
    return rows


# -- publish: relay CPU per publish at an empty log and at 400k entries ------------------------


def section_publish(sizes: Sizes, tmp: Path, extra: Sequence[str]) -> list[Row]:
    say(
        f"publish: one channel; {sizes.window:,} pipelined publishes (PublishBatches of {BATCH})"
        f" at an empty log, the log filled to {sizes.log:,}, then {sizes.window:,} more"
    )
    creator = Creator(tmp / "publish-creator")
    try:
        with Server(tmp / "publish" / "server", extra) as server, Relay(server.url) as relay:
            creator.create(relay, CHANNEL)
            first = publish(relay, server, [CHANNEL], sizes.window)
            say(f"  at 0: {first.cpu_us:.1f} us relay CPU per publish, {first.rate:,.0f}/s")
            filled = sizes.window
            fill_s = fill_cpu = 0.0
            step = max(sizes.window, (sizes.log - filled) // 4)
            while filled < sizes.log:
                count = min(step, sizes.log - filled)
                done = publish(relay, server, [CHANNEL], count, start=filled)
                filled += count
                fill_s += done.seconds
                fill_cpu += done.relay_cpu
                say(
                    f"  filling: {filled:>9,} entries; the last {count:,} at {done.rate:,.0f}/s,"
                    f" {done.cpu_us:.1f} us relay CPU each"
                )
            last = publish(relay, server, [CHANNEL], sizes.window, start=filled)
            total = filled + sizes.window
            say(f"  at {filled:,}: {last.cpu_us:.1f} us relay CPU per publish, {last.rate:,.0f}/s")
            disk = relay_disk(server.database)
            say(f"  relay disk at {total:,} entries: {disk}")
    finally:
        creator.close()
    fill_total = fill_s + first.seconds
    at = f"{filled:,} entries"
    return [
        Row("relay CPU per publish", "empty log", f"{first.cpu_us:.1f} us"),
        Row("relay CPU per publish", at, f"{last.cpu_us:.1f} us", ratio(last.cpu_us, first.cpu_us)),
        Row("pipelined publishes", "empty log", f"{first.rate:,.0f}/s"),
        Row("pipelined publishes", at, f"{last.rate:,.0f}/s", ratio(last.rate, first.rate)),
        Row(
            f"time to write {filled:,} entries",
            at,
            f"{fill_total:.1f} s ({fill_cpu + first.relay_cpu:.1f} s relay CPU)",
        ),
        Row(
            "relay disk (database + WAL)",
            f"{total:,} entries",
            f"{disk.total / MIB:.1f} MiB ({disk.total / total:,.0f} B/entry)",
        ),
    ]


# -- prune: the relay's disk before and after pruning under a 1-hour policy --------------------


def retention_method() -> tuple[str, Any] | None:
    """The relay's RPC that sets a channel's retention policy (a method of the Relay service
    whose name says retention), with its request type; None while the proto has none."""
    service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
    for method in service.methods:
        if "retention" in method.name.lower():
            return method.name, getattr(pb, method.input_type.name)
    return None


def _set_max_age(message: Any, seconds: int) -> bool:
    """Sets the max-age field of ``message`` (or of a policy message in it) to ``seconds``, in
    the unit its name says (``*_ms``, ``*_seconds``/``*_secs``/``*_s``, or a Duration);
    whether one was found."""
    for fd in message.DESCRIPTOR.fields:
        name = fd.name.lower()
        if fd.message_type is not None and fd.message_type.full_name == "google.protobuf.Duration":
            if "age" in name:
                getattr(message, fd.name).seconds = seconds
                return True
            continue
        if fd.message_type is not None:
            if not fd.is_repeated and _set_max_age(getattr(message, fd.name), seconds):
                return True
            continue
        if "age" not in name or fd.type not in (fd.TYPE_UINT64, fd.TYPE_UINT32, fd.TYPE_INT64):
            continue
        if name.endswith(("_ms", "millis")):
            setattr(message, fd.name, seconds * 1000)
        else:
            setattr(message, fd.name, seconds)
        return True
    return False


def retention_request(request_type: Any, channel: str, seconds: int) -> Any:
    """A request setting ``channel``'s policy to keep ``seconds`` of history; ValueError when
    the request has no field for the channel or for a maximum age."""
    request = request_type()
    if "channel" not in request.DESCRIPTOR.fields_by_name:
        raise ValueError(f"{request_type.__name__} has no 'channel' field")
    request.channel = channel
    if not _set_max_age(request, seconds):
        fields = ", ".join(f.name for f in request.DESCRIPTOR.fields)
        raise ValueError(f"no max-age field in {request_type.__name__} ({fields})")
    return request


def libfaketime() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def section_prune(sizes: Sizes, tmp: Path, extra: Sequence[str]) -> list[Row]:
    figure = "relay disk (database + WAL), 1-hour policy"
    say(f"prune: {sizes.prune_half:,} entries 2 hours old and {sizes.prune_half:,} new")
    method = retention_method()
    if method is None:
        say("  n/a (no retention RPC)")
        return [Row(figure, "before / after pruning", "n/a (no retention RPC)")]
    name, request_type = method
    try:
        request = retention_request(request_type, CHANNEL, POLICY_S)
    except ValueError as exc:
        say(f"  n/a ({exc})")
        return [Row(figure, "before / after pruning", f"n/a ({name}: {exc})")]
    faketime = libfaketime()
    if faketime is None:
        say("  n/a (no libfaketime: apt-get install libfaketime)")
        return [Row(figure, "before / after pruning", "n/a (no libfaketime)")]
    directory = tmp / "prune" / "server"
    # Only the wall clock goes back: the monotonic clocks (timers, timeouts) stay true.
    behind = {
        "LD_PRELOAD": faketime,
        "FAKETIME": f"-{BACKDATE_S}",
        "DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    half = sizes.prune_half
    creator = Creator(tmp / "prune-creator")
    try:
        # The channel is created at the real time: the relay checks the lifetime of the
        # creator's leaf against its own clock ("lifetime is in the future" 2 hours behind).
        with Server(directory, extra) as server, Relay(server.url) as relay:
            creator.create(relay, CHANNEL)
        with Server(directory, extra, behind) as server, Relay(server.url) as relay:
            old = publish(relay, server, [CHANNEL], half)
        with Server(directory, extra) as server, Relay(server.url) as relay:
            publish(relay, server, [CHANNEL], half, start=half)
            before = relay_disk(server.database)
            say(f"  before: {log_entries(server.database, CHANNEL):,} entries, {before}")
            written = 2 * half
            quiet = _unary_publishes(relay, 50, written)
            written += len(quiet)
            call = relay.channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=request_type.SerializeToString,
                response_deserializer=None,
            )
            call(request, timeout=10, metadata=relay.metadata)
            say(f"  {name}: max age {POLICY_S} s set; waiting for the pruning")
            # Until only what was written at the real time is left (or the wait ends), one
            # publish after another: does pruning stall them?
            started = time.perf_counter()
            deadline = time.monotonic() + sizes.prune_wait
            during: list[float] = []
            while (entries := log_entries(server.database, CHANNEL)) > written - half:
                if time.monotonic() > deadline:
                    say(f"  still {entries:,} entries after {sizes.prune_wait:g} s")
                    break
                during += _unary_publishes(relay, 5, written)
                written += 5
                time.sleep(0.05)
            pruned_s = time.perf_counter() - started
            after = relay_disk(server.database)
            say(
                f"  after {pruned_s:.1f} s: {entries:,} entries, {after}; unary publish p99"
                f" {_p99(quiet):.2f} ms before, {_p99(during):.2f} ms while pruning"
                f" (max {max(during, default=0.0):.2f} ms; old half written at"
                f" {old.rate:,.0f}/s)"
            )
    finally:
        creator.close()
    return [
        Row(figure, f"before ({2 * half:,} entries)", str(before)),
        Row(
            figure,
            f"after pruning ({entries:,} entries left, {pruned_s:.0f} s)",
            str(after),
            ratio(after.total, before.total),
        ),
        Row(
            "unary publish p99 while pruning",
            f"{len(during)} publishes",
            f"{_p99(during):.2f} ms",
            ratio(_p99(during), _p99(quiet)),
        ),
    ]


def _unary_publishes(relay: Relay, count: int, start: int) -> list[float]:
    """Latencies (ms) of ``count`` unary publishes one at a time."""
    spans = []
    for i in range(count):
        message = sized_application(CHANNEL, (start + i).to_bytes(8, "big"), PAYLOAD)
        started = time.perf_counter()
        relay.publish(CHANNEL, message)
        spans.append((time.perf_counter() - started) * 1000)
    return spans


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


# -- main ---------------------------------------------------------------------------------------


RUNNERS: dict[str, Callable[[Sizes, Path, Sequence[str]], list[Row]]] = {
    "rss": section_rss,
    "mls": section_mls,
    "members": section_members,
    "publish": section_publish,
    "prune": section_prune,
}


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated sections to run (default %(default)s)",
    )
    parser.add_argument(
        "--idle",
        type=float,
        metavar="SECONDS",
        help="how long the rss section leaves its channels idle (default"
        f" {FULL.idle:g}, {QUICK.idle:g} with --quick; the relay's own idle timeout must fit)",
    )
    parser.add_argument(
        "--relay-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra argument for every 'static serve' (repeatable; write it as"
        " --relay-arg=--flag=value)",
    )
    args = parser.parse_args()
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in RUNNERS]
    if unknown or not wanted:
        parser.error(f"unknown sections {unknown}: pick from {','.join(SECTIONS)}")
    sizes = QUICK if args.quick else FULL
    if args.idle is not None:
        if args.idle < 0:
            parser.error("--idle must be >= 0")
        sizes = replace(sizes, idle=args.idle)
    signal.signal(signal.SIGTERM, _terminate)

    say(f"bench/scale.py{' --quick' if args.quick else ''}: git {git_revision()}")
    say(f"  extension: {_native.__file__}")
    say(f"  machine: {machine()}")
    say(
        "  note: figures on a shared 2-core machine vary from run to run (other work competes"
        " for the cores and the disk); compare the ratios of one run"
    )
    if args.relay_arg:
        say(f"  static serve with: {' '.join(args.relay_arg)}")
    rows: list[Row] = []
    status = 0
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="static-scale-") as tmp:
            for section in SECTIONS:
                if section not in wanted:
                    continue
                began = time.perf_counter()
                try:
                    rows += RUNNERS[section](sizes, Path(tmp), args.relay_arg)
                except Exception as exc:  # noqa: BLE001 - reported; the other sections still run
                    say(f"  FAILED: {type(exc).__name__}: {exc}")
                    rows.append(Row(section, "", f"FAILED: {type(exc).__name__}"))
                    status = 1
                say(f"  ({section}: {time.perf_counter() - began:.0f} s)")
    except KeyboardInterrupt as exc:
        say(f"interrupted ({str(exc) or 'Ctrl-C'}); the servers are stopped")
        status = 130
    say("")
    show(rows)
    say(f"total {time.perf_counter() - started:.0f} s; machine at the end: {machine()}")
    sys.exit(status)


if __name__ == "__main__":
    main()
