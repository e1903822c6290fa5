"""Observability of ``static serve`` (docs/design.md "Observability"): levelled logs as text or
JSON lines with an access log for both ports, refusals logged with ids and never a secret;
Prometheus metrics at ``/metrics`` (or on their own address); the gRPC health service;
``/healthz`` (live) and ``/readyz`` (the stores can write, the relay serves)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from static_sdk import StaticClient
from tests.support.api import Api, bearer
from tests.support.postgres import PostgresCluster, find_postgres_bin
from tests.support.server import ServerProcess, free_port

_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_SERVING, _NOT_SERVING = 1, 2


@pytest.fixture
def start_sqlite(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``static serve`` on SQLite (what these tests look at does not depend on the store)."""
    started: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        server = ServerProcess(tmp_path / f"server{len(started)}", None, extra_args).start()
        started.append(server)
        return server

    yield start
    for server in started:
        assert server.stop() == 0, server.stderr()


def _relay_target(server: ServerProcess) -> str:
    return server.relay_url.removeprefix("grpc://")


def _health(server: ServerProcess, service: str = "") -> int:
    """The gRPC health status of ``service`` (1 SERVING, 2 NOT_SERVING); raises RpcError."""
    name = service.encode()
    request = (b"\x0a" + bytes([len(name)]) + name) if name else b""
    with grpc.insecure_channel(_relay_target(server)) as channel:
        check = channel.unary_unary(
            _HEALTH_CHECK, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        response: bytes = check(request, timeout=10)
    # HealthCheckResponse { ServingStatus status = 1; }: b"" is UNKNOWN (0).
    return response[1] if response[:1] == b"\x08" else 0


def _refused_relay_call(server: ServerProcess, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(_relay_target(server)) as channel:
        call = channel.unary_unary(
            "/static.relay.v1.Relay/GetRetention",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", metadata=[("authorization", f"Bearer {token}")], timeout=10)
    code: grpc.StatusCode = refused.value.code()
    return code


def _json_lines(stderr: str) -> list[dict[str, Any]]:
    """Every line of ``stderr`` as JSON (each must parse)."""
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


def _samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The metrics at ``url`` parsed with prometheus_client's parser: (name, labels) -> value."""
    response = httpx.get(url)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for (sample, have), value in samples.items()
        if sample == name and set(labels.items()) <= set(have)
    )


def test_json_logs_record_refusals_with_ids_and_never_a_secret(
    start_sqlite: Callable[..., ServerProcess],
) -> None:
    server = start_sqlite("--log-format", "json", "--log-level", "info")
    api = Api(server.http_url)
    try:
        owner = api.signup()
        second = api.create_key(owner.key)
        assert api.revoke(owner.key, second["id"]).status_code == 204
        # A revoked key: 401, the key unknown by now (its public prefix is logged).
        assert api.http.get("/v1/keys", headers=bearer(second["key"])).status_code == 401
        # Another account's (here: nobody's) key: 404, logged with the caller's key id.
        missing = api.revoke(owner.key, str(uuid.uuid4()))
        assert missing.status_code == 404
        bad_token = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ4In0.c2VjcmV0LXNpZ25hdHVyZQ"
        assert _refused_relay_call(server, bad_token) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        api.close()
    assert server.stop() == 0
    stderr = server.stderr()
    for secret in (owner.key, second["key"], bad_token):
        assert secret not in stderr
    records = _json_lines(stderr)
    assert {"time", "level", "logger", "message"} <= set(records[0])
    access = [r for r in records if r["logger"] == "static.access"]
    key_id = api_key_id(access, owner.key)
    refused_404 = [r for r in access if r["http"]["status"] == 404]
    assert [r["http"]["key_id"] for r in refused_404] == [key_id]
    assert refused_404[0]["http"]["route"] == "/v1/keys/<key_id>"
    refused_401 = [r for r in access if r["http"]["status"] == 401]
    assert len(refused_401) == 1
    assert refused_401[0]["http"]["credential"] == f"key_prefix={second['key'][:16]}"
    relay = [r for r in records if r["logger"] == "static.relay.access"]
    assert [r["level"] for r in relay] == ["info"]
    assert relay[0]["message"].startswith("GetRetention UNAUTHENTICATED")
    # The gRPC message readable and quoted, not percent-encoded as on the wire.
    line = relay[0]["message"]
    assert ' message="' in line and line.endswith('"') and "%20" not in line, line


def api_key_id(access: list[dict[str, Any]], secret: str) -> str:
    """The key id the access log gives the signup's key (on its POST /v1/keys)."""
    created = [r for r in access if r["http"]["route"] == "/v1/keys" and "key_id" in r["http"]]
    assert created, access
    key_id: str = created[0]["http"]["key_id"]
    assert secret not in key_id
    return key_id


def test_log_level_gates_both_languages(start_sqlite: Callable[..., ServerProcess]) -> None:
    quiet = start_sqlite("--log-level", "warning")
    Api(quiet.http_url).signup()
    assert _health(quiet) == _SERVING
    verbose = start_sqlite("--log-level", "debug", "--log-format", "text")
    Api(verbose.http_url).signup()
    assert _health(verbose) == _SERVING
    assert quiet.stop() == 0 and verbose.stop() == 0
    assert "static.access" not in quiet.stderr()
    assert "static.relay.access" not in quiet.stderr()
    text = verbose.stderr()
    assert " INFO static.access: POST /v1/accounts 200 " in text
    # The relay's successful calls are logged at debug only (Rust records, Python's format).
    assert " DEBUG static.relay.access: Health/Check OK " in text


def test_bad_log_flags_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    for flags in (["--log-level", "loud"], ["--log-format", "xml"]):
        result = subprocess.run(
            [sys.executable, "-m", "static", "serve", "--data-dir", str(tmp_path), *flags],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2, result.stderr


def test_metrics_parse_and_move_with_requests_and_publishes(
    start_sqlite: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = start_sqlite()
    url = f"{server.http_url}/metrics"
    before = _samples(url)
    owner = Api(server.http_url).signup()
    client = StaticClient(
        server.relay_url,
        str(tmp_path / "alice"),
        b"alice",
        api_key=owner.key,
        api_url=server.http_url,
    )
    try:
        channel = client.create_channel("acme/observe/metrics")
        for i in range(3):
            channel.send(f"hello {i}".encode())
    finally:
        client.close()
    after = _samples(url)

    def moved(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert moved("static_http_requests_total", route="/v1/accounts", status="200") == 1
    assert moved("static_http_request_duration_seconds_count", route="/v1/accounts") == 1
    assert moved("static_token_checks_total", port="http", result="ok") >= 1
    assert moved("static_token_checks_total", port="relay", result="ok") >= 1
    assert moved("static_relay_publishes_total", kind="application") == 3
    assert moved("static_relay_calls_total", method="CreateChannel", code="OK") == 1
    assert moved("static_relay_publish_to_ack_seconds_count") >= 3
    assert moved("static_relay_store_commit_seconds_count") >= 1
    assert moved("static_accounts_store_commit_seconds_count") >= 1
    assert _value(after, "static_relay_channels_loaded") >= 1
    # Bounded labels: routes are templates, never a raw path or an id.
    routes = {dict(labels).get("route") for (name, labels) in after if "http" in name}
    assert not any(route and ("acme" in route or owner.id in route) for route in routes)


def test_metrics_on_their_own_address(start_sqlite: Callable[..., ServerProcess]) -> None:
    address = f"127.0.0.1:{free_port()}"
    server = start_sqlite("--metrics", address)
    assert httpx.get(f"{server.http_url}/metrics").status_code == 404
    samples = _samples(f"http://{address}/metrics")
    assert any(name == "static_relay_connections" for name, _ in samples)


def test_grpc_health_service(start_sqlite: Callable[..., ServerProcess]) -> None:
    server = start_sqlite()
    assert _health(server) == _SERVING
    assert _health(server, "static.relay.v1.Relay") == _SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        _health(server, "no.such.Service")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_healthz_and_readyz(server: ServerProcess) -> None:
    live = httpx.get(f"{server.http_url}/healthz")
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    ready = httpx.get(f"{server.http_url}/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_readyz_and_health_follow_a_store_that_cannot_write(tmp_path: Path) -> None:
    bindir = find_postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (scripts/ensure-postgres.sh installs it)")
    cluster = PostgresCluster(bindir)
    cluster.start()
    server = ServerProcess(
        tmp_path / "server", cluster.create_database(), ["--relay-health-interval", "0.2"]
    )
    try:
        server.start()
        readyz = f"{server.http_url}/readyz"
        assert httpx.get(readyz).status_code == 200
        cluster.down()

        def refused() -> bool:
            response = httpx.get(readyz, timeout=30)
            return response.status_code == 503

        _wait_for(refused, 30, "/readyz to answer 503")
        body = httpx.get(readyz, timeout=30).json()
        assert body["error"].startswith("not ready: accounts store cannot write")
        _wait_for(lambda: _health(server) == _NOT_SERVING, 30, "relay NOT_SERVING")
        cluster.up()
        _wait_for(lambda: httpx.get(readyz, timeout=30).status_code == 200, 60, "ready again")
        _wait_for(lambda: _health(server) == _SERVING, 60, "relay SERVING again")
    finally:
        try:
            assert server.stop() == 0, server.stderr()
        finally:
            cluster.stop()
    assert "store failure" in server.stderr()
