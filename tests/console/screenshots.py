"""The screenshots of docs/console.md: ``python -m tests.console.screenshots docs/console``
starts a throwaway server (SQLite), makes the tests' scene with real SDK agents, and saves one PNG
per view of the console, taken in headless Debian chromium."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from playwright.sync_api import Page, ViewportSize, expect

from tests.api.conftest import NO_LIMITS
from tests.console.scene import WAIT_MS, chromium, make_scene, sign_in
from tests.support.server import ServerProcess

#: Small files: a modest viewport, the page's top only.
VIEWPORT: ViewportSize = {"width": 960, "height": 600}


def _shoot(page: Page, view: str, out: Path) -> None:
    page.click(f"nav button[data-view={view}]")
    expect(page.locator(f"#view-{view}")).to_be_visible()
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(out / f"{view}.png"))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        server = ServerProcess(data / "server", f"sqlite:///{data / 'static.db'}", NO_LIMITS)
        server.start()
        try:
            scene = make_scene(server, data / "agents", alice_name="Acme Support")
            try:
                org = scene.channel.split("/")[0]
                scene.api.create_key(scene.alice.key, name="triage-bot", channels=[f"{org}/*/*"])
                with chromium() as browser:
                    context = browser.new_context(base_url=server.http_url, viewport=VIEWPORT)
                    context.set_default_timeout(WAIT_MS)
                    page = context.new_page()
                    page.goto("/console")
                    page.screenshot(path=str(out / "sign-in.png"))
                    sign_in(page, scene.alice.key)
                    expect(page.locator("#app")).to_be_visible()
                    _shoot(page, "account", out)
                    page.click("nav button[data-view=keys]")
                    page.fill("#new-key-name", "deploy agent")
                    page.click("#create-key-form button[type=submit]")
                    expect(page.locator("#secret")).to_be_visible()
                    _shoot(page, "keys", out)
                    page.click("#secret-done")
                    for view in ("channels", "audit", "activity"):
                        _shoot(page, view, out)
                    context.close()
            finally:
                scene.close()
        finally:
            server.stop()
    for png in sorted(out.glob("*.png")):
        print(f"{png}: {png.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/console"))
