"""The client commands of ``static`` (context, account, keys, audit, agent, channel,
invitations): their parsers and the function that runs the one chosen."""

from __future__ import annotations

import argparse

from static._commands import _account, _agents, _audit, _contexts, _keys
from static._commands._common import Subparsers
from static._commands._config import global_flags
from static._commands._errors import CommandError
from static._commands._output import json_flag

__all__ = ["CommandError", "register", "run_client_command"]


def register(subparsers: Subparsers, parser: argparse.ArgumentParser) -> None:
    """Add the client commands to ``subparsers``, and their global flags to ``parser`` (so
    that they may come before the command's name too)."""
    global_flags(parser, top=True)
    json_flag(parser, top=True)
    for family in (_contexts, _account, _keys, _audit, _agents):
        family.register(subparsers)


def run_client_command(args: argparse.Namespace) -> bool:
    """Run the client command ``args`` chose; False when it chose none (``serve``).

    :raises CommandError: the command failed (one line to show; exit code 1).
    """
    command = getattr(args, "client_run", None)
    if command is None:
        return False
    try:
        command(args)
    except BrokenPipeError:
        raise  # the reader went away (| head): cli.main ends quietly
    except OSError as exc:  # a configuration file or directory that cannot be written...
        raise CommandError(str(exc)) from None
    return True
