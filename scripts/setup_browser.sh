#!/usr/bin/env bash
# Headless Chromium from Debian's packages, for the dashboard's real-browser test
# (tests/server/test_dashboard_browser.py drives it with Playwright; nothing is downloaded by
# Playwright itself). Run by the test command only: serving needs no browser.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
