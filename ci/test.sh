#!/usr/bin/env bash
# The gallery's test command: set up the environment with the test extras, then run pytest.
#
#   bash ci/test.sh [PYTEST ARGS...]      e.g. bash ci/test.sh -m "not notebook"
#
# GPU tests carry the `gpu` marker and skip without a CUDA device. Exit code 5 ("no tests
# collected") is an error here: a test command that tests nothing must not pass.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/ci/setup_env.sh" notebooks,sd,lab,test || exit 1
bash "$repo/ci/setup_browser.sh"  # chromium + playwright for the browser tests (they skip without them)
venv=${GALLERY_VENV:-$repo/.venv}
cd "$repo"
"$venv/bin/python" -m pytest "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$code"
