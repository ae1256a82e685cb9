#!/usr/bin/env bash
# The gallery's main job: set up the environment, then execute every notebook with papermill.
#
#   bash ci/gallery.sh [--profile auto|smoke|full] [--only NAME]
#
# Mock data goes to data/, runs and reports to output/<model>/, executed notebooks to output/notebooks/.
# The profile defaults to auto: full on a GPU machine, smoke (tiny models, minutes) on a CPU.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/ci/setup_env.sh" notebooks,sd
venv=${GALLERY_VENV:-$repo/.venv}
cd "$repo"
exec "$venv/bin/python" ci/run_notebooks.py "$@"
