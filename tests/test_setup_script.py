"""``scripts/setup.sh`` (which ``scripts/serve.sh`` runs first): says what it does while it builds,
and does nothing when nothing it builds from changed, so that a second ``serve.sh`` starts in
seconds.

Run on a copy of the script in a scratch tree whose ``.venv/bin/python`` is a stand-in recording how
it is called: what is under test is the script's decisions, not pip's or cargo's work."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls"
case "$*" in
    *"install -v"*)
        echo "   Compiling static-native v0.1.0"
        echo "Successfully installed static-0.1.0" ;;
esac
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "relay.proto").write_text("")
    (tmp_path / "crates" / "src").mkdir(parents=True)
    (tmp_path / "crates" / "src" / "lib.rs").write_text("")
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "_native.abi3.so").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _setup(tree: Path) -> tuple[str, list[str]]:
    calls = tree / ".venv" / "calls"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "CARGO_TARGET_DIR": str(tree / "target")}
    done = subprocess.run(
        ["bash", "scripts/setup.sh", "server,dev"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stderr, calls.read_text().splitlines() if calls.exists() else []


def test_a_first_run_says_what_it_builds_and_a_second_installs_nothing(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    said, calls = _setup(tree)
    assert "building the native extension" in said
    assert "Compiling static-native" in said  # cargo's progress reaches the terminal
    assert any("install -v" in call and ".[server,dev]" in call for call in calls)

    said, calls = _setup(tree)
    assert "up to date" in said
    assert calls == []


def test_an_edit_a_new_extra_or_a_missing_extension_rebuilds(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _setup(tree)
    # An input newer than the stamp, whatever the filesystem's time resolution.
    earlier = time.time() - 100
    os.utime(tree / ".venv" / ".static-setup", (earlier, earlier))
    said, calls = _setup(tree)
    assert "building the native extension" in said and calls

    # The stamp records the extras: fewer are served by what is installed, more are installed.
    fewer = subprocess.run(
        ["bash", "scripts/setup.sh", "server"], cwd=tree, capture_output=True, text=True, check=True
    )
    assert "up to date" in fewer.stderr
    (tree / ".venv" / ".static-setup").write_text("server\n")
    _, calls = _setup(tree)
    assert any(".[server,dev]" in call for call in calls)

    (tree / "static" / "_native.abi3.so").unlink()
    _, calls = _setup(tree)
    assert calls


def test_a_failed_build_shows_its_output_and_fails(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    python = tree / ".venv" / "bin" / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in *"install -v"*) echo "error: linker failed"; exit 1;; esac\n'
    )
    env = {**os.environ, "CARGO_TARGET_DIR": str(tree / "target")}
    done = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "error: linker failed" in done.stderr
    assert not (tree / ".venv" / ".static-setup").exists()
