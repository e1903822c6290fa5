"""Restarts, revocation races and graceful shutdown, on real server processes."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
import pytest

from tests.api.conftest import NO_LIMITS
from tests.support.api import (
    Api,
    assert_error,
    bearer,
    db_execute,
    open_raw,
    read_response,
    unique_email,
)
from tests.support.postgres import PostgresCluster
from tests.support.server import ServerProcess


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_keys_tokens_and_signing_key_survive_a_restart(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    signed = api.signup(name="Persistent")
    second = api.create_key(signed.key, name="second")
    revoked = api.create_key(signed.key, name="revoked")
    assert api.revoke(signed.key, revoked["id"]).status_code == 204
    token = api.token(signed.key)
    jwks = api.http.get("/.well-known/jwks.json").json()
    before_use = datetime.now(UTC)
    # A use whose coalesced last_used_at write is still pending when the server stops.
    assert api.me(second["key"]).status_code == 200
    after_use = datetime.now(UTC)
    api.close()

    server.restart()
    api = Api(server.http_url)
    try:
        keys = {k["name"]: k for k in api.keys(signed.key)}
        assert set(keys) == {"default", "second"}
        last_used = keys["second"]["last_used_at"]
        assert last_used is not None, "the pending last_used_at was not flushed on shutdown"
        assert before_use.replace(microsecond=0) <= _time(last_used) <= after_use
        assert api.me(signed.key).json() == signed.account
        assert api.me(second["key"]).json() == signed.account
        assert api.me(token).json() == signed.account  # the signing key persisted
        assert api.http.get("/.well-known/jwks.json").json() == jwks
        assert_error(api.me(revoked["key"]), 401, "invalid or revoked api key")
        # The email stays taken.
        assert_error(
            api.http.post("/v1/accounts", json={"email": signed.account["email"]}),
            409,
            "email already registered",
        )
    finally:
        api.close()


def test_revocation_while_requests_are_in_flight(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    signed = api.signup()
    victim = api.create_key(signed.key, name="victim")
    token = api.token(victim["key"])
    stop = threading.Event()
    results: list[tuple[str, float, int]] = []  # (credential kind, start, status)
    lock = threading.Lock()

    def hammer(kind: str, method: str, path: str, credential: str) -> None:
        with httpx.Client(base_url=server.http_url, timeout=20) as client:
            while not stop.is_set():
                start = time.monotonic()
                status = client.request(method, path, headers=bearer(credential)).status_code
                with lock:
                    results.append((kind, start, status))

    workers = [
        ("key", "GET", "/v1/accounts/me", victim["key"]),
        ("key", "GET", "/v1/accounts/me", victim["key"]),
        ("jwt", "GET", "/v1/accounts/me", token),
        ("jwt", "GET", "/v1/accounts/me", token),
        ("exchange", "POST", "/v1/tokens", victim["key"]),
        ("list", "GET", "/v1/keys", victim["key"]),
    ]
    threads = [threading.Thread(target=hammer, args=w) for w in workers]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with lock:
                kinds = {kind for kind, _, status in results if status == 200}
            if kinds == {"key", "jwt", "exchange", "list"}:
                break
            time.sleep(0.05)
        response = api.revoke(signed.key, victim["id"])
        revoked = time.monotonic()
        assert response.status_code == 204
        # Until every worker has made two requests that started after the revocation.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with lock:
                late_kinds = [kind for kind, start, _ in results if start > revoked]
            if all(
                late_kinds.count(kind) >= 2 * [w[0] for w in workers].count(kind)
                for kind in {"key", "jwt", "exchange", "list"}
            ):
                break
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        api.close()

    assert {status for _, _, status in results} <= {200, 401}, results
    late = [(kind, status) for kind, start, status in results if start > revoked]
    assert late, "no request started after the revocation"
    assert all(status == 401 for _, status in late), late
    early_ok = {kind for kind, start, status in results if start < revoked and status == 200}
    assert early_ok == {"key", "jwt", "exchange", "list"}
    assert {kind for kind, _ in late} == {"key", "jwt", "exchange", "list"}


def test_concurrent_revocations_of_one_key(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    try:
        signed = api.signup()
        victim = api.create_key(signed.key)

        def revoke(_: int) -> int:
            with httpx.Client(base_url=server.http_url, timeout=20) as client:
                path = f"/v1/keys/{victim['id']}"
                return client.delete(path, headers=bearer(signed.key)).status_code

        with ThreadPoolExecutor(12) as pool:
            statuses = sorted(pool.map(revoke, range(12)))
        assert statuses == [204] + [404] * 11
    finally:
        api.close()


def test_sigterm_lets_an_in_flight_request_finish(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*NO_LIMITS)
    assert server.proc is not None
    body = json.dumps({"email": unique_email()}).encode()
    with open_raw(server.http_url) as sock:
        # A first request on the connection: the server has surely accepted it.
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock).status == 200
        sock.sendall(
            b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body[:5]
        )
        time.sleep(0.3)  # the request is in the app, waiting for the rest of its body
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None, "the server did not wait for the request"
        sock.sendall(body[5:])
        response = read_response(sock)
    assert response.status == 200
    assert json.loads(response.body)["account"]["plan_tier"] == "free"
    assert server.proc.wait(timeout=20) == 0


def test_sigterm_with_idle_keep_alive_connections_exits_promptly(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*NO_LIMITS)
    assert server.proc is not None
    clients = [httpx.Client(base_url=server.http_url) for _ in range(5)]
    try:
        for client in clients:
            assert client.get("/healthz").status_code == 200
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 5
    finally:
        for client in clients:
            client.close()


def test_a_storage_failure_is_a_json_503(
    backend: str, start_server: Callable[..., ServerProcess], request: pytest.FixtureRequest
) -> None:
    if backend != "postgresql":
        pytest.skip("needs a store that can vanish under a running server (PostgreSQL)")
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    try:
        signed = api.signup()
        assert api.me(signed.key).status_code == 200
        assert server.database_url is not None
        name = server.database_url.rsplit("/", 1)[1]
        cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
        db_execute(cluster.url(), f'DROP DATABASE "{name}" WITH (FORCE)')
        for response in [
            api.me(signed.key),
            api.http.post("/v1/accounts", json={"email": unique_email()}),
        ]:
            assert_error(response, 503, "service unavailable")
        # Live, not ready (docs/design.md "Observability").
        assert api.http.get("/healthz").status_code == 200
        assert_error(api.http.get("/readyz"), 503, "not ready: accounts store cannot write")
    finally:
        api.close()
    # And it still shuts down cleanly (the fixture asserts exit code 0).
