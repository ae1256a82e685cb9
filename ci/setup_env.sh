#!/usr/bin/env bash
# Creates the gallery's Python environment if it is missing, and installs what it needs.
#
#   bash ci/setup_env.sh [EXTRAS]     # EXTRAS: pip extras of gallery-lib, default "notebooks"
#
# The environment is .venv/ at the repository root (override with GALLERY_VENV). On a GPU machine a
# conda environment from environment.yml works too: activate it and set GALLERY_VENV to its prefix.
# Torch comes first and is pinned where no GPU is present (the CPU machines we test on carry this
# pair; timm needs torchvision); on a GPU machine pip's default torch build is the CUDA one.
# Override with GALLERY_TORCH_SPEC="torch==X torchvision==Y" (and PIP_EXTRA_INDEX_URL for another index).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
extras=${1:-notebooks}
venv=${GALLERY_VENV:-$repo/.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.gallery-installed-$extras"
if [ -f "$stamp" ] && [ "$stamp" -nt "$repo/pyproject.toml" ] && "$py" -c "import torch, timm, gallery_lib" 2>/dev/null; then
  echo "[setup] $venv is up to date ($extras)"
  exit 0
fi
if ! "$py" -c "import torch, torchvision" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${GALLERY_TORCH_SPEC:-"torch torchvision"}
  else
    spec=${GALLERY_TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
  fi
  echo "[setup] installing $spec"
  # shellcheck disable=SC2086
  "$py" -m pip install --quiet $spec
fi
echo "[setup] installing gallery-lib[$extras]"
"$py" -m pip install --quiet -e "$repo[$extras]"
touch "$stamp"
echo "[setup] ready: $py"
