#!/usr/bin/env bash
# Sets everything up and runs every check: ruff, mypy, rustfmt, clippy, cargo test, pytest (SQLite and
# PostgreSQL). PostgreSQL is installed from Debian's packages when missing; the tests start a
# throwaway cluster of their own.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh "server,dev"
scripts/ensure-postgres.sh

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/static/cargo-target}"

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
# The benchmarks: scripts, outside the packages the configuration lists.
.venv/bin/mypy --strict bench
echo "== rustfmt"
(cd crates && cargo fmt --all --check)
echo "== clippy"
(cd crates && cargo clippy --workspace --all-targets --locked -- -D warnings)
echo "== cargo test"
(cd crates && cargo test --workspace --locked)
echo "== pytest"
.venv/bin/python -m pytest "$@"
