#!/usr/bin/env bash
# Makes PostgreSQL's server binaries available (Debian's `postgresql`), installing them when
# missing. It starts nothing: the tests start a throwaway cluster of their own.
set -euo pipefail

if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then
    exit 0
fi
echo "ensure-postgres: installing Debian's postgresql"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends postgresql
