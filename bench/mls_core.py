"""Benchmark of the MLS core through static._native. Prints figures; asserts nothing.

    .venv/bin/python bench/mls_core.py [--iterations N] [--sizes 8,128,512]
                                       [--message-sizes 2,32,128,512] [--dir PATH]

Per 1 KiB application message: encrypt and decrypt from Python vs the same loop inside Rust
(target: Python within 1.3x of Rust), both vs the floor of one Ed25519 signature + verification
measured in the same run. Then encrypt + decrypt against group size (target: N=512 within 1.3x
of N=2), beside mls-rs (``agentvault-mls-rs-uniffi``, the dev extra; in memory) in the same run.
Add-member commit and Welcome processing at several group sizes (targets for the commit:
<= 10 ms at 128, <= 50 ms at 512), and the size on disk of a group.
Every call is durable (an fsync'd SQLite transaction), so the figures include the disk
(``--dir`` chooses it: e.g. /dev/shm for the CPU alone).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from static._native.bench import (
    ed25519_sign_verify_ns,
    rust_encrypt_decrypt,
    synthetic_key_packages,
)
from static._native.mls import Engine

CH = "bench/mls/core"
PAYLOAD = 1024


def pair(root: Path, tag: str) -> tuple[Engine, Engine]:
    a = Engine(root / f"{tag}-a", b"alice")
    b = Engine(root / f"{tag}-b", b"bob")
    a.create_group(CH)
    _, welcome = a.add_member(CH, b.generate_key_package())
    a.merge_pending_commit(CH)
    b.join_group(CH, welcome)
    return a, b


def python_loop(a: Engine, b: Engine, iterations: int) -> tuple[float, float]:
    payload = bytes(PAYLOAD)
    messages: list[bytes] = []
    start = time.perf_counter_ns()
    for _ in range(iterations):
        messages.append(a.encrypt(CH, payload))
    enc = (time.perf_counter_ns() - start) / iterations
    start = time.perf_counter_ns()
    for m in messages:
        b.process_incoming(CH, m)
    return enc, (time.perf_counter_ns() - start) / iterations


def per_message(root: Path, iterations: int, rounds: int = 3) -> None:
    floor_ns = ed25519_sign_verify_ns(PAYLOAD, iterations)
    # The same two engines for both loops, alternated, best round of each: the figures are
    # dominated by the fsync of each durable write, which is noisy.
    a, b = pair(root, "msg")
    python_loop(a, b, iterations // 10)  # warm-up
    py: list[tuple[float, float]] = []
    rust: list[tuple[float, float]] = []
    for _ in range(rounds):
        rust.append(rust_encrypt_decrypt(a, b, CH, PAYLOAD, iterations))
        py.append(python_loop(a, b, iterations))
    a.close()
    b.close()
    py_enc, py_dec = min(p[0] for p in py), min(p[1] for p in py)
    rust_enc, rust_dec = min(r[0] for r in rust), min(r[1] for r in rust)

    print(f"per {PAYLOAD} B application message ({iterations} messages, durable writes)")
    print(f"  floor: Ed25519 sign+verify           {floor_ns / 1000:9.1f} us")
    for what, py_ns, rust_ns in (("encrypt", py_enc, rust_enc), ("decrypt", py_dec, rust_dec)):
        print(
            f"  {what}: python {py_ns / 1000:9.1f} us   rust {rust_ns / 1000:9.1f} us   "
            f"python/rust {py_ns / rust_ns:5.2f}x (target <= 1.30x)"
            f"   rust/floor {rust_ns / floor_ns:6.1f}x"
        )


#: Commits made after the group is built and before messages are timed: enough for the group to
#: hold its full count of past epochs (their secrets and member lists), as a group that lived a
#: while does.
EPOCHS_BEFORE = 6


def static_group(root: Path, n: int) -> tuple[Engine, Engine]:
    """A sender and a receiver in a group of ``n`` (the rest synthetic), EPOCHS_BEFORE epochs on."""
    a = Engine(root / f"n{n}-a", b"alice")
    b = Engine(root / f"n{n}-b", b"bob")
    a.create_group(CH)
    key_packages = [b.generate_key_package(), *synthetic_key_packages(n - 2)]
    _, welcome = a.add_members(CH, key_packages)
    a.merge_pending_commit(CH)
    b.join_group(CH, welcome)
    for _ in range(EPOCHS_BEFORE):
        commit = a.self_update(CH)
        a.merge_pending_commit(CH)
        b.process_incoming(CH, commit)
    return a, b


def mlsrs_group(n: int) -> tuple[Any, Any] | None:
    """The same with mls-rs (in memory), or None without the package."""
    try:
        import mls_rs_uniffi as mls  # type: ignore[import-untyped]
    except ImportError:
        return None
    suite = mls.CipherSuite.CURVE25519_AES128

    def client(name: bytes) -> Any:
        return mls.Client(name, mls.generate_signature_keypair(suite), mls.client_config_default())

    bob = client(b"bob")
    packages = [bob.generate_key_package_message()] + [
        client(f"member-{i}".encode()).generate_key_package_message() for i in range(n - 2)
    ]
    a = client(b"alice").create_group(None)
    out = a.add_members(packages)
    a.process_incoming_message(out.commit_message)
    b = bob.join_group(None, out.welcome_message).group
    for _ in range(EPOCHS_BEFORE):
        commit = a.commit().commit_message
        a.process_incoming_message(commit)
        b.process_incoming_message(commit)
    return a, b


#: Per message: (wall ns, CPU ns of this thread: what the calls compute, without the waits
#: for the disk or for a core, which dominate the wall time on a busy 2-core machine).
Round = tuple[float, float]


def static_round(pair: tuple[Engine, Engine], iterations: int) -> Round:
    a, b = pair
    payload = bytes(PAYLOAD)
    start, cpu = time.perf_counter_ns(), time.thread_time_ns()
    messages = [a.encrypt(CH, payload) for _ in range(iterations)]
    for m in messages:
        b.process_incoming(CH, m)
    wall, cpu = time.perf_counter_ns() - start, time.thread_time_ns() - cpu
    return wall / iterations, cpu / iterations


def mlsrs_round(pair: tuple[Any, Any], iterations: int) -> Round:
    a, b = pair
    payload = bytes(PAYLOAD)
    start, cpu = time.perf_counter_ns(), time.thread_time_ns()
    messages = [a.encrypt_application_message(payload) for _ in range(iterations)]
    for m in messages:
        b.process_incoming_message(m)
    wall, cpu = time.perf_counter_ns() - start, time.thread_time_ns() - cpu
    return wall / iterations, cpu / iterations


def _medians(rounds: list[Round]) -> Round:
    return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)


def message_sizes(root: Path, sizes: list[int], iterations: int, rounds: int = 5) -> None:
    """Encrypt + decrypt of a 1 KiB message against group size, beside mls-rs."""
    groups = {n: static_group(root, n) for n in sizes}
    references = {n: mlsrs_group(n) for n in sizes}
    ours: dict[int, list[Round]] = {n: [] for n in sizes}
    theirs: dict[int, list[Round]] = {n: [] for n in sizes}
    # Sizes alternated round by round, medians: the machine's noise spread over all of them.
    for _ in range(rounds):
        for n in sizes:
            ours[n].append(static_round(groups[n], iterations))
            reference = references[n]
            if reference is not None:
                theirs[n].append(mlsrs_round(reference, iterations))
    for a, b in groups.values():
        a.close()
        b.close()
    print(
        f"encrypt + decrypt of a {PAYLOAD} B message against group size N ({iterations} messages"
        f" x {rounds} rounds, medians; {EPOCHS_BEFORE} commits first, so past epochs are kept)"
    )
    print(
        f"  wall and CPU (this thread's) per message, us; ratio against N={sizes[0]}"
        f" (target at N=512: <= 1.30x)"
    )
    base = _medians(ours[sizes[0]])
    rs_base = _medians(theirs[sizes[0]]) if theirs[sizes[0]] else (float("nan"),) * 2
    for n in sizes:
        wall, cpu = _medians(ours[n])
        line = (
            f"  N={n:4d}: static wall {wall / 1000:7.1f} ({wall / base[0]:4.2f}x)"
            f" CPU {cpu / 1000:7.1f} ({cpu / base[1]:4.2f}x)"
        )
        if theirs[n]:
            rs_wall, rs_cpu = _medians(theirs[n])
            line += (
                f" | mls-rs wall {rs_wall / 1000:7.1f} ({rs_wall / rs_base[0]:4.2f}x)"
                f" CPU {rs_cpu / 1000:7.1f} ({rs_cpu / rs_base[1]:4.2f}x)"
                f" | static/mls-rs CPU {cpu / rs_cpu:4.2f}x"
            )
        print(line)


def group_sizes(root: Path, sizes: list[int], repeats: int) -> None:
    print("add-member commit and Welcome processing (group of N members adds one more)")
    for n in sizes:
        creator = Engine(root / f"size-{n}", b"creator")
        creator.create_group(CH)
        if n > 1:
            creator.add_members(CH, synthetic_key_packages(n - 1))
            creator.merge_pending_commit(CH)
        commit_ms: list[float] = []
        welcome_ms: list[float] = []
        commit_size = welcome_size = 0
        for r in range(repeats):
            joiner = Engine(root / f"join-{n}-{r}", f"joiner-{r}".encode())
            kp = joiner.generate_key_package()
            start = time.perf_counter()
            commit, welcome = creator.add_member(CH, kp)
            commit_ms.append((time.perf_counter() - start) * 1000)
            creator.clear_pending_commit(CH)
            start = time.perf_counter()
            joiner.join_group(CH, welcome)
            welcome_ms.append((time.perf_counter() - start) * 1000)
            commit_size, welcome_size = len(commit), len(welcome)
            joiner.close()
        db = root / f"size-{n}" / "mls.sqlite3"
        creator.close()  # checkpoints the WAL into the database file
        target = {128: " (target <= 10 ms)", 512: " (target <= 50 ms)"}.get(n, "")
        print(
            f"  N={n:4d}: commit {statistics.median(commit_ms):8.2f} ms{target:18s} "
            f"welcome {statistics.median(welcome_ms):8.2f} ms   "
            f"commit {commit_size / 1024:6.1f} KiB, welcome {welcome_size / 1024:7.1f} KiB, "
            f"state on disk {db.stat().st_size / 1024:8.1f} KiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--sizes", default="8,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--message-sizes", default="2,32,128,512")
    parser.add_argument("--message-iterations", type=int, default=200)
    parser.add_argument("--dir", default=None, help="where the engines' data goes (default TMPDIR)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="static-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        per_message(root, args.iterations)
        message_sizes(
            root, [int(s) for s in args.message_sizes.split(",")], args.message_iterations
        )
        group_sizes(root, [int(s) for s in args.sizes.split(",")], args.repeats)


if __name__ == "__main__":
    main()
