"""A client's first contact with the relay (its reachability probe) is not a refusal: nothing in
the relay's access log at INFO, nothing in its refusal metric. It was a FetchWelcome with an
empty channel name, refused with INVALID_ARGUMENT on every client start, which an operator's
alert on refusals would count."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.sdk.conftest import Clients, channel_name
from tests.support.api import Api
from tests.support.server import ServerProcess


def _refusals(server: ServerProcess) -> float:
    """``static_relay_refusals_total``, all codes."""
    response = httpx.get(f"{server.http_url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "static_relay_refusals_total"
    )


def _relay_access(server: ServerProcess) -> list[dict[str, Any]]:
    """The relay's access log records (JSON lines) so far."""
    records = [json.loads(line) for line in server.stderr().splitlines() if line.strip()]
    return [r for r in records if r["logger"] == "static.relay.access"]


def test_client_start_is_not_a_refusal(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    server = start_server("--log-format", "json", "--log-level", "debug")
    api = Api(server.http_url)
    try:
        account = api.signup()
    finally:
        api.close()
    before = _refusals(server)
    client = clients(server, b"alice", api_key=account.key, api_url=server.http_url)
    # The first call that needs the relay makes the first contact.
    client.create_channel(channel_name())
    assert _refusals(server) == before
    client.close()
    assert server.stop() == 0  # every log line written
    access = _relay_access(server)
    assert [r for r in access if r["level"] != "debug"] == []
    # The probe was made, and answered: a health check.
    assert any(r["message"].startswith("Health/Check OK ") for r in access), access
