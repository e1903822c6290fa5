#!/usr/bin/env bash
# Sets up a fresh machine for Static: a virtualenv in .venv with the package (native extension
# included) installed editable. Usage: scripts/setup.sh [EXTRAS], EXTRAS defaulting to "server".
# Idempotent: when nothing it builds from changed since its last run (same extras), it only says so,
# so that scripts/serve.sh starts in seconds; otherwise it says what it is doing while it builds.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-server}"
python="${PYTHON:-python3}"

say() { echo "setup: $*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
    say "cargo (Rust) is required to build the native extension"
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

# What the installation is built from: a newer file among these (an edit, a checkout, a pull)
# means a rebuild. The stamp records the extras it was made for: an installation with more extras
# serves a run asking for fewer (serve.sh's "server" after test.sh's "server,dev").
stamp=.venv/.static-setup
inputs=(pyproject.toml proto crates scripts/setup.sh)
has_extras() {
    local extra
    for extra in ${extras//,/ }; do
        [[ ",$(cat "$stamp")," == *",$extra,"* ]] || return 1
    done
}
up_to_date() {
    [ -x .venv/bin/python ] && [ -f "$stamp" ] && has_extras || return 1
    compgen -G "static/_native*.so" >/dev/null || return 1
    [ -z "$(find "${inputs[@]}" -path crates/target -prune -o -newer "$stamp" -print -quit)" ]
}

if up_to_date; then
    say "up to date (.venv, extras: $extras)"
else
    if [ ! -x .venv/bin/python ]; then
        say "creating the virtualenv in .venv"
        "$python" -m venv .venv
    fi
    rm -f "$stamp"
    # The stamp's time is the build's start: a file edited while it builds is newer, so the
    # next run builds again (a stamp written at the end hid such an edit).
    : >"$stamp.new"
    say "installing pip and the Python dependencies (extras: $extras)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    say "building the native extension (a release build of crates/; the first one takes" \
        "several minutes on 2 cores; cargo target: $CARGO_TARGET_DIR)"
    log="$(mktemp)"
    trap 'rm -f "$log"' EXIT
    # pip hides the build's output unless verbose: show cargo's progress lines, keep the rest
    # for when it fails.
    if ! .venv/bin/python -m pip install -v --disable-pip-version-check -e ".[$extras]" 2>&1 \
        | tee "$log" | grep --line-buffered -E '^\s*(Compiling|Finished) ' | sed -u 's/^ */  /' >&2; then
        say "the installation failed; the last lines of its output:"
        tail -n 40 "$log" >&2
        exit 1
    fi
    if ! grep -q '^Successfully installed' "$log"; then
        say "the installation failed; the last lines of its output:"
        tail -n 40 "$log" >&2
        exit 1
    fi
    echo "$extras" >>"$stamp.new"
    mv "$stamp.new" "$stamp"
    say "installed"
fi

# Generated code (gRPC stubs) is produced from proto/ at build time, never edited by hand.
if [ -x scripts/generate.sh ]; then
    scripts/generate.sh
fi
