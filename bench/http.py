"""HTTP API benchmark: requests/s and p50/p99 latency on loopback. Prints figures, asserts nothing.

For each backend (SQLite, and PostgreSQL on a throwaway cluster from tests/support/postgres.py)
it starts a real ``static serve`` (rate limits off) and measures, with a load generator in a
second process (``wrk`` when installed, else a small trio HTTP/1.1 client in a subprocess):

- ``GET /v1/accounts/me`` with an API key,
- ``GET /v1/accounts/me`` with a JWT,
- ``POST /v1/tokens``,
- and, as the baseline, ``GET /hello`` of a bare Quart-Trio app served by the same stack (the
  same ``serve_app``/``hypercorn_config`` as the API, in its own process, no store).

Usage: ``.venv/bin/python bench/http.py [--backend sqlite|postgresql|both] [--duration 10]
[--connections 50] [--loader wrk|python]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This file is bench/http.py: its directory must not shadow the standard library's ``http``.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))


@dataclass
class Result:
    name: str
    requests_per_second: float
    p50_ms: float
    p99_ms: float
    #: Responses that were not 2xx/3xx.
    errors: int
    #: Server CPU time (user + system, all threads) per request: unlike req/s, barely
    #: affected by other load on the machine.
    cpu_ms: float


# -- the baseline app (run with --serve-baseline) -------------------------------------------------


def serve_baseline() -> None:
    import trio
    from quart_trio import QuartTrio

    from static._settings import Address, ServerSettings
    from static.api import hypercorn_config, serve_app

    app = QuartTrio("baseline", static_folder=None)

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    settings = ServerSettings(http=Address("127.0.0.1", 0))

    async def main() -> None:
        shutdown = trio.Event()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(serve_app, app, hypercorn_config(settings), shutdown)
                print(f"http: {url}", flush=True)
                async for _ in signals:
                    shutdown.set()
                    break

    trio.run(main)


class Baseline:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-baseline"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("http: "):
            raise RuntimeError("the baseline server did not start")
        self.url = line.split(": ", 1)[1].strip()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


# -- load generators ------------------------------------------------------------------------------


def _wrk_time_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(text)
    value, unit = float(match[1]), match[2]
    return value * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def run_wrk(
    url: str, method: str, headers: dict[str, str], connections: int, duration: float
) -> tuple[float, float, float, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(f'wrk.method = "{method}"\n')
        for name, value in headers.items():
            script.write(f'wrk.headers["{name}"] = "{value}"\n')
    try:
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{connections}",
                f"-d{max(1, round(duration))}s",
                "--latency",
                "-s",
                script.name,
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    rps = float(re.search(r"Requests/sec:\s*([\d.]+)", out)[1])  # type: ignore[index]
    p50 = _wrk_time_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M)[1])  # type: ignore[index]
    p99 = _wrk_time_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M)[1])  # type: ignore[index]
    # Only non-2xx answers count as errors; wrk's socket "timeout"s are requests slower than its
    # 2 s timeout, reflected in p99 (and noted on stderr).
    errors = 0
    if match := re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out):
        errors += int(match[1])
    socket_errors = re.search(r"Socket errors: connect \d+, read \d+, write \d+, timeout \d+", out)
    if socket_errors:
        print(f"  note ({url}): wrk {socket_errors[0]}", file=sys.stderr)
    return rps, p50, p99, errors


def python_load(args: argparse.Namespace) -> None:
    """The fallback load generator (run in its own process): keep-alive HTTP/1.1 over trio."""
    from urllib.parse import urlsplit

    import trio

    parts = urlsplit(args.load)
    headers = "".join(f"{h}\r\n" for h in args.header)
    request = (
        f"{args.method} {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{headers}"
        "Content-Length: 0\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    errors = 0

    async def connection(deadline: float) -> None:
        nonlocal errors
        stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
        buffer = b""
        async with stream:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                await stream.send_all(request)
                while b"\r\n\r\n" not in buffer:
                    buffer += await stream.receive_some(65536)
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length:\s*(\d+)", head)[1])  # type: ignore[index]
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                buffer = buffer[length:]
                latencies.append(time.perf_counter() - started)
                if not head.startswith(b"HTTP/1.1 2"):
                    errors += 1

    async def main() -> None:
        deadline = time.monotonic() + args.duration
        async with trio.open_nursery() as nursery:
            for _ in range(args.connections):
                nursery.start_soon(connection, deadline)

    started = time.monotonic()
    trio.run(main)
    elapsed = time.monotonic() - started
    latencies.sort()
    print(
        json.dumps(
            {
                "rps": len(latencies) / elapsed,
                "p50": latencies[len(latencies) // 2] * 1000,
                "p99": latencies[int(len(latencies) * 0.99)] * 1000,
                "errors": errors,
            }
        )
    )


def run_python(
    url: str, method: str, headers: dict[str, str], connections: int, duration: float
) -> tuple[float, float, float, int]:
    command = [sys.executable, __file__, "--load", url, "--method", method]
    command += ["--connections", str(connections), "--duration", str(duration)]
    for name, value in headers.items():
        command += ["--header", f"{name}: {value}"]
    out = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return out["rps"], out["p50"], out["p99"], out["errors"]


# -- the run --------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    loader: str,
    name: str,
    pid: int,
    url: str,
    method: str,
    headers: dict[str, str],
    connections: int,
    duration: float,
) -> Result:
    run = run_wrk if loader == "wrk" else run_python
    run(url, method, headers, connections, min(2.0, duration))  # warm-up
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    rps, p50, p99, errors = run(url, method, headers, connections, duration)
    cpu = cpu_seconds(pid) - cpu_before
    requests = rps * (time.monotonic() - started)
    return Result(name, rps, p50, p99, errors, cpu * 1000 / max(requests, 1))


def bench_backend(backend: str, loader: str, connections: int, duration: float) -> list[Result]:
    import httpx

    from tests.support.postgres import PostgresCluster, find_postgres_bin
    from tests.support.server import ServerProcess

    cluster = None
    workdir = Path(tempfile.mkdtemp(prefix="static-bench-"))
    if backend == "postgresql":
        bindir = find_postgres_bin()
        if bindir is None:
            print("PostgreSQL is not installed; skipping", file=sys.stderr)
            return []
        cluster = PostgresCluster(bindir)
        cluster.start()
        database_url = cluster.create_database()
    else:
        database_url = f"sqlite:///{workdir / 'static.db'}"
    server = ServerProcess(
        workdir / "server",
        database_url,
        [
            "--signup-rate",
            "off",
            "--key-rate",
            "off",
            "--account-rate",
            "off",
            "--auth-failure-rate",
            "off",
        ],
    ).start()
    baseline = Baseline()
    try:
        with httpx.Client(base_url=server.http_url) as http:
            key = http.post("/v1/accounts", json={"email": "bench@example.com"}).json()["api_key"]
            auth = {"Authorization": f"Bearer {key}"}
            token = http.post("/v1/tokens", headers=auth).json()["access_token"]
        me = f"{server.http_url}/v1/accounts/me"
        assert server.proc is not None
        pid, base_pid = server.proc.pid, baseline.proc.pid
        targets = [
            ("baseline GET /hello", base_pid, f"{baseline.url}/hello", "GET", {}),
            ("GET /v1/accounts/me (API key)", pid, me, "GET", auth),
            ("GET /v1/accounts/me (JWT)", pid, me, "GET", {"Authorization": f"Bearer {token}"}),
            ("POST /v1/tokens", pid, f"{server.http_url}/v1/tokens", "POST", auth),
        ]
        # The baseline runs first and last: on a shared machine load drifts during a run.
        targets.append(("baseline GET /hello (again)", *targets[0][1:]))
        results = [
            measure(loader, name, pid, url, method, headers, connections, duration)
            for name, pid, url, method, headers in targets
        ]
    finally:
        baseline.stop()
        server.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def report(backend: str, results: list[Result], connections: int) -> None:
    if not results:
        return
    baselines = [r for r in results if r.name.startswith("baseline")]
    base = sum(r.requests_per_second for r in baselines) / len(baselines)
    print(f"\n== {backend} ({connections} connections)")
    base_cpu = sum(r.cpu_ms for r in baselines) / len(baselines)
    print(
        f"{'endpoint':31} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'vs base':>7}"
        f" {'cpu ms/req':>10} {'base/cpu':>8} {'errors':>6}"
    )
    for r in results:
        ratio = r.requests_per_second / base if base else 0.0
        cpu_ratio = base_cpu / r.cpu_ms if r.cpu_ms else 0.0
        print(
            f"{r.name:31} {r.requests_per_second:7.0f} {r.p50_ms:7.2f} {r.p99_ms:7.2f}"
            f" {ratio:7.0%} {r.cpu_ms:10.3f} {cpu_ratio:8.0%} {r.errors:6d}"
        )
    print(
        f"(vs base: req/s against the mean baseline, {base:.0f} req/s; base/cpu: the baseline's"
        f" server CPU per request, {base_cpu:.3f} ms, over this row's)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--loader", choices=["wrk", "python"], default=None)
    parser.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="GET", help=argparse.SUPPRESS)
    parser.add_argument("--header", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_baseline:
        serve_baseline()
        return
    if args.load:
        python_load(args)
        return
    loader = args.loader or ("wrk" if shutil.which("wrk") else "python")
    print(f"load generator: {loader}; {args.duration:g}s per endpoint after a warm-up")
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    for backend in backends:
        report(
            backend,
            bench_backend(backend, loader, args.connections, args.duration),
            args.connections,
        )


if __name__ == "__main__":
    main()
