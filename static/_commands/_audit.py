"""``static audit``: the account's audit log (GET /v1/audit), a page or every page."""

from __future__ import annotations

import argparse
from typing import Final

from static._commands._common import Subparsers, add_command
from static._commands._errors import CommandError
from static._commands._http import keyed_api
from static._commands._output import emit, stderr, table, when

__all__ = ["register"]

#: Pages ``--all`` follows at most (of up to 200 events each), so that it ends.
MAX_PAGES: Final = 50
_COMMON = ("id", "at", "type", "key_id")


def register(subparsers: Subparsers) -> None:
    audit = add_command(
        subparsers,
        "audit",
        "the account's audit log, newest first",
        ["static audit --limit 20", "static audit --all --json"],
        _audit,
    )
    audit.add_argument(
        "--limit", type=int, metavar="N", help="events per page, 1 to 200 (default 50)"
    )
    audit.add_argument("--cursor", metavar="C", help="start after this page's next cursor")
    audit.add_argument(
        "--all",
        action="store_true",
        help=f"follow the next cursors to the end (at most {MAX_PAGES} pages)",
    )


def _audit(args: argparse.Namespace) -> None:
    api = keyed_api(args)
    events: list[dict[str, object]] = []
    cursor: str | None = args.cursor
    for _ in range(MAX_PAGES if args.all else 1):
        query = {}
        if args.limit is not None:
            query["limit"] = str(args.limit)
        if cursor:
            query["cursor"] = cursor
        page = api.call("GET", "/v1/audit", query=query)
        if not isinstance(page, dict) or not isinstance(page.get("events"), list):
            raise CommandError("GET /v1/audit answered without events")
        events.extend(page["events"])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    if args.json:
        emit({"events": events, "next_cursor": cursor})
        return
    rows = [
        [
            when(event.get("at")),
            event.get("type"),
            event.get("key_id") or "-",
            " ".join(
                f"{k}={'-' if v is None else v}" for k, v in event.items() if k not in _COMMON
            ),
        ]
        for event in events
    ]
    table(["AT", "TYPE", "KEY", "DETAIL"], rows)
    if cursor:
        stderr(
            f"more: static audit --cursor {cursor}"
            if not args.all
            else f"stopped after {MAX_PAGES} pages; more: static audit --all --cursor {cursor}"
        )
