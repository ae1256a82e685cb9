#!/usr/bin/env bash
# Installs the flash-attn package (FA2) on a GPU machine, then checks that it imports and runs.
#
#   ci/install_flash_attn.sh                 # latest flash-attn
#   FLASH_ATTN_VERSION=2.7.4.post1 ci/install_flash_attn.sh
#
# 1. pip is asked for a prebuilt wheel only (--only-binary): from the index, or from PIP_FIND_LINKS (e.g. the
#    flash-attn GitHub release page) when set. flash-attn's own setup.py also downloads the release wheel that
#    matches torch/CUDA/Python before compiling, unless FLASH_ATTENTION_FORCE_BUILD=TRUE.
# 2. Otherwise flash-attn is built from source against the installed torch (--no-build-isolation), for the
#    detected GPU architecture only (FLASH_ATTN_CUDA_ARCHS), with MAX_JOBS parallel compile jobs (each nvcc job
#    of flash-attn takes up to ~4 GB of RAM, so the default is RAM/4 GB, capped by the core count).
# gallery_lib works fully without flash-attn: gallery_lib.accel.attention then uses PyTorch SDPA's kernels.
set -euo pipefail

PYTHON="${PYTHON:-python}"
SPEC="flash-attn${FLASH_ATTN_VERSION:+==${FLASH_ATTN_VERSION}}"

"$PYTHON" - <<'EOF' || { echo "install_flash_attn: needs torch with CUDA and a visible GPU" >&2; exit 1; }
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name()}")
EOF

if "$PYTHON" -m pip install --only-binary=:all: --no-build-isolation "$SPEC"; then
  echo "install_flash_attn: installed a prebuilt wheel"
else
  echo "install_flash_attn: no matching prebuilt wheel; building from source"
  command -v nvcc >/dev/null || { echo "install_flash_attn: nvcc not found; install the CUDA toolkit that matches torch" >&2; exit 1; }
  if [[ -z "${FLASH_ATTN_CUDA_ARCHS:-}" ]]; then
    FLASH_ATTN_CUDA_ARCHS="$("$PYTHON" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')"
  fi
  if [[ -z "${MAX_JOBS:-}" ]]; then
    mem_gb=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
    MAX_JOBS=$(( mem_gb / 4 ))
    cores=$(nproc)
    (( MAX_JOBS > cores )) && MAX_JOBS=$cores
    (( MAX_JOBS < 1 )) && MAX_JOBS=1
  fi
  export FLASH_ATTN_CUDA_ARCHS MAX_JOBS
  echo "install_flash_attn: FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} MAX_JOBS=${MAX_JOBS}"
  "$PYTHON" -m pip install -v --no-build-isolation --no-binary flash-attn "$SPEC" ninja packaging
fi

"$PYTHON" - <<'EOF'
import torch
import flash_attn
from flash_attn import flash_attn_func

q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = flash_attn_func(q, k, v)
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
err = (out - ref.transpose(1, 2)).abs().max().item()
assert err < 2e-2, f"flash-attn output differs from SDPA by {err}"
print(f"install_flash_attn: flash-attn {flash_attn.__version__} works (max diff vs SDPA {err:.1e})")
EOF
