"""Logging of ``static serve``: levelled records on stderr, as text or JSON lines, for the
Python side and the relay alike (the relay's Rust records come through the extension's bridge,
``static._native.relay.init_logging``). Configured once, by ``static.cli.main``.

Loggers: ``static.access`` (the HTTP access log), ``static.relay.access`` (the relay's: refusals
at INFO, every call at DEBUG), ``static.relay``, ``static.api``, ``static.store``. Records carry
ids (account, API key), never a secret: an API key is named by its id, or by its public prefix
when the key is not known.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Final

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "configure_logging"]

#: ``--log-level`` values -> Python's levels.
LOG_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LOG_FORMATS: Final = ("text", "json")

#: The attributes every ``LogRecord`` has: anything else came through ``extra=`` (a field).
_STANDARD: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys() | {"message", "asctime"}
)


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class _TextFormatter(logging.Formatter):
    """``2026-01-01T00:00:00.000Z INFO static.access: message``, then the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``message``, the record's
    fields (``extra=``), and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """Send every record at ``level`` and above to stderr in ``log_format`` (``text`` or
    ``json``), the relay's included. Process-wide: only ``static.cli.main`` calls it."""
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if log_format not in LOG_FORMATS:
        raise ValueError(
            f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}"
        )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if log_format == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    # Our records at the level asked for; other libraries' (hypercorn, asyncpg) from WARNING.
    root.setLevel(max(LOG_LEVELS[level], logging.WARNING))
    logging.getLogger("static").setLevel(LOG_LEVELS[level])
    from static._native.relay import init_logging

    # Records below the level are dropped in Rust, before they are formatted or need the GIL.
    init_logging(LOG_LEVELS[level])
