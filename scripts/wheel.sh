#!/usr/bin/env bash
# Builds Static's one wheel: abi3 (any CPython >= 3.11), tagged manylinux, the native extension
# inside, so that installing it needs no Rust toolchain. Usage: scripts/wheel.sh [OUT_DIR]
# (default dist/); prints the wheel's path last. docs/install.md says how to install it.
#
# It reuses the warm cargo target dir of scripts/setup.sh (CARGO_TARGET_DIR, same default) and its
# Python (.venv's, when there), so that after setup's release build only the wheel is packed.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-dist}"
say() { echo "wheel: $*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
    say "cargo (Rust) is required to build the wheel (not to install it)"
    exit 1
fi
python="${PYTHON:-}"
if [ -z "$python" ]; then
    # setup.sh's interpreter: the build sees the same Python as its build did, so nothing of
    # the release build is redone.
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/static/cargo-target}"
mkdir -p "$CARGO_TARGET_DIR" "$out"

# manylinux_2_34: the extension links against glibc (Debian 12's is 2.36), and since glibc 2.34
# holds pthread & co., its newest symbol versions are GLIBC_2.34; so the wheel installs on glibc
# >= 2.34 (Debian 12, Ubuntu 22.04, RHEL 9 and later). maturin's own auditwheel check refuses a
# tag the binary does not meet (a symbol newer than the tag, a library outside the policy), so
# a dependency that raises the floor fails this build instead of users' imports.
compat="${STATIC_MANYLINUX:-manylinux_2_34}"
export MATURIN_PEP517_ARGS="--compatibility $compat --auditwheel check"

# pip wheel, not maturin directly: the build backend pinned in pyproject.toml ([build-system]),
# in an isolated build environment, as `pip install .` gets it.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
say "building the wheel ($compat, abi3; cargo target: $CARGO_TARGET_DIR)"
start=$SECONDS
log="$tmp/log"
if ! "$python" -m pip wheel --no-deps --disable-pip-version-check -v --wheel-dir "$tmp" . \
    >"$log" 2>&1; then
    say "the build failed; the last lines of its output:"
    tail -n 40 "$log" >&2
    exit 1
fi
wheels=("$tmp"/*.whl)
if [ "${#wheels[@]}" -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
    say "expected one wheel, found: ${wheels[*]}"
    exit 1
fi
# The one wheel of this version replaces any earlier build of it (and only of it).
mv -f "${wheels[0]}" "$out/"
wheel="$out/$(basename "${wheels[0]}")"
say "built $wheel ($(du -k "$wheel" | cut -f1) KiB) in $((SECONDS - start)) s"
echo "$wheel"
