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

from static._channel_name import MAX_CHANNEL_NAME_LENGTH
from static.api._errors import BadRequest, NotFound, Unauthorized, UnsupportedMediaType
from static.store import ALL_SCOPES, AUDIT_CURSOR_PATTERN, parse_audit_cursor

__all__ = [
    "AUDIT_CURSOR",
    "CHANNEL_PATTERN",
    "DEFAULT_GRACE_SECONDS",
    "EMAIL_PATTERN",
    "MAX_AUDIT_LIMIT",
    "MAX_CHANNEL_PATTERNS",
    "MAX_EMAIL_CHARS",
    "MAX_GRACE_SECONDS",
    "MAX_KEY_LIFETIME_SECONDS",
    "MAX_NAME_CHARS",
    "NAME_PATTERN",
    "AuditQuery",
    "KeyRules",
    "NewAccount",
    "bearer_token",
    "parse_audit_query",
    "parse_grace",
    "parse_json_object",
    "parse_key_id",
    "parse_key_rules",
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
#: An ``org/namespace/service`` pattern of POST /v1/keys' ``channels``: each component a literal
#: channel-name component (``crates/mls/src/channel_name.rs``: ``[A-Za-z0-9][A-Za-z0-9_.-]{0,62}``)
#: or exactly ``*`` (any one component). Also the OpenAPI document's ``pattern``.
_COMPONENT = r"(\*|[A-Za-z0-9][A-Za-z0-9_.\-]{0,62})"
CHANNEL_PATTERN = f"^{_COMPONENT}/{_COMPONENT}/{_COMPONENT}$"
_CHANNEL_PATTERN = re.compile(CHANNEL_PATTERN[1:-1])
MAX_CHANNEL_PATTERNS = 100
#: ``expires_in`` of a new key: a year at most.
MAX_KEY_LIFETIME_SECONDS = 31_536_000
#: ``grace_seconds`` of a roll: a week at most, an hour when not given.
MAX_GRACE_SECONDS = 604_800
DEFAULT_GRACE_SECONDS = 3_600
MAX_AUDIT_LIMIT = 200
DEFAULT_AUDIT_LIMIT = 50
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# RFC 7230 token68 (RFC 6750's b64token): what may follow "Bearer ".
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_EMAIL = re.compile(EMAIL_PATTERN)


@dataclass(frozen=True, slots=True)
class KeyRules:
    """What POST /v1/keys asks of a new key besides its name."""

    scopes: tuple[str, ...]
    #: Channel patterns in the order given; None: every channel.
    channels: tuple[str, ...] | None
    #: Seconds the key lives; None: forever.
    expires_in: int | None


@dataclass(frozen=True, slots=True)
class AuditQuery:
    limit: int
    cursor: tuple[int, str, int] | None


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


def _integer(body: dict[str, Any], field: str, low: int, high: int) -> int | None:
    """An optional integer field within ``low..high``; null is absent. A bool, a number with a
    fraction (``1.5``) or a numeric string is refused. ``5.0`` is 5: JSON has one number type,
    and JSON Schema (the OpenAPI document's ``integer``) counts ``5.0`` as an integer."""
    value = body.get(field)
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise BadRequest(f"{field} must be an integer")
    if not low <= value <= high:
        raise BadRequest(f"{field} must be between {low} and {high}")
    return value


def _string_list(body: dict[str, Any], field: str, max_items: int) -> list[str] | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{field} must be a list of strings")
    if not 0 < len(value) <= max_items:
        raise BadRequest(f"{field} must have 1 to {max_items} entries")
    # Refused rather than dropped: the OpenAPI document says ``uniqueItems``.
    if len(set(value)) != len(value):
        raise BadRequest(f"{field} must not repeat an entry")
    return value


def parse_key_rules(body: dict[str, Any], max_lifetime: int | None = None) -> KeyRules:
    """``scopes``, ``channels`` and ``expires_in`` of POST /v1/keys (each optional; null is
    absent). A list repeating an entry is refused. With ``max_lifetime`` (the
    server's ``--max-key-lifetime``) a key must ask for an expiry, of at most that."""
    scopes = _string_list(body, "scopes", len(ALL_SCOPES))
    if scopes is not None and not set(scopes) <= set(ALL_SCOPES):
        raise BadRequest("scopes must be a non-empty list of keys and channels")
    channels = _string_list(body, "channels", MAX_CHANNEL_PATTERNS)
    if channels is not None:
        for pattern in channels:
            if _CHANNEL_PATTERN.fullmatch(pattern) is None:
                shown = pattern if len(pattern) <= MAX_CHANNEL_NAME_LENGTH else "a pattern"
                raise BadRequest(
                    f"invalid channel pattern {shown!r}: expected org/namespace/service, each "
                    "component 1-63 letters, digits, '_', '.', '-' starting with a letter or "
                    "digit, or exactly *"
                )
    expires_in = _integer(body, "expires_in", 1, MAX_KEY_LIFETIME_SECONDS)
    if max_lifetime is not None:
        if expires_in is None:
            raise BadRequest(f"expires_in is required (at most {max_lifetime} seconds)")
        if expires_in > max_lifetime:
            raise BadRequest(f"expires_in must be at most {max_lifetime} seconds")
    return KeyRules(
        scopes=ALL_SCOPES if scopes is None else tuple(s for s in ALL_SCOPES if s in scopes),
        channels=None if channels is None else tuple(channels),
        expires_in=expires_in,
    )


def parse_grace(body: dict[str, Any]) -> int:
    """``grace_seconds`` of POST /v1/keys/:id/roll: 0 to a week, an hour when absent."""
    grace = _integer(body, "grace_seconds", 0, MAX_GRACE_SECONDS)
    return DEFAULT_GRACE_SECONDS if grace is None else grace


def parse_audit_query(args: Any) -> AuditQuery:
    """``limit`` (1-200, default 50) and ``cursor`` of GET /v1/audit from the query string
    (a werkzeug ``MultiDict``); each at most once."""
    limits = args.getlist("limit")
    cursors = args.getlist("cursor")
    if len(limits) > 1 or len(cursors) > 1:
        raise BadRequest("limit and cursor may each be given once")
    limit = DEFAULT_AUDIT_LIMIT
    if limits:
        text = limits[0]
        if not (text.isascii() and text.isdigit() and len(text) <= 3):
            raise BadRequest(f"limit must be an integer between 1 and {MAX_AUDIT_LIMIT}")
        limit = int(text)
        if not 1 <= limit <= MAX_AUDIT_LIMIT:
            raise BadRequest(f"limit must be an integer between 1 and {MAX_AUDIT_LIMIT}")
    cursor = None
    if cursors:
        cursor = parse_audit_cursor(cursors[0])
        if cursor is None:
            raise BadRequest("invalid cursor")
    return AuditQuery(limit, cursor)


#: The cursor's form, for the OpenAPI document.
AUDIT_CURSOR = AUDIT_CURSOR_PATTERN


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
