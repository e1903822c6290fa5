"""Helpers for the HTTP API tests: a small client, raw HTTP, and operator access to the store."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.support.postgres import find_postgres_bin

__all__ = [
    "Api",
    "RawResponse",
    "SignedUp",
    "assert_error",
    "bearer",
    "db_execute",
    "raw_request",
    "unique_email",
]


def unique_email(domain: str = "example.com") -> str:
    return f"user-{uuid.uuid4().hex[:12]}@{domain}"


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def assert_error(response: httpx.Response, status: int, text: str | None = None) -> None:
    """A JSON error of ``status`` (with exactly ``text`` when given)."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"], str) and body["error"]
    if text is not None:
        assert body["error"] == text


@dataclass(frozen=True)
class SignedUp:
    account: dict[str, Any]
    key: str

    @property
    def id(self) -> str:
        return str(self.account["id"])


class Api:
    """httpx over one server, plus the calls most tests make."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=20)

    def close(self) -> None:
        self.http.close()

    def signup(self, email: str | None = None, **extra: Any) -> SignedUp:
        response = self.http.post("/v1/accounts", json={"email": email or unique_email(), **extra})
        assert response.status_code == 200, response.text
        body = response.json()
        return SignedUp(body["account"], body["api_key"])

    def me(self, credential: str) -> httpx.Response:
        return self.http.get("/v1/accounts/me", headers=bearer(credential))

    def token(self, key: str) -> str:
        response = self.http.post("/v1/tokens", headers=bearer(key))
        assert response.status_code == 200, response.text
        token: str = response.json()["access_token"]
        return token

    def create_key(self, key: str, **body: Any) -> dict[str, Any]:
        response = self.http.post("/v1/keys", headers=bearer(key), json=body)
        assert response.status_code == 200, response.text
        created: dict[str, Any] = response.json()
        return created

    def keys(self, key: str) -> list[dict[str, Any]]:
        response = self.http.get("/v1/keys", headers=bearer(key))
        assert response.status_code == 200, response.text
        keys: list[dict[str, Any]] = response.json()["keys"]
        return keys

    def revoke(self, key: str, key_id: str) -> httpx.Response:
        return self.http.delete(f"/v1/keys/{key_id}", headers=bearer(key))


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def _read_response(sock: socket.socket) -> RawResponse:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawResponse(status, headers, body)


def raw_request(base_url: str, request: bytes, timeout: float = 10.0) -> RawResponse:
    """Send ``request`` bytes as they are (no client-side validation) and read one response."""
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        return _read_response(sock)


def open_raw(base_url: str, timeout: float = 10.0) -> socket.socket:
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


read_response = _read_response


def db_execute(database_url: str, sql: str, *, bypass_foreign_keys: bool = False) -> str:
    """Run ``sql`` as the operator would (outside the server); return its one cell, or ''."""
    if database_url.startswith("sqlite:///"):
        conn = sqlite3.connect(database_url[len("sqlite:///") :], isolation_level=None)
        try:
            # sqlite3 leaves foreign keys off unless asked, so the bypass is the default here.
            row = conn.execute(sql).fetchone()
            return "" if row is None else str(row[0])
        finally:
            conn.close()
    bindir = find_postgres_bin()
    assert bindir is not None
    prefix = "SET session_replication_role = replica; " if bypass_foreign_keys else ""
    result = subprocess.run(
        [str(bindir / "psql"), database_url, "-v", "ON_ERROR_STOP=1", "-At", "-c", prefix + sql],
        check=True,
        capture_output=True,
        text=True,
    )
    output = result.stdout
    if bypass_foreign_keys:
        output = output.removeprefix("SET\n")
    # One row of one column (which may span lines, like a PEM); a DELETE prints its tag.
    return output.strip()
