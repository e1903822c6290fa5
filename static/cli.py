"""``static``: the command line. The only place that owns signals, configuration and exit codes."""

from __future__ import annotations

import argparse
import gc
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from static._settings import Address, ApiSettings, RateLimit, RelaySettings, ServerSettings
from static.store import database_location

__all__ = ["main"]

_TRUE = {"1", "true", "yes", "on"}


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


_METAVARS: Final = {"count": "N", "real": "NUMBER", "seconds": "SECONDS"}


@dataclass(frozen=True)
class _RelayOption:
    """A tunable setting of the relay, from its one table (``static._native.relay_settings()``):
    its name, flag, kind, default, bounds and help. The environment variable is the flag's name."""

    name: str
    flag: str
    kind: str
    default: float
    low: float
    high: float
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "STATIC_" + self.dest.upper()

    def parse(self, text: str) -> float:
        """The value of ``text``: a whole number for a count, else a real number."""
        if self.kind == "count":
            return int(text)
        return float(text)

    def check(self, value: float) -> None:
        if not self.low <= value <= self.high:
            bounds = (
                f">= {self.low:,.10g}"
                if math.isinf(self.high)
                else f"between {self.low:,.10g} and {self.high:,.10g}"
            )
            raise ValueError(f"{self.flag} must be {bounds}")


def _relay_options() -> list[_RelayOption]:
    from static._native import relay_settings

    return [_RelayOption(*row) for row in relay_settings()]


def _parser() -> argparse.ArgumentParser:
    defaults = ServerSettings()
    parser = argparse.ArgumentParser(prog="static", description="Static: API and relay server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP API and the relay",
        description="Run the HTTP API and the relay in one process. Every option also reads "
        "from an environment variable (shown in brackets).",
    )
    serve.add_argument(
        "--http",
        type=Address.parse,
        default=_env("STATIC_HTTP", str(defaults.http)),
        metavar="HOST:PORT",
        help="HTTP API address; port 0 picks a free port [STATIC_HTTP] (default %(default)s)",
    )
    serve.add_argument(
        "--relay",
        type=Address.parse,
        default=_env("STATIC_RELAY", str(defaults.relay)),
        metavar="HOST:PORT",
        help="relay (gRPC) address [STATIC_RELAY] (default %(default)s)",
    )
    serve.add_argument(
        "--database",
        default=os.environ.get("STATIC_DATABASE"),
        metavar="URL",
        help="sqlite:///PATH or postgresql://... [STATIC_DATABASE] "
        "(default sqlite:///<data-dir>/static.db)",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=Path(_env("STATIC_DATA_DIR", str(defaults.data_dir))),
        metavar="DIR",
        help="directory for the SQLite database and the signing key [STATIC_DATA_DIR] "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--allow-anonymous",
        action="store_true",
        default=_env("STATIC_ALLOW_ANONYMOUS", "").lower() in _TRUE,
        help="accept relay calls without a token [STATIC_ALLOW_ANONYMOUS]",
    )
    for option in _relay_options():
        serve.add_argument(
            option.flag,
            type=option.parse,
            default=option.parse(_env(option.env, f"{option.default:.10g}")),
            metavar=_METAVARS[option.kind],
            help=f"{option.help} [{option.env}] (default %(default)s)",
        )
    serve.add_argument(
        "--token-ttl",
        type=int,
        default=int(_env("STATIC_TOKEN_TTL", str(defaults.api.token_ttl_seconds))),
        metavar="SECONDS",
        help="lifetime of the JWTs minted by POST /v1/tokens [STATIC_TOKEN_TTL] "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--signup-rate",
        type=RateLimit.parse,
        default=_env("STATIC_SIGNUP_RATE", str(defaults.api.signup_rate_limit or "off")),
        metavar="N/SECONDS",
        help="POST /v1/accounts allowed per client address: bursts of N, N per SECONDS; "
        "'off' disables [STATIC_SIGNUP_RATE] (default %(default)s)",
    )
    serve.add_argument(
        "--key-rate",
        type=RateLimit.parse,
        default=_env("STATIC_KEY_RATE", str(defaults.api.key_rate_limit or "off")),
        metavar="N/SECONDS",
        help="authenticated requests allowed per API key (JWTs count against their key); "
        "'off' disables [STATIC_KEY_RATE] (default %(default)s)",
    )
    return parser


def _settings(args: argparse.Namespace) -> ServerSettings:
    if not 1 <= args.token_ttl <= 86400:
        raise ValueError("--token-ttl must be between 1 and 86400 seconds")
    options = _relay_options()
    for option in options:
        option.check(getattr(args, option.dest))
    settings = ServerSettings(
        http=args.http,
        relay=args.relay,
        data_dir=args.data_dir,
        database_url=args.database,
        api=ApiSettings(
            token_ttl_seconds=args.token_ttl,
            signup_rate_limit=args.signup_rate,
            key_rate_limit=args.key_rate,
        ),
        relay_settings=RelaySettings(
            allow_anonymous=args.allow_anonymous,
            tunables={option.name: getattr(args, option.dest) for option in options},
        ),
    )
    # The relay opens the database itself: one it cannot share (SQLite in memory) is refused
    # here, as a configuration error, not once the HTTP API is already up.
    database_location(settings.resolved_database_url)
    return settings


async def _run(settings: ServerSettings) -> None:
    from static.server import serve

    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve, settings, shutdown)
            print(f"http: {bound.http_url}", flush=True)
            print(f"relay: {bound.relay_url}", flush=True)
            async for _ in signals:
                shutdown.set()
                break


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``static`` command; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
        settings = _settings(args)
    except ValueError as exc:
        print(f"static: {exc}", file=sys.stderr)
        return 2
    try:
        import static.server  # noqa: F401  (fail early and clearly without the server extra)
    except ImportError as exc:
        print(
            f"static: the server needs the 'server' extra (pip install 'static[server]'): {exc}",
            file=sys.stderr,
        )
        return 2
    from static.store import DatabaseError

    # Threads that call back into Python need the GIL: the SQLite store's worker threads (to
    # report, and between SQLite calls) and the relay's threads asking for token checks. With
    # CPython's default 5 ms switch interval one can wait that long behind a busy event loop.
    sys.setswitchinterval(0.0005)
    # The modules loaded by now (some 40,000 objects) live as long as the process: out of the
    # collector's sight, a full collection no longer stalls every connection for ~10 ms.
    gc.collect()
    gc.freeze()
    try:
        trio.run(_run, settings)
    except (OSError, DatabaseError) as exc:
        print(f"static: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # Raised inside the server's nurseries (a port taken, a database unreachable): the same
        # one line per cause, unless something else (a bug) is in the group too.
        expected, rest = group.split((OSError, DatabaseError))
        if expected is None or rest is not None:
            raise
        for cause in _leaves(expected):
            print(f"static: {cause}", file=sys.stderr)
        return 1
    return 0


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions in ``group`` and its nested groups."""
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


if __name__ == "__main__":
    sys.exit(main())
