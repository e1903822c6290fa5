"""``static``: the command line. The only place that owns signals, configuration and exit codes."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import resource
import signal
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

import static
from static._commands import CommandError, run_client_command
from static._commands import register as register_client_commands
from static._settings import (
    MAX_TOKEN_TTL_SECONDS,
    Address,
    ApiSettings,
    LogSettings,
    RateLimit,
    RelaySettings,
    ServerSettings,
    TlsSettings,
)
from static.store import database_location

__all__ = ["main"]

_TRUE = {"1", "true", "yes", "on"}

#: Open files kept beyond both ports' connection caps: the store's connections (SQLite's
#: database, WAL and shared-memory files per connection, or PostgreSQL sockets), the
#: listeners, the signing key, the runtimes' own descriptors. So that one port filling up
#: cannot starve the other or the store (measured at e879e1d: 20,000 idle relay connections
#: took every descriptor; /healthz and new relay calls timed out).
FILE_RESERVE: Final = 256
#: The relay's connection cap (a tunable of its table): unset, it is fitted to the open-file
#: limit with the HTTP port's (:func:`_fit_connections`).
_RELAY_CAP: Final = "max_connections"
_RELAY_CAP_PER_ADDRESS: Final = "max_connections_per_address"
#: The HTTP API's connection caps: flag -> ``ApiSettings`` field (fitted as the relay's).
_HTTP_CAPS: Final = (
    ("--http-max-connections", "max_connections", "HTTP connections served at once"),
    (
        "--http-max-connections-per-address",
        "max_connections_per_address",
        "HTTP connections served at once per client address (an IPv6 client's /64)",
    ),
)


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


_METAVARS: Final = {"count": "N", "real": "NUMBER", "seconds": "SECONDS"}


@dataclass(frozen=True)
class _RelayOption:
    """A tunable setting of the relay, from its one table
    (``static._native.relay.relay_settings()``): its name, flag, kind, default, bounds and help.
    The environment variable is the flag's name."""

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
    from static._native.relay import relay_settings

    return [_RelayOption(*row) for row in relay_settings()]


def _parser() -> argparse.ArgumentParser:
    defaults = ServerSettings()
    parser = argparse.ArgumentParser(prog="static", description="Static: API and relay server")
    parser.add_argument("--version", action="version", version=f"%(prog)s {static.__version__}")
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
    for flag, env, text in (
        ("--tls-cert", "STATIC_TLS_CERT", "PEM certificate chain (leaf first)"),
        ("--tls-key", "STATIC_TLS_KEY", "PEM private key of that certificate"),
    ):
        serve.add_argument(
            flag,
            type=Path,
            default=os.environ.get(env) or None,
            metavar="FILE",
            help=f"{text}: both ports serve TLS (HTTP/1.1 and h2 on the API); give both "
            f"--tls-cert and --tls-key, or neither [{env}]",
        )
    for option in _relay_options():
        given = os.environ.get(option.env)
        if given is not None:
            value: float | None = option.parse(given)
        elif option.name in (_RELAY_CAP, _RELAY_CAP_PER_ADDRESS):
            # Left unset, it stays None until the open-file limit is known.
            value = None
        else:
            value = option.parse(f"{option.default:.10g}")
        serve.add_argument(
            option.flag,
            type=option.parse,
            default=value,
            metavar=_METAVARS[option.kind],
            help=f"{option.help} [{option.env}] (default {option.default:.10g})",
        )
    for flag, field_name, text in _HTTP_CAPS:
        env = "STATIC_" + _dest(flag).upper()
        given = os.environ.get(env)
        serve.add_argument(
            flag,
            type=int,
            default=int(given) if given is not None else None,
            metavar="N",
            help=f"{text}; more are closed as they come [{env}] "
            f"(default {getattr(defaults.api, field_name)}, lowered to fit the open-file limit "
            "when unset)",
        )
    _observability_flags(serve, defaults)
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
    serve.add_argument(
        "--account-rate",
        type=RateLimit.parse,
        default=_env("STATIC_ACCOUNT_RATE", str(defaults.api.account_rate_limit or "off")),
        metavar="N/SECONDS",
        help="authenticated requests allowed per account, all its keys and JWTs together "
        "(beside --key-rate); 'off' disables [STATIC_ACCOUNT_RATE] (default %(default)s)",
    )
    max_lifetime = os.environ.get("STATIC_MAX_KEY_LIFETIME")
    serve.add_argument(
        "--max-key-lifetime",
        type=int,
        default=int(max_lifetime) if max_lifetime else defaults.api.max_key_lifetime_seconds,
        metavar="SECONDS",
        help="the longest expires_in a new key may ask for; then every new key must ask "
        "[STATIC_MAX_KEY_LIFETIME] (default: none, keys may live forever)",
    )
    serve.add_argument(
        "--audit-retention-days",
        type=float,
        default=float(
            _env("STATIC_AUDIT_RETENTION_DAYS", f"{defaults.api.audit_retention_days:g}")
        ),
        metavar="DAYS",
        help="days the audit log keeps its events (GET /v1/audit) [STATIC_AUDIT_RETENTION_DAYS] "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--auth-failure-rate",
        type=RateLimit.parse,
        default=_env(
            "STATIC_AUTH_FAILURE_RATE", str(defaults.api.auth_failure_rate_limit or "off")
        ),
        metavar="N/SECONDS",
        help="failed authentications allowed per client address, on each port (then 429, "
        "or RESOURCE_EXHAUSTED on the relay): bursts of N, N per SECONDS; 'off' disables "
        "[STATIC_AUTH_FAILURE_RATE] (default %(default)s)",
    )
    register_client_commands(commands, parser)  # static/_commands: context, account, keys...
    return parser


def _observability_flags(serve: argparse.ArgumentParser, defaults: ServerSettings) -> None:
    """``--log-level``, ``--log-format``, ``--metrics`` (docs/design.md "Observability")."""
    from static._logging import LOG_FORMATS, LOG_LEVELS

    serve.add_argument(
        "--log-level",
        choices=list(LOG_LEVELS),
        default=_env("STATIC_LOG_LEVEL", defaults.log.level).lower(),
        help="least severe log records written to stderr; the relay logs every call at debug "
        "[STATIC_LOG_LEVEL] (default %(default)s)",
    )
    serve.add_argument(
        "--log-format",
        choices=list(LOG_FORMATS),
        default=_env("STATIC_LOG_FORMAT", defaults.log.format).lower(),
        help="log records as text or as JSON lines [STATIC_LOG_FORMAT] (default %(default)s)",
    )
    metrics = os.environ.get("STATIC_METRICS")
    serve.add_argument(
        "--metrics",
        type=Address.parse,
        default=Address.parse(metrics) if metrics else defaults.metrics,
        metavar="HOST:PORT",
        help="serve GET /metrics on this address alone (not on the HTTP port) [STATIC_METRICS] "
        "(default: on the HTTP port)",
    )


def _settings(args: argparse.Namespace, open_files: int) -> ServerSettings:
    if not 1 <= args.token_ttl <= MAX_TOKEN_TTL_SECONDS:
        raise ValueError(f"--token-ttl must be between 1 and {MAX_TOKEN_TTL_SECONDS} seconds")
    if args.max_key_lifetime is not None and not 1 <= args.max_key_lifetime <= 31_536_000:
        raise ValueError("--max-key-lifetime must be between 1 and 31536000 seconds")
    if not 0 < args.audit_retention_days <= 36_500:
        raise ValueError("--audit-retention-days must be above 0 and at most 36500")
    options = _relay_options()
    _fit_connections(args, options, open_files)
    for option in options:
        option.check(getattr(args, option.dest))
    for flag, _, _ in _HTTP_CAPS:
        if not 1 <= getattr(args, _dest(flag)) <= 10_000_000:
            raise ValueError(f"{flag} must be between 1 and 10,000,000")
    settings = ServerSettings(
        http=args.http,
        relay=args.relay,
        data_dir=args.data_dir,
        database_url=args.database,
        api=ApiSettings(
            token_ttl_seconds=args.token_ttl,
            signup_rate_limit=args.signup_rate,
            key_rate_limit=args.key_rate,
            account_rate_limit=args.account_rate,
            max_key_lifetime_seconds=args.max_key_lifetime,
            audit_retention_days=args.audit_retention_days,
            auth_failure_rate_limit=args.auth_failure_rate,
            **{field_name: getattr(args, _dest(flag)) for flag, field_name, _ in _HTTP_CAPS},
        ),
        relay_settings=RelaySettings(
            allow_anonymous=args.allow_anonymous,
            tunables={option.name: getattr(args, option.dest) for option in options},
        ),
        metrics=args.metrics,
        log=LogSettings(level=args.log_level, format=args.log_format),
        tls=_tls(args.tls_cert, args.tls_key),
    )
    # The relay opens the database itself: one it cannot share (SQLite in memory) is refused
    # here, as a configuration error, not once the HTTP API is already up.
    database_location(settings.resolved_database_url)
    return settings


def _tls(cert: Path | str | None, key: Path | str | None) -> TlsSettings | None:
    """The TLS files, checked now as both ports will load them: a bad one is a configuration
    error naming the file, not a failure at the first handshake."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    from static._native.relay import check_tls_files

    tls = TlsSettings(Path(cert), Path(key))
    try:
        check_tls_files(tls.cert, tls.key)  # the relay's rustls; says which file
    except ValueError as exc:
        raise ValueError(f"cannot serve TLS: {exc}") from None
    try:
        # The HTTP API's: Python's ssl (OpenSSL), which might refuse what rustls took.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert, tls.key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"--tls-cert {tls.cert} and --tls-key {tls.key}: the HTTP API cannot serve TLS "
            f"with them: {exc}"
        ) from None
    return tls


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (a process-wide
    setting: only the command sets it); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        # E.g. macOS refuses more than OPEN_MAX: the soft limit stays then.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return sys.maxsize if soft == resource.RLIM_INFINITY else soft


def _fit_connections(
    args: argparse.Namespace, options: list[_RelayOption], open_files: int
) -> None:
    """Fill in the connection caps left unset, so that the relay's and the HTTP API's caps
    and :data:`FILE_RESERVE` fit in ``open_files``: their defaults, or less in the same
    proportion when those do not fit. Caps that were set must fit as they are."""
    relay = {option.name: option for option in options}
    api = ApiSettings()
    caps = {
        relay[_RELAY_CAP].dest: int(relay[_RELAY_CAP].default),
        _dest("--http-max-connections"): api.max_connections,
    }
    given = {dest: getattr(args, dest) for dest in caps}
    room = open_files - FILE_RESERVE
    unset = [dest for dest, value in given.items() if value is None]
    left = room - sum(value for value in given.values() if value is not None)
    wanted = sum(caps[dest] for dest in unset)
    for dest in unset:
        share = caps[dest] if wanted <= left else left * caps[dest] // max(wanted, 1)
        setattr(args, dest, max(1, share))
    total = sum(getattr(args, dest) for dest in caps)
    if total > room:
        raise ValueError(
            f"{relay[_RELAY_CAP].flag} ({args.relay_max_connections}) and "
            f"--http-max-connections ({args.http_max_connections}) with {FILE_RESERVE} files "
            f"kept for the store need {total + FILE_RESERVE} open files; this process may "
            f"open {open_files} (ulimit -n): raise that limit or lower the caps"
        )
    per_address = {
        relay[_RELAY_CAP_PER_ADDRESS].dest: (
            int(relay[_RELAY_CAP_PER_ADDRESS].default),
            args.relay_max_connections,
        ),
        _dest("--http-max-connections-per-address"): (
            api.max_connections_per_address,
            args.http_max_connections,
        ),
    }
    for dest, (default, cap) in per_address.items():
        if getattr(args, dest) is None:
            setattr(args, dest, min(default, cap))


async def _run(settings: ServerSettings) -> None:
    from static.server import serve

    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve, settings, shutdown)
            print(f"http: {bound.http_url}", flush=True)
            print(f"relay: {bound.relay_url}", flush=True)
            if bound.metrics_url is not None:
                print(f"metrics: {bound.metrics_url}", flush=True)
            async for _ in signals:
                shutdown.set()
                break


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``static`` command; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
        if run_client_command(args):
            return 0
        settings = _settings(args, _raise_open_file_limit())
        from static._logging import configure_logging

        configure_logging(settings.log.level, settings.log.format)
    except CommandError as exc:
        print(f"static: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
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
    from static._datadir import DatabaseInUse
    from static.store import DatabaseError

    # Threads that call back into Python need the GIL: the SQLite store's worker threads (to
    # report, and between SQLite calls) and the relay's threads asking for token checks. With
    # CPython's default 5 ms switch interval one can wait that long behind a busy event loop.
    sys.setswitchinterval(0.0005)
    # The modules loaded by now (some 40,000 objects) live as long as the process: out of the
    # collector's sight, a full collection no longer stalls every connection for ~10 ms.
    gc.collect()
    gc.freeze()
    # Owner-only files and directories (0600/0700) for all this process creates: the database
    # (the JWT signing key, API key hashes) and what SQLite makes beside it (-wal, -shm), from
    # Python and from the relay alike; chmod at each creation would miss SQLite's own.
    os.umask(0o077)
    try:
        trio.run(_run, settings)
    except DatabaseInUse as exc:
        print(f"static serve: {exc}", file=sys.stderr)
        return 2
    except (OSError, DatabaseError) as exc:
        print(f"static serve: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # Raised inside the server's nurseries (a port taken, a database unreachable): the same
        # one line per cause, unless something else (a bug) is in the group too.
        expected, rest = group.split((OSError, DatabaseError, DatabaseInUse))
        if expected is None or rest is not None:
            raise
        causes = _leaves(expected)
        for cause in causes:
            print(f"static serve: {cause}", file=sys.stderr)
        return 2 if any(isinstance(cause, DatabaseInUse) for cause in causes) else 1
    return 0


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions in ``group`` and its nested groups."""
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


if __name__ == "__main__":
    sys.exit(main())
