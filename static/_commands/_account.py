"""``static account``: create an account (and save its first key in a context), show it."""

from __future__ import annotations

import argparse
import sys

from static._commands._common import Subparsers, add_command
from static._commands._config import (
    Context,
    Settings,
    current_context,
    safe_name,
    save_context,
    settings,
    use_context,
)
from static._commands._errors import CommandError
from static._commands._http import Api, keyed_api
from static._commands._output import emit, fields, stderr

__all__ = ["register", "save_key"]


def register(subparsers: Subparsers) -> None:
    group = add_command(
        subparsers,
        "account",
        "create an account, show yours",
        [
            "static --api-url http://127.0.0.1:8000 account create --email me@example.com",
            "static account show",
        ],
    )
    commands = group.add_subparsers(dest="account_command", required=True, metavar="COMMAND")
    create = add_command(
        commands,
        "create",
        "create an account; its first API key is printed once",
        [
            "static account create --email me@example.com --name Me --save-context local "
            "--api-url http://127.0.0.1:8000 --relay-url grpc://127.0.0.1:50051"
        ],
        _create,
        description="Create an account (POST /v1/accounts). Its first API key, with every "
        "scope, is printed once and can be saved in a context: with --save-context NAME, or "
        "when asked (only when stdin is a terminal and without --json).",
    )
    create.add_argument("--email", required=True, metavar="EMAIL")
    create.add_argument("--name", metavar="NAME", help="a display name")
    create.add_argument(
        "--save-context",
        metavar="NAME",
        help="save the API URL, the relay URL and the key in this context, without asking",
    )
    add_command(commands, "show", "show your account", ["static account show --json"], _show)


def save_key(config: Settings, name: str, key: str) -> tuple[str, bool]:
    """Save ``key`` with ``config``'s addresses as context ``name`` (0600); make it current
    when no context is. Its path and whether it is now current."""
    context = Context(
        safe_name("context", name),
        api_url=config.api_url,
        relay_url=config.relay_url,
        ca_file=config.ca_file,
        api_key=key,
    )
    path = save_context(context)
    current = current_context() in (None, name)
    if current:
        use_context(name)
    return str(path), current


def _ask_context() -> str | None:
    """The context name the person types (empty: none). The question goes to stderr, so
    that stdout holds only the command's output."""
    print("Save this key in a context? Name (Enter to skip): ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline(200).strip() or None


def _create(args: argparse.Namespace) -> None:
    config = settings(args)
    if args.save_context:
        safe_name("context", args.save_context)  # refused before the account is made
    api = Api(config.need_api_url(), ca_file=config.ca_file)
    body = {"email": args.email}
    if args.name:
        body["name"] = args.name
    answer = api.call("POST", "/v1/accounts", body)
    account = answer.get("account") if isinstance(answer, dict) else None
    key = answer.get("api_key") if isinstance(answer, dict) else None
    if not isinstance(key, str) or not isinstance(account, dict):
        raise CommandError("POST /v1/accounts answered without an account and a key")
    name: str | None = args.save_context
    if args.json:  # never asks
        saved = save_key(config, name, key) if name is not None else None
        emit(
            {
                "account": account,
                "api_key": key,
                "context": name,
                "context_path": saved[0] if saved else None,
                "current": saved[1] if saved else None,
            }
        )
        return
    fields(_account_fields(account))
    print(f"API key  {key}")
    if name is None and sys.stdin.isatty():
        print("(the key is shown once: keep it, or save it in a context now)", flush=True)
        name = _ask_context()
    if name is None:
        print("(the key is shown once: keep it)")
        return
    path, current = save_key(config, name, key)
    print(f"saved in context {name!r} ({path})" + (", now current" if current else ""))
    if not config.relay_url:
        stderr(
            f"note: no relay URL in context {name!r}: agents need one "
            f"(static context add {name} --relay-url URL, or STATIC_RELAY_URL)"
        )


def _account_fields(account: dict[str, object]) -> dict[str, object]:
    return {
        "account": account.get("id"),
        "email": account.get("email"),
        "name": account.get("name"),
        "plan": account.get("plan_tier"),
    }


def _show(args: argparse.Namespace) -> None:
    api = keyed_api(args)
    account = api.call("GET", "/v1/accounts/me")
    if args.json:
        emit(account)
    else:
        fields(_account_fields(account))
