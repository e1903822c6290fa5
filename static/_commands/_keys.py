"""``static keys``: create, list, revoke and roll the account's API keys."""

from __future__ import annotations

import argparse
from typing import Any

from static._commands._account import save_key
from static._commands._common import Subparsers, add_command
from static._commands._config import settings
from static._commands._errors import CommandError
from static._commands._http import keyed_api
from static._commands._output import emit, fields, table, when

__all__ = ["register"]

_SCOPES = ("keys", "channels")


def register(subparsers: Subparsers) -> None:
    group = add_command(
        subparsers,
        "keys",
        "create, list, revoke and roll API keys",
        ["static keys list", "static keys create --name agent --scopes channels"],
    )
    commands = group.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = add_command(
        commands,
        "create",
        "create an API key; its secret is printed once",
        [
            "static keys create --name planner --scopes channels "
            "--channels 'acme/*/planner' --expires-in 86400",
            "static keys create --name ci --json",
        ],
        _create,
    )
    create.add_argument("--name", metavar="NAME", help="default: 'default'")
    create.add_argument(
        "--scopes",
        type=_scopes,
        metavar="SCOPES",
        help="comma-separated, of 'keys' (manage keys, read the audit log) and 'channels' "
        "(use the relay); default both",
    )
    create.add_argument(
        "--channels",
        nargs="+",
        metavar="PATTERN",
        help="the channels the key may use, org/namespace/service with '*' for any one "
        "component; default every channel",
    )
    create.add_argument(
        "--expires-in",
        type=int,
        metavar="SECONDS",
        help="default: never (unless the server sets a maximum)",
    )
    create.add_argument(
        "--save-context", metavar="NAME", help="also save the new key in this context"
    )
    add_command(
        commands,
        "list",
        "list the working keys (never a secret)",
        ["static keys list", "static keys list --json"],
        _list,
    )
    revoke = add_command(
        commands,
        "revoke",
        "revoke a key: it stops working at once",
        ["static keys revoke 5f0c5d8e-0b1f-4c37-9a53-2f1f0e6b7a10"],
        _revoke,
    )
    revoke.add_argument("id", metavar="ID")
    roll = add_command(
        commands,
        "roll",
        "replace a key by a new one; the old one works for a grace period",
        ["static keys roll 5f0c5d8e-0b1f-4c37-9a53-2f1f0e6b7a10 --grace 600"],
        _roll,
    )
    roll.add_argument("id", metavar="ID")
    roll.add_argument(
        "--grace",
        type=int,
        metavar="SECONDS",
        help="how long the old key keeps working (default 3600, at most 604800)",
    )
    roll.add_argument(
        "--save-context", metavar="NAME", help="also save the new key in this context"
    )


def _scopes(text: str) -> list[str]:
    scopes = [s.strip() for s in text.split(",") if s.strip()]
    for scope in scopes:
        if scope not in _SCOPES:
            raise argparse.ArgumentTypeError(f"unknown scope {scope!r}: keys, channels")
    return scopes


def _show_new(args: argparse.Namespace, made: Any, extra: dict[str, object]) -> None:
    """A key just made: its fields and its secret, once."""
    if not isinstance(made, dict) or not isinstance(made.get("key"), str):
        raise CommandError("the API answered without the new key")
    saved = None
    if args.save_context:
        saved = save_key(settings(args), args.save_context, made["key"])
    if args.json:
        emit({**made, **({"context": args.save_context} if saved else {})})
        return
    fields(
        {
            "id": made.get("id"),
            "prefix": made.get("key_prefix"),
            "name": made.get("name"),
            "scopes": ",".join(made.get("scopes") or []),
            "channels": " ".join(made.get("channels") or ["*"]),
            "expires": when(made.get("expires_at")),
            **extra,
            "key": made["key"],
        }
    )
    if saved:
        print(f"saved in context {args.save_context!r} ({saved[0]})")
    else:
        print("(the key is shown once: keep it)")


def _create(args: argparse.Namespace) -> None:
    body: dict[str, object] = {}
    if args.name is not None:
        body["name"] = args.name
    if args.scopes is not None:
        body["scopes"] = args.scopes
    if args.channels is not None:
        body["channels"] = args.channels
    if args.expires_in is not None:
        body["expires_in"] = args.expires_in
    _show_new(args, keyed_api(args).call("POST", "/v1/keys", body), {})


def _list(args: argparse.Namespace) -> None:
    answer = keyed_api(args).call("GET", "/v1/keys")
    keys = answer.get("keys", []) if isinstance(answer, dict) else []
    if args.json:
        emit({"keys": keys})
        return
    rows = [
        [
            key.get("id"),
            key.get("key_prefix"),
            key.get("name"),
            ",".join(key.get("scopes") or []),
            when(key.get("created_at")),
            when(key.get("last_used_at")),
            when(key.get("expires_at")),
        ]
        for key in keys
    ]
    table(["ID", "PREFIX", "NAME", "SCOPES", "CREATED", "LAST USED", "EXPIRES"], rows)


def _revoke(args: argparse.Namespace) -> None:
    try:
        keyed_api(args).call("DELETE", f"/v1/keys/{_path_id(args.id)}")
    except CommandError as exc:
        raise _not_found(exc, args.id) from None
    if args.json:
        emit({"revoked": args.id})
    else:
        print(f"revoked key {args.id}")


def _roll(args: argparse.Namespace) -> None:
    body = {} if args.grace is None else {"grace_seconds": args.grace}
    try:
        made = keyed_api(args).call("POST", f"/v1/keys/{_path_id(args.id)}/roll", body)
    except CommandError as exc:
        raise _not_found(exc, args.id) from None
    grace = 3600 if args.grace is None else args.grace
    _show_new(args, made, {"replaces": f"{args.id} (working for {grace} s more)"})


def _path_id(text: str) -> str:
    """A key id as a path segment: what is not one is refused here, never sent as a path."""
    if not 1 <= len(text) <= 64 or not all(c.isalnum() or c == "-" for c in text):
        raise CommandError(f"{text[:80]!r} is not a key id (static keys list shows them)")
    return text


def _not_found(exc: CommandError, key_id: str) -> CommandError:
    if str(exc).startswith("not found:"):
        return CommandError(
            f"no working key {key_id} in this account (unknown, revoked, expired, "
            "or rolled already)"
        )
    return exc
