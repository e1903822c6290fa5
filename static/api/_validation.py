"""Request input rules (pure): JSON bodies, account and key fields, bearer credentials, ids.

Every function takes what the HTTP layer read and returns clean values or raises an
:class:`~static.api._errors.ApiError`; nothing here touches the network or the store.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from static.api._errors import BadRequest, NotFound, Unauthorized, UnsupportedMediaType

__all__ = [
    "EMAIL_PATTERN",
    "MAX_EMAIL_CHARS",
    "MAX_NAME_CHARS",
    "NAME_PATTERN",
    "NewAccount",
    "bearer_token",
    "parse_json_object",
    "parse_key_id",
    "parse_new_account",
    "parse_new_key",
]

MAX_EMAIL_CHARS = 254  # RFC 5321's limit on a forward path
MAX_NAME_CHARS = 200
DEFAULT_KEY_NAME = "default"

# C0/C1 controls and DEL have no place in an email or a display name (and PostgreSQL refuses
# NUL); lone surrogates cannot be stored as UTF-8 at all.
# (Surrogates are left out of the patterns: JSON Schema validators work on Unicode scalar values,
# which have none, and refuse such a pattern.)
_CONTROLS = r"\x00-\x1f\x7f-\x9f"
_FORBIDDEN = re.compile(rf"[{_CONTROLS}\ud800-\udfff]")
# What ``str.strip()`` drops: every character for which ``str.isspace()`` holds.
_SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# The fields as JSON Schema patterns (ECMA-262 and Python alike), stated in the OpenAPI
# document and checked here, so that the two cannot disagree (schemathesis checks it both ways).
# Surrounding white space is allowed and dropped; inside, a name takes anything but controls,
# an email one ``@`` with text on both sides and no white space.
NAME_PATTERN = f"^[{_SPACE}]*[^{_CONTROLS}]*[{_SPACE}]*$"
_EMAIL_CHAR = f"[^@{_SPACE}{_CONTROLS}]"
EMAIL_PATTERN = f"^[{_SPACE}]*{_EMAIL_CHAR}+@{_EMAIL_CHAR}+[{_SPACE}]*$"
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# RFC 7230 token68 (RFC 6750's b64token): what may follow "Bearer ".
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_EMAIL = re.compile(EMAIL_PATTERN)


@dataclass(frozen=True, slots=True)
class NewAccount:
    email: str
    name: str | None


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def parse_json_object(body: bytes, content_type: str | None) -> dict[str, Any]:
    """The JSON object in ``body``; an empty body is an empty object.

    A body must come as ``application/json`` (415 otherwise) in UTF-8, and be one JSON object
    (400 otherwise).
    """
    if not body:
        return {}
    mimetype, _, params = (content_type or "").partition(";")
    if mimetype.strip().lower() != "application/json":
        raise UnsupportedMediaType()
    charset = re.search(r"charset\s*=\s*\"?([^\";\s]*)", params, re.IGNORECASE)
    if charset and charset[1].lower() not in {"utf-8", "utf8"}:
        raise UnsupportedMediaType("json must be encoded in utf-8")
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest("malformed json") from exc
    if not isinstance(value, dict):
        raise BadRequest("request body must be a json object")
    return value


def _text(body: dict[str, Any], field: str, max_chars: int) -> str | None:
    """An optional text field: absent, null or blank is None; surrounding space is dropped.
    The length counts the value as sent (as the schema's ``maxLength`` does)."""
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string")
    if len(value) > max_chars:
        raise BadRequest(f"{field} must be at most {max_chars} characters")
    value = value.strip()
    if not value:
        return None
    if _FORBIDDEN.search(value):
        raise BadRequest(f"{field} contains invalid characters")
    return value


def parse_new_account(body: dict[str, Any]) -> NewAccount:
    """The fields of POST /v1/accounts."""
    email = _text(body, "email", MAX_EMAIL_CHARS)
    if email is None:
        raise BadRequest("email is required")
    if _EMAIL.fullmatch(email) is None:
        raise BadRequest("invalid email")
    return NewAccount(email=email, name=_text(body, "name", MAX_NAME_CHARS))


def parse_new_key(body: dict[str, Any]) -> str:
    """The name of POST /v1/keys (``default`` when absent)."""
    return _text(body, "name", MAX_NAME_CHARS) or DEFAULT_KEY_NAME


def parse_key_id(text: str) -> str:
    """A key id from a path, canonical lower-case; anything but a UUID is 404 (no such key)."""
    if _UUID.fullmatch(text) is None:
        raise NotFound()
    return text.lower()


def bearer_token(values: Sequence[str]) -> str:
    """The credential of the ``Authorization`` header values of a request.

    Exactly one header, printable ASCII (checked here whatever the HTTP layer let through: h2
    before 4.3 let illegal characters through, CVE-2025-57804), of the form ``Bearer <token>``.
    """
    if not values:
        raise Unauthorized("missing authorization header")
    if len(values) > 1:
        raise Unauthorized("invalid authorization header")
    value = values[0]
    if not value.isascii() or not value.isprintable():
        raise Unauthorized("invalid authorization header")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or _TOKEN.fullmatch(token) is None:
        raise Unauthorized("invalid authorization header")
    return token
