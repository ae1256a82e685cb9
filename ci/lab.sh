#!/usr/bin/env bash
# JupyterLab on the gallery's notebooks, with the gallery's environment as the notebooks' kernel.
#
#   bash ci/lab.sh [JUPYTER LAB ARGS...]
#
# Sets up .venv/ with the lab extra (as ci/setup_env.sh does), registers its interpreter as the `python3` kernel and
# starts JupyterLab on notebooks/, listening on 127.0.0.1 (GALLERY_LAB_IP to change; on a cloud GPU machine keep it
# and forward the port: ssh -L 8888:127.0.0.1:8888 <machine>).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/ci/setup_env.sh" notebooks,sd,lab
venv=${GALLERY_VENV:-$repo/.venv}
"$venv/bin/python" -c "import sys; sys.path.insert(0, '$repo/ci'); import run_notebooks; run_notebooks.ensure_kernel()"
cd "$repo"
root_flag=()
[ "$(id -u)" = 0 ] && root_flag=(--allow-root)  # containers on cloud machines often run as root
exec "$venv/bin/jupyter" lab notebooks/ --ip "${GALLERY_LAB_IP:-127.0.0.1}" "${root_flag[@]}" "$@"
