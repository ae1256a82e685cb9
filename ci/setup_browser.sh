#!/usr/bin/env bash
# Installs what the browser tests need (tests/test_browser.py): Debian's chromium and the playwright package.
#
#   bash ci/setup_browser.sh [chromium]    # chromium: the apt part only (the environment may not exist yet)
#
# chromium comes from apt (as root, or through sudo); playwright drives it (no browser download: the tests point
# playwright at Debian's chromium). Without apt, it says so and leaves the browser tests to skip.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${GALLERY_VENV:-$repo/.venv}
if ! command -v chromium >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (apt)"
    $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
      || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; } \
      || echo "[setup] could not install chromium with apt: the browser tests will skip"
  else
    echo "[setup] no apt-get: install chromium yourself for the browser tests"
  fi
fi
[ "${1:-}" = chromium ] && exit 0
"$venv/bin/python" -c "import playwright" 2>/dev/null || "$venv/bin/python" -m pip install --quiet "playwright>=1.40"
command -v chromium >/dev/null 2>&1 && echo "[setup] browser: $(chromium --version 2>/dev/null)"
exit 0
