"""``static``: the command line. The only place that owns signals, configuration and exit codes."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import signal
import sys
from collections.abc import Sequence

import static
from static import _serve_options as serve_options
from static._commands import CommandError, run_client_command
from static._commands import register as register_client_commands
from static._settings import ServerSettings

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="static",
        description="Static: the server (serve) and its command-line client (context, account, "
        "keys, audit, agent, channel, invitations)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {static.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP API and the relay",
        # The options are listed by group below: some 50 of them would bury the usage line.
        usage="%(prog)s [--config FILE] [--print-config] [OPTION ...]",
        description="Run the HTTP API and the relay in one process. Every option also reads "
        "from an environment variable (shown in brackets) and from the --config file (its "
        "table in the group's title, its key the flag's name with underscores); a flag beats "
        "the environment, which beats the file (docs/operators.md).",
    )
    serve_options.add_arguments(serve)
    register_client_commands(commands, parser)  # static/_commands: context, account, keys...
    return parser


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


async def _run(settings: ServerSettings) -> None:
    import trio

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
        configuration = serve_options.load(args, os.environ)
        settings = serve_options.server_settings(configuration, _raise_open_file_limit())
        if args.print_config:
            print(serve_options.to_toml(configuration), end="")
            return 0
        from static._logging import configure_logging

        configure_logging(settings.log.level, settings.log.format)
    except CommandError as exc:
        print(f"static: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `static keys list | head -1`: the reader has what it wanted. Quietly, as a shell's
        # pipeline would end on SIGPIPE (128 + 13); stdout goes to /dev/null so that
        # the interpreter's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except ValueError as exc:
        print(f"static: {exc}", file=sys.stderr)
        return 2
    try:
        import static.server  # noqa: F401  (fail early and clearly without the server extra)
    except ImportError as exc:
        print(
            "static: the server needs the 'server' extra (pip install 'static-mls[server]'): "
            f"{exc}",
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
    # Here, not at the top: the client commands (keys, channel...) start without trio.
    import trio

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
