#!/usr/bin/env bash
# Prints the path of a Chromium binary, installing Debian's `chromium` package when there is none
# (the report test renders <run.dir>/report.html in it). Needs root, or sudo without a password, for
# apt-get; every step has a time limit, so a test set-up calling this can never hang.
#   usage: scripts/ensure_browser.sh
set -euo pipefail
find_browser() {
  for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
  done
  return 1
}
find_browser && exit 0
if [ "$(id -u)" = 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else
  echo "no Chromium found and no root to install it: run 'apt-get install -y chromium' as root" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
timeout 300 "${sudo[@]}" apt-get update -q </dev/null >&2
timeout 480 "${sudo[@]}" apt-get install -y -q chromium </dev/null >&2
find_browser || { echo "apt-get installed chromium but no chromium binary is on PATH" >&2; exit 1; }
