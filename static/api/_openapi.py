"""The OpenAPI 3.1 document served at ``GET /v1/openapi.json``.

Written by hand next to the routes; a test checks that the paths and methods here are exactly the
ones the app serves.
"""

from __future__ import annotations

from typing import Any

import static
from static.api._channels import (
    CHANNELS_CURSOR,
    DEFAULT_CHANNELS_LIMIT,
    MAX_CHANNELS_LIMIT,
    RATE_MINUTES,
)
from static.api._console import ASSETS, CONTENT_SECURITY_POLICY
from static.api._validation import (
    AUDIT_CURSOR,
    CHANNEL_PATTERN,
    DEFAULT_GRACE_SECONDS,
    EMAIL_PATTERN,
    MAX_AUDIT_LIMIT,
    MAX_CHANNEL_PATTERNS,
    MAX_EMAIL_CHARS,
    MAX_GRACE_SECONDS,
    MAX_KEY_LIFETIME_SECONDS,
    MAX_NAME_CHARS,
    NAME_PATTERN,
)

__all__ = ["openapi_document"]


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _ok(schema: str, description: str = "OK") -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


_UNAUTHORIZED = _error(
    "`missing authorization header`, `invalid authorization header`, "
    "`invalid or revoked api key` (also a rolled key past its grace), `api key expired` (the "
    "key, or the key a JWT was minted from, is past its `expires_at`), `invalid or expired "
    "token` (JWT) or `api key required` (a JWT on an endpoint that takes an API key only)"
)


def _forbidden(scope: str) -> dict[str, Any]:
    return _error(f"`api key lacks the {scope} scope`: the key was created without it")


_ACCOUNT_GONE = _error("`Not found`: the account behind the credential does not exist")
_RATE_LIMITED = {
    **_error(
        "`too many requests`: the rate limit of the route (per key, and per account: all its "
        "keys and JWTs), or (on routes that authenticate) too many failed authentications "
        "from the client's address; wait the seconds of the `Retry-After` header"
    ),
    "headers": {"Retry-After": {"schema": {"type": "integer", "minimum": 1}}},
}
_UNAVAILABLE = _error("`service unavailable`: the store failed")
_JSON_BODY_ERRORS = {
    "400": _error(
        "`malformed json`, `request body must be a json object`, or a field error "
        "(`... must be a string`, `... must be at most N characters`, "
        "`... contains invalid characters`)"
    ),
    "413": _error("`request body too large` (over 64 KiB)"),
    "415": _error(
        "`content type must be application/json`: a non-empty body needs that content type"
    ),
}


#: An optional display name (an account's, a key's): null or blank means none.
_NAME = {
    "type": ["string", "null"],
    "maxLength": MAX_NAME_CHARS,
    "pattern": NAME_PATTERN,
    "description": "No control characters; surrounding white space is dropped",
}


_KEY_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "format": "uuid"},
}
_TIMESTAMP_OR_NULL = {"type": ["string", "null"], "format": "date-time"}
#: What a key may do, as create, roll and list return it.
_KEY_RULES = {
    "scopes": {
        "type": "array",
        "items": {"enum": ["keys", "channels"]},
        "description": "What the key may do: `keys` (POST/GET/DELETE /v1/keys, roll, GET "
        "/v1/audit), `channels` (POST /v1/tokens, GET /v1/channels); in this order",
    },
    "channels": {
        "type": ["array", "null"],
        "items": {"type": "string"},
        "description": "The channel patterns the key's JWTs are limited to; null: every channel",
    },
    "expires_at": {
        **_TIMESTAMP_OR_NULL,
        "description": "When the key stops working; null: never",
    },
}


def _key_auth_only(operation: dict[str, Any], scope: str | None = None) -> dict[str, Any]:
    responses = operation.setdefault("responses", {})
    if scope is not None:
        responses.setdefault("403", _forbidden(scope))
    responses.setdefault("401", _UNAUTHORIZED)
    responses.setdefault("404", _ACCOUNT_GONE)
    responses.setdefault("429", _RATE_LIMITED)
    responses.setdefault("503", _UNAVAILABLE)
    return {**operation, "security": [{"apiKey": []}]}


_RELAY_UNAVAILABLE = _error(
    "`relay is not running` (the relay of this process has not started, or stopped), `the "
    "relay's store cannot be read`, or `service unavailable` (the store failed)"
)


def _console_file(route: str, name: str, content_type: str) -> dict[str, Any]:
    media = content_type.split(";")[0]
    return {
        "get": {
            "operationId": "console" + name.split(".")[-1].capitalize(),
            "summary": f"The console's {name} (no credential: the page signs in itself)"
            if route != "/console"
            else "The console: a page that signs in with an API key (docs/console.md)",
            "responses": {
                "200": {
                    "description": "The file",
                    "headers": {
                        "Content-Security-Policy": {"schema": {"const": CONTENT_SECURITY_POLICY}},
                        "X-Content-Type-Options": {"schema": {"const": "nosniff"}},
                    },
                    "content": {media: {"schema": {"type": "string"}}},
                }
            },
        }
    }


def openapi_document() -> dict[str, Any]:
    """The document, as a JSON-ready dict."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Static API",
            "version": static.__version__,
            "description": "Accounts, API keys and token exchange. Every error is "
            '`{"error": "<text>"}`. Timestamps are ISO 8601 UTC with a `Z` suffix.',
        },
        "servers": [{"url": "/"}],
        "paths": {
            "/healthz": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness: the process answers (nothing else is checked)",
                    "responses": {
                        "200": {
                            "description": "Live",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "properties": {"status": {"const": "ok"}},
                                    }
                                }
                            },
                        },
                    },
                }
            },
            "/readyz": {
                "get": {
                    "operationId": "ready",
                    "summary": "Readiness: the store can write and the relay serves",
                    "responses": {
                        "200": {
                            "description": "Ready",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "properties": {"status": {"const": "ready"}},
                                    }
                                }
                            },
                        },
                        "503": _error("`not ready: <part>`: which part cannot serve"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics (aggregate counts and latencies only)",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format, as prometheus-client serves it",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                    },
                }
            },
            "/v1/accounts": {
                "post": {
                    "operationId": "createAccount",
                    "summary": "Register an account; returns its first API key (shown only here)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/NewAccount"}
                            }
                        },
                    },
                    "responses": {
                        "200": _ok("CreatedAccount"),
                        **_JSON_BODY_ERRORS,
                        "400": _error(
                            "`email is required` (missing, null or blank), `invalid email`, "
                            "`email must be a string`, `name must be a string`, "
                            "`name must be at most 200 characters`, `malformed json`, "
                            "`request body must be a json object`"
                        ),
                        "409": _error("`email already registered` (compared case-insensitively)"),
                        "429": _RATE_LIMITED,
                        "503": _UNAVAILABLE,
                    },
                }
            },
            "/v1/accounts/me": {
                "get": {
                    "operationId": "getAccount",
                    "summary": "The caller's account (API key or JWT)",
                    "security": [{"apiKey": []}, {"jwt": []}],
                    "responses": {
                        "200": _ok("Account"),
                        "401": _UNAUTHORIZED,
                        "404": _ACCOUNT_GONE,
                        "429": _RATE_LIMITED,
                        "503": _UNAVAILABLE,
                    },
                }
            },
            "/v1/keys": {
                "post": _key_auth_only(
                    {
                        "operationId": "createKey",
                        "summary": "Create an API key; the secret is shown only in this response",
                        "requestBody": {
                            "required": False,
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/NewKey"}
                                }
                            },
                        },
                        "responses": {
                            "200": _ok("CreatedKey"),
                            **_JSON_BODY_ERRORS,
                            "400": _error(
                                "a field error: `name ...` as for accounts; `scopes must be a "
                                "list of strings`, `scopes must have 1 to 2 entries`, `scopes "
                                "must be a non-empty list of keys and channels`, `scopes must "
                                "not repeat an entry`; `channels must be a list of strings`, "
                                "`channels must have 1 to 100 entries`, `channels must not "
                                "repeat an entry`, `invalid channel pattern '<pattern>': ...`; "
                                "`expires_in must be an integer`, `expires_in must be between "
                                "1 and 31536000`, and with the server's `--max-key-lifetime`: "
                                "`expires_in is required (at most N seconds)`, `expires_in "
                                "must be at most N seconds`; `malformed json`, `request body "
                                "must be a json object`"
                            ),
                            "409": _error("`too many active keys`: the account has 100 already"),
                        },
                    },
                    "keys",
                ),
                "get": _key_auth_only(
                    {
                        "operationId": "listKeys",
                        "summary": "The account's working keys (not revoked, expired or past "
                        "a roll's grace), newest first (never the secret)",
                        "responses": {"200": _ok("KeyList")},
                    },
                    "keys",
                ),
            },
            "/v1/keys/{id}": {
                "delete": _key_auth_only(
                    {
                        "operationId": "revokeKey",
                        "summary": "Revoke a key of the caller's account (soft delete)",
                        "parameters": [_KEY_ID],
                        "responses": {
                            "204": {"description": "Revoked; the key and its JWTs stop working"},
                            "404": _error(
                                "`Not found`: no such key, another account's key, a key "
                                "revoked already (or expired, or past a roll's grace), or an "
                                "id that is not a UUID"
                            ),
                        },
                    },
                    "keys",
                )
            },
            "/v1/keys/{id}/roll": {
                "post": _key_auth_only(
                    {
                        "operationId": "rollKey",
                        "summary": "Replace a key by a new one with the same name, scopes and "
                        "channels; the old one works for `grace_seconds` more, then is revoked",
                        "parameters": [_KEY_ID],
                        "requestBody": {
                            "required": False,
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/RollKey"}
                                }
                            },
                        },
                        "responses": {
                            "200": _ok("CreatedKey", "The new key (its secret shown only here)"),
                            **_JSON_BODY_ERRORS,
                            "400": _error(
                                "`grace_seconds must be an integer`, `grace_seconds must be "
                                "between 0 and 604800`, `malformed json`, `request body must "
                                "be a json object`"
                            ),
                            "404": _error(
                                "`Not found`: no such key, another account's key, a key "
                                "revoked, expired or rolled already, or an id that is not a UUID"
                            ),
                            "409": _error("`too many active keys`: the account has 100 already"),
                        },
                    },
                    "keys",
                )
            },
            "/v1/audit": {
                "get": _key_auth_only(
                    {
                        "operationId": "auditLog",
                        "summary": "The account's audit events (keys, and the relay's channel "
                        "and membership events), newest first",
                        "parameters": [
                            {
                                "name": "limit",
                                "in": "query",
                                "required": False,
                                "schema": {
                                    "type": "integer",
                                    "minimum": 1,
                                    "maximum": MAX_AUDIT_LIMIT,
                                    "default": 50,
                                },
                            },
                            {
                                "name": "cursor",
                                "in": "query",
                                "required": False,
                                "description": "`next_cursor` of the previous page (opaque)",
                                "schema": {"type": "string", "pattern": AUDIT_CURSOR},
                            },
                        ],
                        "responses": {
                            "200": _ok("AuditPage"),
                            "400": _error(
                                "`limit must be an integer between 1 and 200`, `invalid "
                                "cursor`, `limit and cursor may each be given once`"
                            ),
                        },
                    },
                    "keys",
                )
            },
            "/v1/tokens": {
                "post": _key_auth_only(
                    {
                        "operationId": "exchangeToken",
                        "summary": "Exchange the API key for a short-lived JWT (no body needed)",
                        "responses": {
                            "200": {
                                **_ok("Token"),
                                "headers": {
                                    "Cache-Control": {"schema": {"const": "no-store"}},
                                },
                            },
                            "413": _error("`request body too large`"),
                        },
                    },
                    "channels",
                )
            },
            "/v1/channels": {
                "get": _key_auth_only(
                    {
                        "operationId": "listChannels",
                        "summary": "The account's channels (those in which one of its agents is "
                        "a bound member, and that match the key's channel patterns), each with "
                        "its roster, epoch, last activity and retention policy, by creation",
                        "parameters": [
                            {
                                "name": "limit",
                                "in": "query",
                                "required": False,
                                "description": "Channels read for this page (a key limited to "
                                "channel patterns may get fewer: follow `next_cursor`)",
                                "schema": {
                                    "type": "integer",
                                    "minimum": 1,
                                    "maximum": MAX_CHANNELS_LIMIT,
                                    "default": DEFAULT_CHANNELS_LIMIT,
                                },
                            },
                            {
                                "name": "cursor",
                                "in": "query",
                                "required": False,
                                "description": "`next_cursor` of the previous page (opaque)",
                                "schema": {"type": "string", "pattern": CHANNELS_CURSOR},
                            },
                        ],
                        "responses": {
                            "200": _ok("ChannelPage"),
                            "400": _error(
                                f"`limit must be an integer between 1 and {MAX_CHANNELS_LIMIT}`, "
                                "`invalid cursor`, `limit and cursor may each be given once`"
                            ),
                            "503": _RELAY_UNAVAILABLE,
                        },
                    },
                    "channels",
                )
            },
            "/v1/channels/rate": {
                "get": _key_auth_only(
                    {
                        "operationId": "messageRate",
                        "summary": "How many application messages the account's agents sent "
                        f"per minute over the last {RATE_MINUTES} minutes (in the channels "
                        "matching the key's patterns)",
                        "responses": {"200": _ok("MessageRate"), "503": _RELAY_UNAVAILABLE},
                    },
                    "channels",
                )
            },
            **{
                route: _console_file(route, name, content_type)
                for route, (name, content_type) in ASSETS.items()
            },
            "/.well-known/jwks.json": {
                "get": {
                    "operationId": "jwks",
                    "summary": "The public keys that verify the JWTs (RFC 7517 JWK Set)",
                    "responses": {"200": _ok("JWKSet")},
                }
            },
            "/v1/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "responses": {"200": {"description": "OpenAPI 3.1 document"}},
                }
            },
        },
        "components": {
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`Authorization: Bearer sk_live_...`",
                },
                "jwt": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "JWT",
                    "description": "A JWT from POST /v1/tokens (EdDSA, `aud` `static-relay`)",
                },
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["error"],
                    "properties": {"error": {"type": "string"}},
                },
                "NewAccount": {
                    "type": "object",
                    # Unknown fields are ignored (plan_tier cannot be chosen by the client).
                    "additionalProperties": True,
                    "required": ["email"],
                    "properties": {
                        "email": {
                            "type": "string",
                            "minLength": 3,
                            "maxLength": MAX_EMAIL_CHARS,
                            "pattern": EMAIL_PATTERN,
                            "description": "One `@` with text on both sides, no white space "
                            "or control characters; surrounding white space is dropped; "
                            "unique case-insensitively",
                        },
                        "name": _NAME,
                    },
                },
                "Account": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "email", "name", "plan_tier"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "email": {"type": "string"},
                        "name": {"type": ["string", "null"]},
                        "plan_tier": {"type": "string", "examples": ["free"]},
                    },
                },
                "CreatedAccount": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["account", "api_key"],
                    "properties": {
                        "account": {"$ref": "#/components/schemas/Account"},
                        "api_key": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{43}$"},
                    },
                },
                "NewKey": {
                    "type": "object",
                    # Unknown fields are ignored (plan_tier cannot be chosen by the client).
                    "additionalProperties": True,
                    "properties": {
                        "name": {**_NAME, "default": "default"},
                        "scopes": {
                            "type": ["array", "null"],
                            "items": {"enum": ["keys", "channels"]},
                            "minItems": 1,
                            "uniqueItems": True,
                            "description": "null or absent: both",
                        },
                        "channels": {
                            "type": ["array", "null"],
                            "items": {"type": "string", "pattern": CHANNEL_PATTERN},
                            "minItems": 1,
                            "maxItems": MAX_CHANNEL_PATTERNS,
                            "uniqueItems": True,
                            "description": "`org/namespace/service` patterns, each component "
                            "a channel name's (1-63 letters, digits, `_`, `.`, `-`, starting "
                            "with a letter or digit) or exactly `*` (any one component); null "
                            "or absent: every channel",
                        },
                        "expires_in": {
                            "type": ["integer", "null"],
                            "minimum": 1,
                            "maximum": MAX_KEY_LIFETIME_SECONDS,
                            "description": "Seconds the key lives; null or absent: forever "
                            "(required under the server's `--max-key-lifetime`)",
                        },
                    },
                },
                "RollKey": {
                    "type": "object",
                    "additionalProperties": True,
                    "properties": {
                        "grace_seconds": {
                            "type": ["integer", "null"],
                            "minimum": 0,
                            "maximum": MAX_GRACE_SECONDS,
                            "default": DEFAULT_GRACE_SECONDS,
                            "description": "Seconds the old key keeps working",
                        }
                    },
                },
                "CreatedKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": [
                        "id",
                        "key_prefix",
                        "name",
                        "key",
                        "scopes",
                        "channels",
                        "expires_at",
                    ],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "key_prefix": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{8}$"},
                        "name": {"type": "string"},
                        "key": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{43}$"},
                        **_KEY_RULES,
                    },
                },
                "Key": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": [
                        "id",
                        "key_prefix",
                        "name",
                        "last_used_at",
                        "created_at",
                        "scopes",
                        "channels",
                        "expires_at",
                    ],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "key_prefix": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{8}$"},
                        "name": {"type": "string"},
                        "last_used_at": _TIMESTAMP_OR_NULL,
                        "created_at": {"type": "string", "format": "date-time"},
                        **_KEY_RULES,
                    },
                },
                "AuditEvent": {
                    "type": "object",
                    # Each type has fields of its own (target_key_id, new_key_id, name, reason,
                    # channel, identity, ...).
                    "additionalProperties": True,
                    "required": ["id", "at", "type", "key_id"],
                    "properties": {
                        "id": {"type": "string", "description": "`k...` or `r...`; unique"},
                        "at": {"type": "string", "format": "date-time"},
                        "type": {
                            "type": "string",
                            "examples": [
                                "key.created",
                                "key.revoked",
                                "key.rolled",
                                "key.expired",
                                "channel.created",
                                "org.claimed",
                                "member.added",
                                "member.removed",
                                "retention.changed",
                            ],
                        },
                        "key_id": {
                            "type": ["string", "null"],
                            "description": "The key that acted; null for the server's own",
                        },
                    },
                },
                "AuditPage": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["events", "next_cursor"],
                    "properties": {
                        "events": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/AuditEvent"},
                        },
                        "next_cursor": {"type": ["string", "null"]},
                    },
                },
                "Member": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["leaf_index", "identity", "identity_hex", "account", "bound"],
                    "properties": {
                        "leaf_index": {"type": "integer", "minimum": 0},
                        "identity": {
                            "type": "string",
                            "description": "The agent's identity as text (bytes that are not "
                            "UTF-8 become U+FFFD)",
                        },
                        "identity_hex": {"type": "string", "pattern": "^([0-9a-f]{2})*$"},
                        "account": {
                            "type": ["string", "null"],
                            "description": "The account its leaf is bound to; null: unbound",
                        },
                        "bound": {"type": "boolean"},
                    },
                },
                "Channel": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": [
                        "name",
                        "epoch",
                        "messages",
                        "last_activity_at",
                        "retention",
                        "member_count",
                        "members",
                    ],
                    "properties": {
                        "name": {"type": "string"},
                        "epoch": {"type": "integer", "minimum": 0},
                        "messages": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Entries logged so far (messages and handshakes)",
                        },
                        "last_activity_at": {
                            **_TIMESTAMP_OR_NULL,
                            "description": "When its newest entry kept was logged; null: none",
                        },
                        "retention": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["max_age_seconds", "max_entries", "max_bytes"],
                            "description": "As the channel sets it; null: the server's default",
                            "properties": {
                                "max_age_seconds": {"type": ["integer", "null"], "minimum": 0},
                                "max_entries": {"type": ["integer", "null"], "minimum": 0},
                                "max_bytes": {"type": ["integer", "null"], "minimum": 0},
                            },
                        },
                        "member_count": {"type": "integer", "minimum": 0},
                        "members": {
                            "type": "array",
                            "maxItems": 100,
                            "description": "The first 100 members by leaf index",
                            "items": {"$ref": "#/components/schemas/Member"},
                        },
                    },
                },
                "ChannelPage": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["channels", "next_cursor"],
                    "properties": {
                        "channels": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Channel"},
                        },
                        "next_cursor": {"type": ["string", "null"]},
                    },
                },
                "MessageRate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["start", "minute_seconds", "per_minute", "total"],
                    "properties": {
                        "start": {
                            "type": "string",
                            "format": "date-time",
                            "description": "The start of the first minute counted",
                        },
                        "minute_seconds": {"const": 60},
                        "per_minute": {
                            "type": "array",
                            "minItems": RATE_MINUTES,
                            "maxItems": RATE_MINUTES,
                            "items": {"type": "integer", "minimum": 0},
                            "description": "Oldest first; the last is the current minute",
                        },
                        "total": {"type": "integer", "minimum": 0},
                    },
                },
                "KeyList": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["keys"],
                    "properties": {
                        "keys": {"type": "array", "items": {"$ref": "#/components/schemas/Key"}}
                    },
                },
                "Token": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["access_token", "token_type", "expires_in"],
                    "properties": {
                        "access_token": {"type": "string", "minLength": 1},
                        "token_type": {"const": "Bearer"},
                        "expires_in": {"type": "integer", "minimum": 1, "description": "seconds"},
                    },
                },
                "JWKSet": {
                    "type": "object",
                    "required": ["keys"],
                    "properties": {"keys": {"type": "array", "items": {"type": "object"}}},
                },
            },
        },
    }
