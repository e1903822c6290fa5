#!/usr/bin/env bash
# Sets up a fresh machine for Static: a virtualenv in .venv with the package (native extension
# included) installed editable. Usage: scripts/setup.sh [EXTRAS], EXTRAS defaulting to "server".
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-server}"
python="${PYTHON:-python3}"

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo (Rust) is required to build the native extension" >&2
    exit 1
fi
"$python" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"setup: Python >= 3.11 is required, found {sys.version.split()[0]}")
PY

# Keep the Rust build warm across runs and clones; nothing depends on it being there.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/static/cargo-target}"
mkdir -p "$CARGO_TARGET_DIR"

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

# Generated code (gRPC stubs) is produced from proto/ at build time, never edited by hand.
if [ -x scripts/generate.sh ]; then
    scripts/generate.sh
fi
