"""Fixtures of the HTTP API tests: one real server per backend and module, and a client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import BACKENDS
from tests.support.api import Api
from tests.support.postgres import PostgresCluster
from tests.support.server import ServerProcess

#: Tests on the shared server must not trip the limits (test_limits.py covers them).
NO_LIMITS = ("--signup-rate", "off", "--key-rate", "off", "--auth-failure-rate", "off")


@pytest.fixture(scope="module", params=BACKENDS)
def shared_database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A database for the module's shared server (tests on it use accounts of their own)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'static.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    return cluster.create_database()


@pytest.fixture(scope="module")
def shared_server(
    shared_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tmp_path_factory.mktemp("server"), shared_database_url, NO_LIMITS
    ).start()
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.stderr()}"


@pytest.fixture
def api(shared_server: ServerProcess) -> Iterator[Api]:
    client = Api(shared_server.http_url)
    yield client
    client.close()
