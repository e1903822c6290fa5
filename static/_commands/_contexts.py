"""``static context``: add, use, list, show and remove named contexts."""

from __future__ import annotations

import argparse
from pathlib import Path

from static._commands._common import Subparsers, add_command
from static._commands._config import (
    Context,
    current_context,
    delete_context,
    key_prefix,
    list_contexts,
    load_context,
    read_key_file,
    safe_name,
    save_context,
    use_context,
)
from static._commands._errors import CommandError
from static._commands._output import emit, fields, table

__all__ = ["register", "shown"]


def register(subparsers: Subparsers) -> None:
    group = add_command(
        subparsers,
        "context",
        "named configurations (API, relay, key), kept in $XDG_CONFIG_HOME/static/",
        [
            "static context add local --api-url http://127.0.0.1:8000 "
            "--relay-url grpc://127.0.0.1:50051 --key-file ~/.static-key",
            "static context use local",
        ],
    )
    commands = group.add_subparsers(dest="context_command", required=True, metavar="COMMAND")
    add = add_command(
        commands,
        "add",
        "add a context, or update one (what is not given again is kept)",
        [
            "static context add prod --api-url https://api.example.com "
            "--relay-url https://relay.example.com --key-file ~/.static/prod.key --use"
        ],
        _add,
    )
    add.add_argument("name", metavar="NAME")
    # ``--relay`` is the spelling; ``--relay-url`` the global flag's.
    add.add_argument("--key-file", metavar="FILE", help="the file holding the API key")
    add.add_argument("--relay", dest="relay", metavar="URL", help="the relay's URL")
    add.add_argument("--use", action="store_true", help="also make it the current context")
    use = add_command(
        commands, "use", "make a context the current one", ["static context use prod"], _use
    )
    use.add_argument("name", metavar="NAME")
    add_command(commands, "list", "list the contexts", ["static context list"], _list)
    show = add_command(
        commands,
        "show",
        "show a context (the key by its prefix only)",
        ["static context show", "static context show prod --json"],
        _show,
    )
    show.add_argument("name", nargs="?", metavar="NAME", help="default: the current context")
    rm = add_command(commands, "rm", "remove a context", ["static context rm prod"], _rm)
    rm.add_argument("name", metavar="NAME")


def _add(args: argparse.Namespace) -> None:
    name = safe_name("context", args.name)
    key_file = None
    if args.key_file:
        key_file = str(Path(args.key_file).expanduser().resolve())
        read_key_file(key_file)  # refused now, not at its first use
    elif args.api_key_file:
        key_file = str(Path(args.api_key_file).expanduser().resolve())
        read_key_file(key_file)
    ca_file = str(Path(args.ca_file).expanduser().resolve()) if args.ca_file else None
    try:
        old = load_context(name)
    except CommandError:
        old = Context(name)
    # Updating a context keeps what is not given again (a key saved by account create too).
    context = Context(
        name,
        api_url=args.api_url or old.api_url,
        relay_url=args.relay or args.relay_url or old.relay_url,
        ca_file=ca_file or old.ca_file,
        api_key_file=key_file or old.api_key_file,
        api_key=None if key_file else old.api_key,
    )
    if not (context.api_url or context.relay_url):
        raise CommandError("a context needs --api-url or --relay-url (or both)")
    path = save_context(context)
    made_current = args.use or current_context() is None
    if made_current:
        use_context(name)
    if args.json:
        emit({**shown(context), "path": str(path), "current": made_current})
    else:
        print(f"saved context {name!r} in {path}" + (" (now current)" if made_current else ""))


def _use(args: argparse.Namespace) -> None:
    use_context(safe_name("context", args.name))
    if args.json:
        emit({"current": args.name})
    else:
        print(f"current context: {args.name}")


def _list(args: argparse.Namespace) -> None:
    current = current_context()
    names = list_contexts()
    if args.json:
        emit({"contexts": names, "current": current})
        return
    if not names:
        print("no contexts (static context add NAME --api-url URL ...)")
        return
    rows = []
    for name in names:
        try:
            context = load_context(name)
            rows.append(
                [
                    "*" if name == current else "",
                    name,
                    context.api_url or "-",
                    context.relay_url or "-",
                ]
            )
        except CommandError as exc:
            rows.append(["*" if name == current else "", name, f"({exc})", ""])
    table(["", "NAME", "API", "RELAY"], rows)


def shown(context: Context) -> dict[str, object]:
    """What may be shown of ``context``: all but the key, which shows by its prefix."""
    key = None
    if context.api_key:
        key = key_prefix(context.api_key)
    elif context.api_key_file:
        try:
            key = key_prefix(read_key_file(context.api_key_file))
        except CommandError:
            key = "(key file unreadable)"
    return {
        "name": context.name,
        "api_url": context.api_url,
        "relay_url": context.relay_url,
        "ca_file": context.ca_file,
        "api_key_file": context.api_key_file,
        "api_key_prefix": key,
    }


def _show(args: argparse.Namespace) -> None:
    name = args.name or current_context()
    if name is None:
        raise CommandError("no current context (static context use NAME), and no NAME given")
    data = shown(load_context(safe_name("context", name)))
    data["current"] = name == current_context()
    if args.json:
        emit(data)
        return
    fields(
        {
            "name": data["name"],
            "current": "yes" if data["current"] else "no",
            "api url": data["api_url"],
            "relay url": data["relay_url"],
            "ca file": data["ca_file"],
            "key file": data["api_key_file"]
            or ("(in the context file)" if data["api_key_prefix"] else None),
            "key": data["api_key_prefix"],
        }
    )


def _rm(args: argparse.Namespace) -> None:
    name = safe_name("context", args.name)
    delete_context(name)
    if args.json:
        emit({"removed": name})
    else:
        print(f"removed context {name!r}")
