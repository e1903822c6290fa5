"""The OpenAPI 3.1 document served at ``GET /v1/openapi.json``.

Written by hand next to the routes; a test checks that the paths and methods here are exactly the
ones the app serves.
"""

from __future__ import annotations

from typing import Any

import static
from static.api._validation import EMAIL_PATTERN, MAX_EMAIL_CHARS, MAX_NAME_CHARS, NAME_PATTERN

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
    "`invalid or revoked api key`, `invalid or expired token` (JWT) or `api key required` "
    "(a JWT on an endpoint that takes an API key only)"
)
_ACCOUNT_GONE = _error("`Not found`: the account behind the credential does not exist")
_RATE_LIMITED = {
    **_error(
        "`too many requests`: the rate limit of the route, or (on routes that authenticate) "
        "too many failed authentications from the client's address; wait the seconds of the "
        "`Retry-After` header"
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


def _key_auth_only(operation: dict[str, Any]) -> dict[str, Any]:
    responses = operation.setdefault("responses", {})
    responses.setdefault("401", _UNAUTHORIZED)
    responses.setdefault("404", _ACCOUNT_GONE)
    responses.setdefault("429", _RATE_LIMITED)
    responses.setdefault("503", _UNAVAILABLE)
    return {**operation, "security": [{"apiKey": []}]}


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
                            "description": "Prometheus text format 0.0.4",
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
                            "409": _error("`too many active keys`: the account has 100 already"),
                        },
                    }
                ),
                "get": _key_auth_only(
                    {
                        "operationId": "listKeys",
                        "summary": "The account's active keys, newest first (never the secret)",
                        "responses": {"200": _ok("KeyList")},
                    }
                ),
            },
            "/v1/keys/{id}": {
                "delete": _key_auth_only(
                    {
                        "operationId": "revokeKey",
                        "summary": "Revoke a key of the caller's account (soft delete)",
                        "parameters": [
                            {
                                "name": "id",
                                "in": "path",
                                "required": True,
                                "schema": {"type": "string", "format": "uuid"},
                            }
                        ],
                        "responses": {
                            "204": {"description": "Revoked; the key and its JWTs stop working"},
                            "404": _error(
                                "`Not found`: no such key, another account's key, a key "
                                "revoked already, or an id that is not a UUID"
                            ),
                        },
                    }
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
                    }
                )
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
                    "properties": {"name": {**_NAME, "default": "default"}},
                },
                "CreatedKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "key_prefix", "name", "key"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "key_prefix": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{8}$"},
                        "name": {"type": "string"},
                        "key": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{43}$"},
                    },
                },
                "Key": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "key_prefix", "name", "last_used_at", "created_at"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "key_prefix": {"type": "string", "pattern": "^sk_live_[0-9A-Za-z]{8}$"},
                        "name": {"type": "string"},
                        "last_used_at": {"type": ["string", "null"], "format": "date-time"},
                        "created_at": {"type": "string", "format": "date-time"},
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
