#!/usr/bin/env bash
# Installs Debian's Chromium and its WebDriver for tests/test_browser.py (idempotent, quiet).
#
# The browser test drives /usr/bin/chromium through /usr/bin/chromedriver with Selenium; it never
# lets Selenium Manager or Playwright download a browser. Does nothing when both are present.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser.sh: apt-get not found; install chromium and chromium-driver" \
         "(/usr/bin/chromium, /usr/bin/chromedriver) with your package manager" >&2
    exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "install_browser.sh: need root (or passwordless sudo) to apt-get install" \
             "chromium chromium-driver" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { ${SUDO[@]+"${SUDO[@]}"} apt-get update -qq && \
       ${SUDO[@]+"${SUDO[@]}"} apt-get install -y -qq chromium chromium-driver; } >"$log" 2>&1; then
    echo "install_browser.sh: apt-get failed:" >&2
    tail -n 20 "$log" >&2
    exit 1
fi
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    echo "install_browser.sh: installed, but /usr/bin/chromium or /usr/bin/chromedriver is missing" >&2
    exit 1
fi
