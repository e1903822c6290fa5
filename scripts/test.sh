#!/usr/bin/env bash
# Sets everything up and runs every check: ruff, mypy, rustfmt, clippy, cargo test, pytest (SQLite and
# PostgreSQL). PostgreSQL is installed from Debian's packages when missing; the tests start a
# throwaway cluster of their own.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's packages install (mostly download and unpack, little CPU) while setup builds the
# extension; dpkg takes one installation at a time, so they run one after the other.
packages_log="$(mktemp)"
trap 'rm -f "$packages_log"' EXIT
# PostgreSQL for the store's tests; chromium for the console's (tests/console/, never a
# browser download).
(scripts/ensure-postgres.sh && scripts/ensure-chromium.sh) >"$packages_log" 2>&1 &
packages=$!
scripts/setup.sh "server,dev"
if ! wait "$packages"; then
    cat "$packages_log" >&2
    echo "test: installing Debian's packages failed" >&2
    exit 1
fi
cat "$packages_log"

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
# The Rust tests build and run beside pytest: pytest mostly waits on its servers (much of the
# time a core is idle), and one after the other the two took 9 + 18 minutes of CI's 30. Each test
# binary bounds its own tests (a watchdog per test); this bounds the whole.
echo "== cargo test (beside pytest; its output follows pytest's)"
cargo_log="$(mktemp)"
trap 'rm -f "$packages_log" "$cargo_log"' EXIT
(cd crates && timeout --kill-after=30 30m cargo test --workspace --locked) >"$cargo_log" 2>&1 &
cargo_tests=$!
echo "== pytest"
# Each phase of each test is bounded by the watchdog (tests/support/watchdog.py, the `timeout`
# setting). This bounds the whole run too, for a hang outside any test (collection, interpreter
# exit), well under CI's 90 minutes (the suite takes ~11 on 2 cores): SIGABRT first, on which pytest's
# faulthandler prints every thread's stack, then SIGKILL a minute later. timeout signals its
# whole process group, so the servers the run started end with it. No core files meanwhile.
ulimit -c 0
status=0
# --durations: the slowest phases are printed, to see where the run's time goes.
# -n: pytest-xdist's workers, one a core up to 4 (each has its own watchdog and PostgreSQL
# cluster); --dist loadfile keeps a file's tests in one worker, so its module-scoped servers
# start once. On 2 cores: 22.6 minutes in one process, 10.5 in two.
timeout --signal=ABRT --kill-after=60 45m .venv/bin/python -m pytest --durations=25 \
    --numprocesses=auto --maxprocesses=4 --dist=loadfile "$@" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "pytest: still running after 45 minutes; ended" >&2
fi
cargo_status=0
wait "$cargo_tests" || cargo_status=$?
echo "== cargo test (its output)"
# The summary lines, and in full what failed.
if [ "$cargo_status" -eq 0 ]; then
    grep -E '^(\s+Running|test result:)' "$cargo_log" || true
else
    cat "$cargo_log"
    if [ "$cargo_status" -eq 124 ] || [ "$cargo_status" -eq 137 ]; then
        echo "cargo test: still running after 30 minutes; ended" >&2
    fi
    echo "cargo test: failed (exit $cargo_status)" >&2
fi
if [ "$status" -eq 0 ]; then
    status="$cargo_status"
fi
exit "$status"
