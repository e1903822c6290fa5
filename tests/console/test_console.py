"""The console in headless Debian chromium (Playwright, ``executable_path``): sign-in, the account,
keys (create shown once and copied, revoke confirmed, roll), channels with rosters made by real SDK
agents, the audit log, the rate chart; names stay text; the key stays in the tab's memory."""

from __future__ import annotations

from playwright.sync_api import BrowserContext, Page, expect

from tests.console.scene import SENT, XSS_NAME, Scene, sign_in
from tests.support.api import bearer
from tests.support.server import ServerProcess


def _signed_in(page: Page, key: str) -> None:
    sign_in(page, key)
    expect(page.locator("#app")).to_be_visible()


def _view(page: Page, name: str) -> None:
    page.click(f"nav button[data-view={name}]")
    expect(page.locator(f"#view-{name}")).to_be_visible()


def _not_pwned(page: Page) -> None:
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("main img, main script").count() == 0


def test_sign_in_shows_the_account_with_names_as_text(page: Page, scene: Scene) -> None:
    _signed_in(page, scene.alice.key)
    account = page.locator("#account")
    expect(account).to_contain_text(scene.alice.id)
    expect(account).to_contain_text(scene.alice.account["email"])
    # The name that would be markup is shown literally, and nothing of it ran.
    expect(account.locator("dd", has_text=XSS_NAME)).to_have_count(1)
    expect(account).to_contain_text(scene.alice.key[:16])
    _not_pwned(page)


def test_a_wrong_key_shows_an_error_and_no_data(page: Page, scene: Scene) -> None:
    sign_in(page, "sk_live_" + "x" * 43)
    expect(page.locator("#sign-in-error")).to_have_text("invalid or revoked api key")
    expect(page.locator("#app")).to_be_hidden()
    assert page.locator("#account").inner_text() == ""
    assert scene.alice.id not in page.content()


def test_a_new_key_is_shown_once_and_copied(page: Page, scene: Scene) -> None:
    _signed_in(page, scene.alice.key)
    _view(page, "keys")
    page.fill("#new-key-name", XSS_NAME)
    page.click("#create-key-form button[type=submit]")
    secret = page.locator("#secret-value")
    expect(page.locator("#secret")).to_be_visible()
    key = secret.input_value()
    assert key.startswith("sk_live_") and len(key) == 51
    assert scene.api.me(key).status_code == 200
    # The new key's row names it as text.
    expect(page.locator("#keys tbody td", has_text=XSS_NAME)).to_have_count(1)
    _not_pwned(page)
    page.click("#secret-copy")
    expect(page.locator("#secret-copied")).to_have_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()") == key
    # Gone once dismissed, and after a reload (which also signs out: memory only).
    page.click("#secret-done")
    expect(page.locator("#secret")).to_be_hidden()
    assert key not in page.content()
    page.reload()
    expect(page.locator("#sign-in")).to_be_visible()
    expect(page.locator("#app")).to_be_hidden()
    _signed_in(page, scene.alice.key)
    _view(page, "keys")
    expect(page.locator("#secret")).to_be_hidden()
    assert key not in page.content()


def test_revoke_asks_for_confirmation(page: Page, scene: Scene) -> None:
    doomed = scene.api.create_key(scene.alice.key, name="to revoke")
    _signed_in(page, scene.alice.key)
    _view(page, "keys")
    row = page.locator(f"#keys tr[data-key-id='{doomed['id']}']")
    row.get_by_role("button", name="Revoke").click()
    expect(row).to_contain_text("It stops working at once")
    # Asked, not done: cancel leaves it working.
    assert scene.api.me(doomed["key"]).status_code == 200
    row.get_by_role("button", name="Cancel").click()
    expect(row.get_by_role("button", name="Roll")).to_be_visible()
    assert scene.api.me(doomed["key"]).status_code == 200
    row.get_by_role("button", name="Revoke").click()
    row.get_by_role("button", name="Revoke").click()
    expect(page.locator(f"#keys tr[data-key-id='{doomed['id']}']")).to_have_count(0)
    assert scene.api.me(doomed["key"]).status_code == 401


def test_roll_shows_the_new_key_once(page: Page, scene: Scene) -> None:
    old = scene.api.create_key(scene.alice.key, name="to roll")
    _signed_in(page, scene.alice.key)
    _view(page, "keys")
    row = page.locator(f"#keys tr[data-key-id='{old['id']}']")
    row.get_by_role("button", name="Roll").click()
    expect(row).to_contain_text("The old key keeps working")
    row.get_by_role("button", name="Roll").click()
    expect(page.locator("#secret")).to_be_visible()
    expect(page.locator("#secret-title")).to_contain_text("Rolled key")
    new = page.locator("#secret-value").input_value()
    assert new.startswith("sk_live_") and new != old["key"]
    assert scene.api.me(new).status_code == 200
    expect(page.locator("#keys tbody")).to_contain_text(new[:16])


def test_last_used_is_shown(page: Page, scene: Scene) -> None:
    used = scene.api.create_key(scene.alice.key, name="used once")
    assert scene.api.me(used["key"]).status_code == 200
    _signed_in(page, scene.alice.key)
    _view(page, "keys")
    row = page.locator(f"#keys tr[data-key-id='{used['id']}']")
    # Created, last used (a time, not "never"), expires.
    cells = row.locator("td")
    expect(cells.nth(5)).not_to_have_text("never")
    expect(cells.nth(5)).to_contain_text("UTC")


def test_channels_show_their_rosters(page: Page, scene: Scene) -> None:
    _signed_in(page, scene.bob.key)
    _view(page, "channels")
    channel = page.locator(".channel", has=page.locator("h3", has_text=scene.channel))
    expect(channel).to_have_count(1)
    expect(channel.locator(".meta")).to_contain_text("epoch ")
    expect(channel.locator(".meta")).to_contain_text("retention: server default")
    expect(channel.locator(".meta")).to_contain_text("2 members")
    expect(channel.locator(".meta")).not_to_contain_text("last activity never")
    rows = channel.locator("tbody tr")
    expect(rows).to_have_count(2)
    expect(channel).to_contain_text("triage-bot")
    expect(channel).to_contain_text("billing-agent")
    expect(channel).to_contain_text(scene.alice.id)
    expect(channel).to_contain_text(scene.bob.id)
    expect(rows.filter(has_text="not bound")).to_have_count(0)


def test_the_audit_log_is_shown(page: Page, scene: Scene) -> None:
    _signed_in(page, scene.alice.key)
    _view(page, "audit")
    table = page.locator("#audit tbody")
    expect(table.locator("tr").first).to_be_visible()
    expect(table).to_contain_text("channel.created")
    expect(table).to_contain_text("key.created")
    _not_pwned(page)


def test_the_audit_log_pages_by_its_cursor(page: Page, scene: Scene) -> None:
    busy = scene.api.signup()
    for i in range(26):
        scene.api.create_key(busy.key, name=f"k{i}")
    # 27 key.created events (the first key's too): a page of 25, then the 2 older ones.
    _signed_in(page, busy.key)
    _view(page, "audit")
    rows = page.locator("#audit tbody tr")
    expect(rows).to_have_count(25)
    expect(rows.first).to_contain_text('"name":"k25"')
    page.click("#audit-more")
    expect(rows).to_have_count(27)
    expect(rows.last).to_contain_text('"name":"default"')
    expect(page.locator("#audit-more")).to_be_hidden()


def test_the_rate_chart_counts_the_messages(page: Page, scene: Scene) -> None:
    _signed_in(page, scene.alice.key)
    _view(page, "activity")
    bars = page.locator("#rate-chart svg rect")
    expect(bars).to_have_count(60)
    counts = bars.evaluate_all("bars => bars.map(b => Number(b.dataset.count))")
    assert sum(counts) == SENT
    expect(page.locator("#rate-total")).to_contain_text(f"{SENT} messages")


def test_a_revoked_session_key_signs_out(page: Page, scene: Scene) -> None:
    session = scene.api.create_key(scene.alice.key, name="session")
    _signed_in(page, session["key"])
    assert scene.api.revoke(scene.alice.key, session["id"]).status_code == 204
    page.click("nav button[data-view=keys]")
    expect(page.locator("#sign-in-error")).to_contain_text("invalid or revoked api key")
    expect(page.locator("#app")).to_be_hidden()
    assert page.locator("#keys tbody tr").count() == 0


def test_the_key_stays_in_memory_only(
    page: Page, context: BrowserContext, server: ServerProcess, scene: Scene
) -> None:
    urls: list[str] = []
    authorised: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    page.on(
        "request",
        lambda request: authorised.append(request.headers.get("authorization", "")),
    )
    _signed_in(page, scene.alice.key)
    for view in ("keys", "channels", "audit", "activity", "account"):
        _view(page, view)
    key = scene.alice.key
    assert key not in page.url
    assert all(key not in url for url in urls), urls
    # It travels only as the bearer credential.
    assert bearer(key)["Authorization"] in authorised
    assert context.cookies() == []
    assert page.evaluate("document.cookie") == ""
    assert page.evaluate("localStorage.length") == 0
    assert page.evaluate("sessionStorage.length") == 0
    assert page.input_value("#api-key") == ""
    assert key not in page.content()


def test_the_policy_holds_in_the_browser(page: Page, scene: Scene) -> None:
    # Every violation of the page's policy is recorded (the harness's own script, added
    # through the DevTools protocol, is not subject to the policy).
    page.add_init_script(
        """document.addEventListener("securitypolicyviolation", (event) => {
            window.__violations = (window.__violations || []).concat(event.violatedDirective);
        });"""
    )
    _signed_in(page, scene.alice.key)
    for view in ("keys", "channels", "audit", "activity"):
        _view(page, view)
    # The page itself breaks no rule of its policy (no inline script or style of its own).
    assert page.evaluate("window.__violations || []") == []
    # And the policy is enforced: an inline script and an inline style do not apply.
    page.evaluate(
        """() => {
            const script = document.createElement("script");
            script.textContent = "window.__inline = 1";
            document.body.append(script);
            const style = document.createElement("style");
            style.textContent = "body { display: none }";
            document.head.append(style);
        }"""
    )
    page.wait_for_function("(window.__violations || []).length >= 2")
    expect(page.locator("body")).to_be_visible()
    assert page.evaluate("typeof window.__inline") == "undefined"
    violations = page.evaluate("window.__violations || []")
    assert any(v.startswith("script-src") for v in violations), violations
    assert any(v.startswith("style-src") for v in violations), violations
