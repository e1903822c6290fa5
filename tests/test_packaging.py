"""The wheel ``scripts/wheel.sh`` builds (one abi3 manylinux wheel), installed as a user would (not
editable, outside the source tree, with no Rust toolchain on the PATH): the SDK alone installs
without the server's dependencies, and ``pip install '<wheel>[server]'`` gives a ``static serve``
that serves, on both stores (one relay, in Rust, in the extension), with an SDK round trip through
it. The wheel carries every file of the packages (stubs, ``py.typed``, non-Python data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import urllib.request
import venv
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

import static
from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]

# Above the global per-test timeout (pyproject.toml): the module's first test also builds the
# wheel, a release build of the Rust extension that may start cold (over 5 minutes on 2 shared
# cores; seconds when scripts/setup.sh's build is warm); each of the fixture's subprocesses is
# bounded by _run's own timeout.
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


def _run(
    *args: str | Path, cwd: Path, timeout: float = 1200, env: dict[str, str] | None = None
) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _without_rust(bin_dir: Path) -> dict[str, str]:
    """The environment a user without a Rust toolchain has: a PATH of ``bin_dir`` and the
    system's directories holding no ``cargo`` nor ``rustc`` (~/.cargo/bin is left out)."""
    dirs = [str(bin_dir)] + [
        d
        for d in ("/usr/local/bin", "/usr/bin", "/bin")
        if Path(d).is_dir() and not any(Path(d, tool).exists() for tool in ("cargo", "rustc"))
    ]
    path = os.pathsep.join(dirs)
    for tool in ("cargo", "rustc", "maturin"):
        assert shutil.which(tool, path=path) is None, tool
    # Nor this source tree: what runs is what the wheel installed.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    return {**env, "PATH": path, "CARGO_HOME": "/nonexistent", "RUSTUP_HOME": "/nonexistent"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of ``scripts/wheel.sh`` (into a scratch directory, not dist/)."""
    out = tmp_path_factory.mktemp("dist")
    printed = _run("bash", ROOT / "scripts" / "wheel.sh", out, cwd=ROOT)
    wheel = Path(printed.splitlines()[-1])
    assert wheel.parent == out and [wheel] == list(out.iterdir())
    return wheel


def test_the_wheel_is_one_abi3_manylinux_wheel_with_all_package_files(wheel: Path) -> None:
    # static_mls-0.1.0-cp311-abi3-manylinux_2_34_x86_64.whl: any CPython from 3.11 on, glibc Linux.
    name, version, python, abi, platform = wheel.stem.split("-")
    assert (name, python, abi) == ("static_mls", "cp311", "abi3"), wheel.name
    assert platform.startswith("manylinux_2_"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = Parser().parsestr(archive.read(f"static_mls-{version}.dist-info/WHEEL").decode())
        metadata = Parser().parsestr(
            archive.read(f"static_mls-{version}.dist-info/METADATA").decode()
        )
    assert info.get_all("Tag") == [f"cp311-abi3-{platform}"]
    assert info["Root-Is-Purelib"] == "false"
    assert metadata["Name"] == "static-mls" and metadata["Requires-Python"] == ">=3.11"
    assert "static/_native.abi3.so" in names
    # Every file of the source packages ships: modules, stubs, py.typed, and data (the console's
    # assets, ...); build leftovers do not.
    wanted = {
        path.relative_to(ROOT).as_posix()
        for package in ("static", "static_sdk")
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".pyc")
    }
    assert {"static/py.typed", "static/_native/__init__.pyi", "static/_native/relay.pyi"} <= wanted
    assert wanted - names == set()
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)
    assert [name for name in names if name.endswith(".so")] == ["static/_native.abi3.so"]


@pytest.fixture(scope="module")
def wheel_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Python of a fresh virtualenv with the wheel and its server extra installed, with no
    Rust toolchain on the PATH."""
    work = tmp_path_factory.mktemp("wheel")
    venv.create(work / "venv", with_pip=True)
    python = work / "venv" / "bin" / "python"
    env = _without_rust(python.parent)
    pip = (python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    # The SDK alone: no server dependency comes with it, and importing it imports none.
    _run(*pip, wheel, cwd=work, env=env)
    _run(
        python,
        "-c",
        "import static_sdk, sys, importlib.util as u; "
        "assert u.find_spec('quart_trio') is None and u.find_spec('hypercorn') is None; "
        "assert not any(m.startswith(('quart', 'hypercorn', 'static.api')) for m in sys.modules)",
        cwd=work,
        env=env,
    )
    _run(*pip, f"{wheel}[server]", cwd=work, env=env)
    # The relay is the extension's: the server brings no gRPC or protobuf package of its own.
    _run(python, "-c", NO_GRPC_STACK, cwd=work, env=env)
    yield python


def test_the_installed_wheel_serves(wheel_python: Path, database_url: str, tmp_path: Path) -> None:
    env = _without_rust(wheel_python.parent)
    server = ServerProcess(
        tmp_path / "server",
        database_url,
        ["--allow-anonymous"],
        env=env,
        python=str(wheel_python),
        cwd=tmp_path,
    ).start()
    try:
        with urllib.request.urlopen(f"{server.http_url}/healthz", timeout=10) as response:
            assert response.status == 200
        out = _run(
            wheel_python, "-c", ROUND_TRIP, server.relay_url, cwd=tmp_path, timeout=60, env=env
        )
        assert out == "from a wheel\n"
    finally:
        assert server.stop() == 0, server.stderr()
    # What ran was the wheel, not this source tree; the console script is there too.
    where = _run(wheel_python, "-c", "import static; print(static.__file__)", cwd=tmp_path, env=env)
    assert "site-packages" in where and not where.startswith(str(ROOT))
    version = _run(wheel_python.parent / "static", "--version", cwd=tmp_path, env=env)
    assert version == f"static {static.__version__}\n"
