"""The one error the client commands raise: a message for a person, one line, never a secret."""

from __future__ import annotations

__all__ = ["CommandError"]


class CommandError(Exception):
    """A client command failed; ``str(err)`` is the line ``static`` prints (exit code 1)."""
