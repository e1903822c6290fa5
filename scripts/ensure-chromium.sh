#!/usr/bin/env bash
# Makes Debian's chromium available for the console's tests (tests/console/, driven through
# Playwright with executable_path=/usr/bin/chromium), installing it when missing. Playwright's
# own browser downloads are never used.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
echo "ensure-chromium: installing Debian's chromium"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends chromium
