"""The console's files over HTTP: their content types and security headers, no inline script or
style, and no other file reachable through them (no traversal)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from static.api._console import CONTENT_SECURITY_POLICY
from tests.support.api import raw_request
from tests.support.server import ServerProcess

FILES = {
    "/console": "text/html; charset=utf-8",
    "/console/console.js": "text/javascript; charset=utf-8",
    "/console/console.css": "text/css; charset=utf-8",
}


@pytest.mark.parametrize(("path", "content_type"), FILES.items())
def test_each_file_has_its_type_and_a_strict_policy(
    server: ServerProcess, path: str, content_type: str
) -> None:
    response = httpx.get(server.http_url + path, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    policy = response.headers["content-security-policy"]
    assert policy == CONTENT_SECURITY_POLICY
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'"
    assert directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"
    assert directives["base-uri"] == "'none'"
    assert directives["form-action"] == "'none'"
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert "set-cookie" not in response.headers


def test_the_page_holds_no_inline_script_or_style(server: ServerProcess) -> None:
    html = httpx.get(server.http_url + "/console", timeout=10).text
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S | re.I)
    assert scripts, "the page loads its script"
    for attributes, body in scripts:
        assert 'src="/console/console.js"' in attributes
        assert body.strip() == ""
    assert re.search(r"<style\b", html, re.I) is None
    assert re.search(r"\sstyle\s*=", html, re.I) is None
    assert re.search(r"\son[a-z]+\s*=", html, re.I) is None
    script = httpx.get(server.http_url + "/console/console.js", timeout=10).text
    # Server data is text only: nothing parses HTML from a string.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
    for store in ("localStorage", "sessionStorage", "document.cookie", "indexedDB"):
        assert store not in script, store


@pytest.mark.parametrize(
    "target",
    [
        "/console/../static.db",
        "/console/%2e%2e/static.db",
        "/console/..%2fstatic.db",
        "/console/%2e%2e%2f_app.py",
        "/console/_console.py",
        "/console/index.html",
        "/console/console.js/",
        "/console//console.js",
        "/console/.%2fconsole.js",
        "/console/console.js%00.py",
        "/console/console",
        "/console/",
        "/console/..%5c_app.py",
    ],
)
def test_no_other_path_is_served(server: ServerProcess, target: str) -> None:
    # Raw bytes: no client normalises the path before the server sees it.
    response = raw_request(
        server.http_url,
        f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(),
    )
    assert response.status == 404, (target, response.status, response.body[:200])
    assert json.loads(response.body) == {"error": "Not found"}
