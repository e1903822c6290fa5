"""What every client command's parser shares: the global flags, ``--json``, an example."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from static._commands._config import global_flags
from static._commands._output import json_flag

__all__ = ["IntermixedParser", "Run", "add_command"]

#: A command's body: it prints its output, or raises CommandError.
Run = Callable[[argparse.Namespace], None]


class IntermixedParser(argparse.ArgumentParser):
    """A command whose options may come between its positionals: ``channel send NAME --as
    alice TEXT`` (plain argparse gives an optional positional its default before it sees the
    options, then refuses TEXT)."""

    _inside = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._inside:  # parse_known_intermixed_args calls this again
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


# argparse's own type for ``add_subparsers()``'s result is private.
Subparsers = Any


def add_command(
    subparsers: Subparsers,
    name: str,
    summary: str,
    examples: list[str],
    run: Run | None = None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """A command (or a group of commands, without ``run``) with ``--help`` showing
    ``examples``; the global flags and ``--json`` go on every command that runs."""
    epilog = "Example:\n" + "\n".join(f"  {line}" for line in examples)
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=description or summary[0].upper() + summary[1:] + ".",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if run is not None:
        global_flags(parser)
        json_flag(parser)
        parser.set_defaults(client_run=run)
    return parser
