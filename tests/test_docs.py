"""The code blocks of README.md and docs/*.md run as scripts against a real server, so that the
docs cannot go stale.

A fenced block's kind is set by an HTML comment on the line right before its fence:

- ``python`` blocks run, unless marked; ``bash``/``sh``/``shell`` blocks must be marked.
- ``<!-- test -->``: run it (a shell block with ``bash -e -o pipefail``).
- ``<!-- test twice -->``: run it twice in the same directory (it must be idempotent).
- ``<!-- test certs -->`` and ``<!-- test tls -->`` (docs/tls.md): the first makes certificates
  in a directory; a TLS server is started with them (``server.pem``, ``server.key``); the
  others then run there in order against it, with ``https://localhost`` URLs.
- ``<!-- skip: REASON -->``: not run (a fragment, a server that runs for ever...); the reason
  is required.

Each file's blocks run in order in one fresh directory, with ``HOME`` and the XDG directories
inside it, the virtualenv's ``bin`` first on ``PATH``, and ``STATIC_API_URL`` /
``STATIC_RELAY_URL`` set to the test server's (python blocks also get ``STATIC_API_KEY``, a fresh
account's key). In shell blocks the documented default addresses (``127.0.0.1:8080``,
``localhost:50051``...) are replaced by the test server's. A failure names the block as
``FILE:LINE``.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
MARKERS = {"test", "test twice", "test certs", "test tls"}
#: Bound of one block's run (a CLI command is a Python process: ~0.5 s each on 2 busy cores).
BLOCK_TIMEOUT = 120.0
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_DEFAULT_PORTS = {"8080": "api", "50051": "relay"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str | None  # the comment's text, None when unmarked
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.marker is not None and self.marker.startswith("skip"):
            return self.marker.partition(":")[2].strip()
        return None


def extract(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, with the marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        indent, lang = fence[1], fence[2].lower()
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line
            for line in lines[index + 1 : end]
        ]
        previous = _MARKER.match(lines[index - 1]) if index > 0 else None
        blocks.append(
            Block(path, index + 1, lang, previous[1] if previous else None, "\n".join(body) + "\n")
        )
        index = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in extract(path)]


def _problem(block: Block) -> str | None:
    """Why ``block``'s marking is wrong, or None."""
    if block.marker is not None and block.marker.startswith("skip"):
        return None if block.skip_reason else "a skip marker needs a reason: <!-- skip: why -->"
    if block.marker is not None and block.marker not in MARKERS:
        return f"unknown marker <!-- {block.marker} --> (one of {sorted(MARKERS)} or skip: why)"
    if block.lang in SHELL and block.marker is None:
        return "a shell block needs <!-- test --> or <!-- skip: why --> on the line before it"
    if block.marker is not None and block.lang not in PYTHON | SHELL:
        return f"a {block.lang or 'plain'} block cannot be run"
    return None


def _runnable(kind: str) -> list[Block]:
    return [
        b
        for b in ALL_BLOCKS
        if _problem(b) is None
        and b.skip_reason is None
        and b.lang in PYTHON | SHELL
        and (b.marker in (None, "test", "test twice") if kind == "plain" else b.marker == kind)
    ]


def test_every_block_is_marked_well() -> None:
    problems = [f"{b.where}: {p}" for b in ALL_BLOCKS if (p := _problem(b))]
    assert not problems, "\n".join(problems)
    assert _runnable("plain"), "no block found to run: is the extraction broken?"


# -- running ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tmp_path_factory.mktemp("docs-server"), extra_args=["--signup-rate", "off"]
    ).start()
    yield server
    assert server.stop() == 0, server.stderr()


def _signup(api_url: str, ca_file: Path | None = None) -> str:
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    request = urllib.request.Request(
        f"{api_url}/v1/accounts",
        data=json.dumps({"email": f"docs-{os.urandom(6).hex()}@example.com"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        key: str = json.load(response)["api_key"]
    return key


def _environment(home: Path, api_url: str, relay_url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STATIC_") and not k.startswith("XDG_")
    }
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        STATIC_API_URL=api_url,
        STATIC_RELAY_URL=relay_url,
    )
    return env


def _with_server_ports(code: str, api_url: str, relay_url: str) -> str:
    """``code`` with the documented default ports replaced by the test server's."""
    ports = {"api": urlsplit(api_url).port, "relay": urlsplit(relay_url).port}

    def swap(match: re.Match[str]) -> str:
        return f"{match[1]}:{ports[_DEFAULT_PORTS[match[2]]]}"

    return re.sub(r"(127\.0\.0\.1|localhost):(8080|50051)\b", swap, code)


def block_failure(block: Block, cwd: Path, env: dict[str, str]) -> str | None:
    """Run ``block`` in ``cwd``: None when it succeeds, else what failed, naming the block
    (``FILE:LINE``), with its output."""
    if block.lang in PYTHON:
        script = cwd / f"block-{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        command = [sys.executable, str(script)]
    else:
        script = cwd / f"block-{block.line}.sh"
        code = _with_server_ports(block.code, env["STATIC_API_URL"], env["STATIC_RELAY_URL"])
        script.write_text(code, encoding="utf-8")
        command = ["bash", "-e", "-o", "pipefail", str(script)]
    try:
        result = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        return f"{block.where}: {block.lang} block did not end within {exc.timeout:g} s"
    if result.returncode == 0:
        return None
    return (
        f"{block.where}: {block.lang} block failed (exit {result.returncode})\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )


PLAIN_FILES = sorted({b.path for b in _runnable("plain")})


@pytest.mark.parametrize("path", PLAIN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_run(path: Path, docs_server: ServerProcess, tmp_path: Path) -> None:
    """A file's blocks run in order in one directory with one ``HOME``, as a reader following
    the page would run them (the tour's second block uses the contexts of its first); each
    runs whatever the others did, so that one report names every failing block."""
    env = _environment(tmp_path / "home", docs_server.http_url, docs_server.relay_url)
    failures = []
    for block in (b for b in _runnable("plain") if b.path == path):
        block_env = dict(env)
        if block.lang in PYTHON:
            block_env["STATIC_API_KEY"] = _signup(docs_server.http_url)
        for _ in range(2 if block.marker == "test twice" else 1):
            if failure := block_failure(block, tmp_path, block_env):
                failures.append(failure)
                break
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def test_tls_blocks_run(tmp_path: Path) -> None:
    """docs/tls.md: its recipe makes certificates that a TLS server and its clients accept."""
    certs = _runnable("test certs")
    clients = _runnable("test tls")
    assert certs and clients, "docs/tls.md lost its tested blocks"
    env = _environment(tmp_path / "home", "https://localhost:8080", "https://localhost:50051")
    for block in certs:
        if failure := block_failure(block, tmp_path, env):
            pytest.fail(failure, pytrace=False)
    server = ServerProcess(
        tmp_path / "server",
        extra_args=[
            "--signup-rate", "off",
            "--tls-cert", str(tmp_path / "server.pem"),
            "--tls-key", str(tmp_path / "server.key"),
        ],
    ).start()  # fmt: skip
    try:
        # The server prints 127.0.0.1; the certificate names localhost too, as clients dial it.
        api_url = server.http_url.replace("127.0.0.1", "localhost")
        relay_url = server.relay_url.replace("127.0.0.1", "localhost")
        assert api_url.startswith("https://") and relay_url.startswith("https://")
        env = _environment(tmp_path / "home", api_url, relay_url)
        env["STATIC_API_KEY"] = _signup(api_url, tmp_path / "ca.pem")
        # Each runs, whatever the others did, so that one report names every failing block.
        failures = [f for block in clients if (f := block_failure(block, tmp_path, env))]
    finally:
        assert server.stop() == 0, server.stderr()
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
