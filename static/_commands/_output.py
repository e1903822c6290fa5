"""What the client commands print: aligned tables and lines for people, JSON for scripts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

__all__ = ["emit", "fields", "json_flag", "printable", "stderr", "table", "when"]


def json_flag(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--json``, on the top parser and on every command (either place works)."""
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="print JSON for scripts instead of text",
    )


def emit(data: object) -> None:
    """``data`` as one line of JSON on stdout."""
    print(json.dumps(data, ensure_ascii=False, sort_keys=False), flush=True)


def printable(text: str | bytes, limit: int = 10_000) -> str:
    """``text`` safe for a terminal: what a peer sent may hold escape sequences or newlines;
    they are shown escaped (``\\x1b``, ``\\n``), and the length is bounded."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="backslashreplace")
    out = []
    for char in text[:limit]:
        if char.isprintable():
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out) + ("…" if len(text) > limit else "")


def when(value: object) -> str:
    """An ISO 8601 time (or Unix seconds) shortened for a table: ``2026-11-29 12:00:05``;
    ``-`` for none."""
    if value is None or value == "":
        return "-"
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")
    text = str(value)
    return printable(text.replace("T", " ").removesuffix("Z").split(".")[0].split("+")[0])


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """An aligned table on stdout (the last column unpadded)."""
    cells = [[printable(str(cell)) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    for row in [list(headers), *cells]:
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        print("  ".join([*padded, row[-1]]).rstrip())


def fields(pairs: Mapping[str, object]) -> None:
    """``name  value`` lines, aligned (one record)."""
    width = max((len(name) for name in pairs), default=0)
    for name, value in pairs.items():
        shown = "-" if value is None else printable(str(value))
        print(f"{name.ljust(width)}  {shown}")


def stderr(line: str) -> None:
    """A remark for the person (not part of the output scripts read)."""
    print(line, file=sys.stderr, flush=True)
