#!/usr/bin/env bash
# Creates the gallery's Python environment if it is missing, and installs what it needs.
#
#   bash ci/setup_env.sh [EXTRAS]     # EXTRAS: pip extras of gallery-lib, default "notebooks"
#
# The environment is .venv/ at the repository root (override with GALLERY_VENV). On a GPU machine a
# conda environment from environment.yml works too: activate it and set GALLERY_VENV to its prefix.
# Torch comes first, in the range the gallery is tested with, built for this machine: on a GPU machine from PyTorch's
# index for the CUDA that the driver runs (gallery_lib/config/gpu_check.py reads nvidia-smi; an error if torch then cannot
# see the GPU); on a CPU machine the CPU build from PyTorch's CPU index when it answers, else PyPI's default build
# (which carries the CUDA libraries, ~3 GB). On a GPU it is torch 2.11, which every GPU number and GPU test here ran on;
# GALLERY_TORCH_NEWEST=1 takes the newest of the tested range instead. Override with GALLERY_TORCH_SPEC="torch==X
# torchvision==Y" (installed as given, from pip's configured indexes) or GALLERY_TORCH_INDEX=cu128|cu130|cpu.
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

# uv installs the same wheels as pip several times faster (torch's CUDA libraries alone are about 3 GB). It reads no
# pip.conf, so where it fails (say, a machine that reaches packages only through pip's configured mirror) pip runs.
# GALLERY_NO_UV=1: pip only.
# Byte-compile at install, as pip does and uv by default does not: where PYTHONDONTWRITEBYTECODE is set (as on the
# 2-core machine of benchmarks/RESULTS.md#ci) every process would compile torch's and diffusers' sources again, most of
# a smoke run's start.
export UV_COMPILE_BYTECODE=${UV_COMPILE_BYTECODE:-1}
uv_ready=""  # yes or no once known: pip installs uv at most once
have_uv() {
  if [ -z "$uv_ready" ]; then
    uv_ready=no
    if [ -z "${GALLERY_NO_UV:-}" ] && { "$py" -m uv --version >/dev/null 2>&1 \
        || "$py" -m pip install --quiet uv >/dev/null 2>&1; }; then
      uv_ready=yes
    fi
  fi
  [ "$uv_ready" = yes ]
}
install() {
  if have_uv; then
    "$py" -m uv pip install --python "$py" --quiet "$@" && return 0
    echo "[setup] uv could not install $*: trying pip"
  fi
  "$py" -m pip install --quiet "$@"
}
# For an index that may not answer (PyTorch's CPU index from a machine that reaches PyPI only): fail within seconds.
install_or_give_up() {
  if have_uv; then
    UV_HTTP_TIMEOUT=10 UV_HTTP_RETRIES=0 "$py" -m uv pip install --python "$py" --quiet "$@"
  else
    "$py" -m pip install --quiet --timeout 10 --retries 0 "$@"
  fi
}
# The model families load through the package's entry points: an install without them (older metadata) is redone.
has_families="from importlib.metadata import entry_points; assert entry_points(group='gallery_families')"
if [ -f "$stamp" ] && [ "$stamp" -nt "$repo/pyproject.toml" ] && "$py" -c "import torch, timm, gallery_lib" 2>/dev/null \
    && "$py" -c "$has_families" 2>/dev/null; then
  echo "[setup] $venv is up to date ($extras)"
  exit 0
fi
# which torch build this machine wants (gallery_lib/config/gpu_check.py: main says why through -c, not -m)
wheel_index_cmd="from gallery_lib.config.gpu_check import main; raise SystemExit(main())"
tested_range="torch>=2.11,<2.15 torchvision>=0.26,<0.30"  # pyproject.toml says the same
cpu_pin="torch==2.14.1 torchvision==0.29.1"                 # what CPU CI runs
gpu_pin="torch==2.11.* torchvision==0.26.*"  # what every GPU number and GPU test ran on (the GPU machines' torch)
[ -n "${GALLERY_TORCH_NEWEST:-}" ] && gpu_pin=$tested_range  # opt in: the newest of the tested range
if ! "$py" -c "import torch, torchvision" 2>/dev/null; then
  if [ -n "${GALLERY_TORCH_SPEC:-}" ]; then
    echo "[setup] installing $GALLERY_TORCH_SPEC"
    # shellcheck disable=SC2086
    install $GALLERY_TORCH_SPEC
  else
    tag=${GALLERY_TORCH_INDEX:-$(cd "$repo" && "$python" -c "$wheel_index_cmd")} || exit 1
    index="https://download.pytorch.org/whl/$tag"
    if [ "$tag" = cpu ]; then
      echo "[setup] no GPU: trying PyTorch's CPU build ($index)"
      # shellcheck disable=SC2086
      if ! install_or_give_up --index-url "$index" $cpu_pin 2>/dev/null; then
        echo "[setup] PyTorch's CPU index did not answer: installing PyPI's $cpu_pin (with CUDA libraries)"
        # shellcheck disable=SC2086
        install $cpu_pin
      fi
    else
      echo "[setup] GPU driver wants $tag: installing $gpu_pin from $index"
      # shellcheck disable=SC2086
      install --index-url "$index" $gpu_pin
      if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "[setup] ERROR: torch was installed from $index but cannot use the GPU that nvidia-smi lists." >&2
        nvidia-smi --query-gpu=name,driver_version --format=csv >&2 || true
        echo "[setup] Set GALLERY_TORCH_INDEX to a CUDA tag this driver runs (e.g. cu126), remove $venv, retry." >&2
        exit 1
      fi
    fi
  fi
fi
echo "[setup] installing gallery-lib[$extras]"
install -e "$repo[$extras]"
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    && ! "$py" -c "import cudnn" 2>/dev/null; then
  # ResNet-50's accelerated recipe folds its norms into cuDNN's fused convolutions through the frontend's graph API,
  # which needs only the cuDNN that torch ships: not the CUTLASS DSL its wheel also asks for.
  echo "[setup] GPU: installing cuDNN's Python frontend (nvidia-cudnn-frontend)"
  install --no-deps "nvidia-cudnn-frontend>=1.12,<2"
fi
"$py" -m compileall -q "$repo/gallery_lib" >/dev/null  # the editable package too (stale files recompile in memory)
touch "$stamp"
echo "[setup] ready: $py"
