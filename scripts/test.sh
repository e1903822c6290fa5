#!/usr/bin/env bash
# Sets everything up and runs every check: ruff, mypy, rustfmt, clippy, cargo test, pytest (SQLite and
# PostgreSQL). PostgreSQL is installed from Debian's packages when missing; the tests start a
# throwaway cluster of their own.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh "server,dev"
scripts/ensure-postgres.sh
# Debian's chromium, for the console's tests (tests/console/): never a browser download.
scripts/ensure-chromium.sh

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
# Each phase of each test is bounded by the watchdog (tests/support/watchdog.py, the `timeout`
# setting). This bounds the whole run too, for a hang outside any test (collection, interpreter
# exit), well under CI's 90 minutes (the suite takes ~15 on 2 cores): SIGABRT first, on which pytest's
# faulthandler prints every thread's stack, then SIGKILL a minute later. timeout signals its
# whole process group, so the servers the run started end with it. No core files meanwhile.
ulimit -c 0
status=0
# --durations: the slowest phases are printed, to see where the run's time goes.
timeout --signal=ABRT --kill-after=60 45m .venv/bin/python -m pytest --durations=25 "$@" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "pytest: still running after 45 minutes; ended" >&2
fi
exit "$status"
