"""A built wheel, installed as a user would (not editable, outside the source tree): the SDK
alone installs without the server's dependencies, and ``pip install '<wheel>[server]'`` gives a
``static serve`` that serves, on both stores (one relay, in Rust, in the extension), with an SDK
round trip through it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]

# Above the global per-test timeout (pyproject.toml): the module's first test also builds the
# wheel, a release build of the Rust extension that may start cold (over 5 minutes on 2 shared
# cores); each of the fixture's subprocesses is bounded by _run's own timeout.
pytestmark = pytest.mark.timeout(2400)

ROUND_TRIP = textwrap.dedent(
    """
    import sys, tempfile
    from static_sdk import StaticClient

    relay = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        alice = StaticClient(relay, tmp + "/a", b"alice")
        bob = StaticClient(relay, tmp + "/b", b"bob")
        channel = alice.create_channel("acme/wheel/test")
        bobs = bob.join_channel("acme/wheel/test", channel.add_member(bob.generate_key_package()))
        channel.send(b"from a wheel")
        print(bobs.receive(20).decode())
        alice.close()
        bob.close()
    """
)

NO_GRPC_STACK = textwrap.dedent(
    """
    import importlib.util

    for name in ("purerpc", "grpc", "google.protobuf"):
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # its parent package is missing too
            found = None
        assert found is None, name
    """
)


def _run(*args: str | Path, cwd: Path, timeout: float = 1200) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Python of a fresh virtualenv with the built wheel and its server extra installed."""
    work = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", work, ROOT, cwd=work)
    [wheel] = work.glob("static-*.whl")
    venv.create(work / "venv", with_pip=True)
    python = work / "venv" / "bin" / "python"
    pip = (python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    # The SDK alone: no server dependency comes with it, and importing it imports none.
    _run(*pip, wheel, cwd=work)
    _run(
        python,
        "-c",
        "import static_sdk, sys, importlib.util as u; "
        "assert u.find_spec('quart_trio') is None and u.find_spec('hypercorn') is None; "
        "assert not any(m.startswith(('quart', 'hypercorn', 'static.api')) for m in sys.modules)",
        cwd=work,
    )
    _run(*pip, f"{wheel}[server]", cwd=work)
    # The relay is the extension's: the server brings no gRPC or protobuf package of its own.
    _run(python, "-c", NO_GRPC_STACK, cwd=work)
    yield python


def test_the_installed_wheel_serves(wheel_python: Path, database_url: str, tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "server",
        database_url,
        ["--allow-anonymous"],
        python=str(wheel_python),
        cwd=tmp_path,
    ).start()
    try:
        with urllib.request.urlopen(f"{server.http_url}/healthz", timeout=10) as response:
            assert response.status == 200
        out = _run(wheel_python, "-c", ROUND_TRIP, server.relay_url, cwd=tmp_path, timeout=60)
        assert out == "from a wheel\n"
    finally:
        assert server.stop() == 0, server.stderr()
    # What ran was the wheel, not this source tree.
    where = _run(wheel_python, "-c", "import static; print(static.__file__)", cwd=tmp_path)
    assert "site-packages" in where and not where.startswith(str(ROOT))
