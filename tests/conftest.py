"""Shared fixtures: the store backends, a throwaway PostgreSQL cluster, real server processes;
and the watchdog that ends a hung run (tests/support/watchdog.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import watchdog
from tests.support.postgres import PostgresCluster, find_postgres_bin
from tests.support.server import ServerProcess

BACKENDS = ["sqlite", "postgresql"]


def pytest_configure(config: pytest.Config) -> None:
    watchdog.install(config)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    bindir = find_postgres_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed (scripts/ensure-postgres.sh installs it)")
        pytest.skip("PostgreSQL is not installed (scripts/ensure-postgres.sh installs it)")
    cluster = PostgresCluster(bindir)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


@pytest.fixture
def database_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A fresh, empty database of the parametrised backend."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'db' / 'static.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    return cluster.create_database()


@pytest.fixture
def start_server(tmp_path: Path, database_url: str) -> Iterator[Callable[..., ServerProcess]]:
    """Start ``static serve`` processes on the test's database; all stop (gracefully) at the end."""
    started: list[ServerProcess] = []

    def start(*extra_args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(
            tmp_path / f"server{len(started)}", database_url, extra_args, env
        ).start()
        started.append(server)
        return server

    yield start
    errors = []
    for server in started:
        code = server.stop()
        if code != 0:
            errors.append(f"server exited with {code}:\n{server.stderr()}")
    assert not errors, "\n".join(errors)


@pytest.fixture
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """One running server on a fresh database of each backend."""
    return start_server()
