"""Fixtures of the console's tests: one real server (SQLite), one scene and one browser per
module; a fresh browser context (no cookies, no storage) per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page

from tests.api.conftest import NO_LIMITS
from tests.console.scene import CHROMIUM, WAIT_MS, Scene, chromium, make_scene
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("console-server")
    started = ServerProcess(data, f"sqlite:///{data / 'static.db'}", NO_LIMITS).start()
    yield started
    code = started.stop()
    assert code == 0, f"server exited with {code}:\n{started.stderr()}"


@pytest.fixture(scope="module")
def scene(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    made = make_scene(server, tmp_path_factory.mktemp("agents"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing (scripts/ensure-chromium.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with chromium() as launched:
        yield launched


@pytest.fixture
def context(browser: Browser, server: ServerProcess) -> Iterator[BrowserContext]:
    made = browser.new_context(base_url=server.http_url)
    made.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.http_url)
    made.set_default_timeout(WAIT_MS)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def page(context: BrowserContext) -> Page:
    return context.new_page()
