#!/usr/bin/env bash
# Sets everything up, then runs `static serve` on the embedded SQLite default.
# Extra arguments go to `static serve` (e.g. --http 127.0.0.1:0).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh server
exec .venv/bin/static serve "$@"
