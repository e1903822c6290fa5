"""What the console's tests and screenshots look at: a real server with two accounts whose SDK
agents share a channel, and Debian's chromium launched through Playwright (never a download)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Browser, Page, sync_playwright

from static_sdk import StaticClient
from tests.support.api import Api, SignedUp
from tests.support.server import ServerProcess

__all__ = ["CHROMIUM", "XSS_NAME", "Scene", "chromium", "make_scene", "sign_in"]

#: Debian's chromium (scripts/ensure-chromium.sh installs it).
CHROMIUM = "/usr/bin/chromium"
#: A name that would run script if it were ever parsed as HTML: each handler sets a global.
XSS_NAME = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
#: Any one wait of the page (ms).
WAIT_MS = 15_000
#: Messages Alice's agent sends.
SENT = 3


@dataclass
class Scene:
    api: Api
    alice: SignedUp
    bob: SignedUp
    channel: str
    clients: list[StaticClient] = field(default_factory=list)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.api.close()


def make_scene(server: ServerProcess, agents_dir: Path, alice_name: str = XSS_NAME) -> Scene:
    """Alice (her account named ``alice_name``) and Bob; Alice's agent creates a channel, adds
    Bob's agent, and sends :data:`SENT` messages, which Bob's agent receives."""
    api = Api(server.http_url)
    alice = api.signup(name=alice_name)
    bob = api.signup(name="Bob")
    channel = f"acme{uuid.uuid4().hex[:6]}/support/triage"
    scene = Scene(api, alice, bob, channel)
    try:
        agents = []
        for identity, account in ((b"triage-bot", alice), (b"billing-agent", bob)):
            client = StaticClient(
                server.relay_url,
                str(agents_dir / identity.decode()),
                identity,
                account.key,
                server.http_url,
            )
            scene.clients.append(client)
            agents.append(client)
        mine = agents[0].create_channel(channel)
        theirs = agents[1].join_channel(channel, mine.add_member(agents[1].generate_key_package()))
        for i in range(SENT):
            mine.send(b"ticket %d" % i)
        for i in range(SENT):
            assert theirs.receive(20.0) == b"ticket %d" % i
    except BaseException:
        scene.close()
        raise
    return scene


@contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Debian chromium; ``--no-sandbox`` as root (a container has no user namespace
    for the sandbox)."""
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    # Playwright's sync API runs an asyncio loop of the process's policy. Once the PostgreSQL
    # store is imported (triopg), that policy is trio-asyncio's, whose loop cannot serve it
    # ("You can't nest calls to run_until_complete()"): the browser never started, and the
    # broken loop then failed later trio and asyncio tests and swallowed a Ctrl-C (a CI run
    # hung). asyncio's own policy while the browser lives, and the other one back after.
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    try:
        with _browser(args) as browser:
            yield browser
    finally:
        asyncio.set_event_loop_policy(policy)


@contextmanager
def _browser(args: list[str]) -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=args, timeout=WAIT_MS * 2
        )
        try:
            yield browser
        finally:
            browser.close()


def sign_in(page: Page, key: str) -> None:
    """Open the console and sign in with ``key`` (its success is the test's to check)."""
    page.goto("/console")
    page.fill("#api-key", key)
    page.click("#sign-in-form button[type=submit]")
