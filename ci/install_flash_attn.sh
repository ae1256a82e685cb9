#!/usr/bin/env bash
# Installs FlashAttention on a GPU machine, then checks it against PyTorch's SDPA.
#
#   ci/install_flash_attn.sh            # FA4 on Hopper and newer GPUs, FA2 before them
#   ci/install_flash_attn.sh fa4        # FlashAttention-4: the flash-attn-4 package (pyproject.toml's "flash" extra)
#   ci/install_flash_attn.sh fa2        # FlashAttention-2: the flash-attn package
#   ci/install_flash_attn.sh check      # only the checks, of whichever is installed
#   FLASH_ATTN_WHEELS=DIR ci/install_flash_attn.sh fa4          # FA4 from the wheels in DIR, without network
#   FLASH_ATTN_VERSION=2.7.4.post1 ci/install_flash_attn.sh fa2
#
# FA4 is Python on NVIDIA's CUTLASS DSL, which compiles its kernels the first time each shape's kind runs: there is
# nothing to build. Where torch runs CUDA 13, the DSL's CUDA 13 libraries come too (flash-attn-4[cu13]). The check
# compares FA4's output and dq with exact math at head dims 40 and 64, next to PyTorch's own SDPA: on an H200 its dq
# was wrong at head dim 40 (and 80), which the registry's flash_attn4_padded runner avoids by padding to 64; the check
# says whether this release still needs it.
#
# FA2: pip is asked for a prebuilt wheel only (--only-binary): from the index, or from PIP_FIND_LINKS (e.g. the
# flash-attn GitHub release page) when set. flash-attn's own setup.py also downloads the release wheel that matches
# torch/CUDA/Python before compiling, unless FLASH_ATTENTION_FORCE_BUILD=TRUE. Otherwise flash-attn is built from
# source against the installed torch (--no-build-isolation), for the detected GPU architecture only
# (FLASH_ATTN_CUDA_ARCHS), with MAX_JOBS parallel compile jobs (each nvcc job of flash-attn takes up to ~4 GB of RAM,
# so the default is RAM/4 GB, capped by the core count).
#
# gallery_lib works fully without either: gallery_lib.accel.attention then uses PyTorch SDPA's kernels.
set -euo pipefail

PYTHON="${PYTHON:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

"$PYTHON" - <<'EOF' || { echo "install_flash_attn: needs torch with CUDA and a visible GPU" >&2; exit 1; }
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name()}, "
      f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}")
EOF

which="${1:-}"
if [[ -z "$which" ]]; then
  major="$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_capability()[0])')"
  which=$([[ "$major" -ge 9 ]] && echo fa4 || echo fa2)
  echo "install_flash_attn: compute capability ${major}.x: $which"
fi

install_fa4() {
  if [[ -n "${FLASH_ATTN_WHEELS:-}" ]]; then
    "$PYTHON" -m pip install --no-index --no-deps "$FLASH_ATTN_WHEELS"/*.whl
    return
  fi
  # the "flash" extra's requirements alone: installing ".[flash]" would also reinstall the gallery, not editable
  mapfile -t requirements < <("$PYTHON" -c '
import ast, re, sys
text = open(sys.argv[1], encoding="utf-8").read()
print("\n".join(ast.literal_eval(re.search(r"^flash = (\[.*?\])", text, re.M).group(1))))' "$ROOT/pyproject.toml")
  if [[ "$("$PYTHON" -c 'import torch; print(torch.version.cuda.split(".")[0])')" -ge 13 ]]; then
    requirements+=("flash-attn-4[cu13]")
  fi
  "$PYTHON" -m pip install "${requirements[@]}"
}

install_fa2() {
  local spec="flash-attn${FLASH_ATTN_VERSION:+==${FLASH_ATTN_VERSION}}"
  if "$PYTHON" -m pip install --only-binary=:all: --no-build-isolation "$spec"; then
    echo "install_flash_attn: installed a prebuilt wheel"
    return
  fi
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
  "$PYTHON" -m pip install -v --no-build-isolation --no-binary flash-attn "$spec" ninja packaging
}

check_fa4() {
  "$PYTHON" - <<'EOF'
import importlib.metadata

import torch
import torch.nn.functional as F
from flash_attn.cute import flash_attn_func

version = importlib.metadata.version("flash-attn-4")


def fa4(q, k, v, scale=None):  # (batch, heads, tokens, head_dim), as SDPA takes them
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def fa4_padded(q, k, v):
    d, padded = q.shape[-1], -(-q.shape[-1] // 32) * 32
    q, k, v = (F.pad(t, (0, padded - d)) for t in (q, k, v))
    return fa4(q, k, v, scale=d**-0.5)[..., :d]


def errors(run, inputs, exact):
    """Max absolute error of the output and of dq against exact (float64) attention."""
    q, k, v, grad = inputs
    q = q.detach().requires_grad_()
    out = run(q, k, v)
    (dq,) = torch.autograd.grad(out, q, grad)
    return [(got.double() - want).abs().max().item() for got, want in zip((out, dq), exact)]


failed = []
for head_dim in (40, 64):
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(1, 8, 1024, head_dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)]
    q64 = inputs[0].double().requires_grad_()
    out64 = ((q64 @ inputs[1].double().transpose(-2, -1)) * head_dim**-0.5).softmax(-1) @ inputs[2].double()
    exact = [out64.detach(), *torch.autograd.grad(out64, q64, inputs[3].double())]
    sdpa = errors(F.scaled_dot_product_attention, inputs, exact)
    allowed = [max(2 * e, 1e-4) for e in sdpa]  # the registry's gate: at most twice PyTorch's own op's error
    found = {"FA4": errors(fa4, inputs, exact), "FA4 padded": errors(fa4_padded, inputs, exact)}
    ok = {name: [e <= a for e, a in zip(errs, allowed)] for name, errs in found.items()}
    for name, errs in found.items():
        print(f"install_flash_attn: head dim {head_dim}: {name:<10} out error {errs[0]:.2g}, dq error {errs[1]:.2g}"
              f" (SDPA's: {sdpa[0]:.2g}, {sdpa[1]:.2g}): {'ok' if all(ok[name]) else 'WRONG'}")
    if not ok["FA4"][0] or not all(ok["FA4 padded"]):
        failed.append(head_dim)
    elif not ok["FA4"][1]:
        print(f"install_flash_attn: head dim {head_dim}: padding needed: FA4's dq is wrong here and right padded to "
              f"{-(-head_dim // 32) * 32} (auto refuses flash_attn4 here and can take flash_attn4_padded)")
    else:
        print(f"install_flash_attn: head dim {head_dim}: no padding needed")
if failed:
    raise SystemExit(f"install_flash_attn: flash-attn-4 {version} computes attention wrongly at head dims {failed} "
                     "even padded: leave it out (pip uninstall flash-attn-4)")
print(f"install_flash_attn: flash-attn-4 {version} works")
EOF
}

check_fa2() {
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
}

installed() {  # "$1" is an importable module with attribute "$2"
  "$PYTHON" -c "import importlib, sys; sys.exit(not hasattr(importlib.import_module('$1'), '$2'))" 2>/dev/null
}

case "$which" in
  fa4) install_fa4; check_fa4 ;;
  fa2) install_fa2; check_fa2 ;;
  check)
    checked=""
    if installed flash_attn.cute flash_attn_func; then check_fa4; checked=yes; fi
    if installed flash_attn flash_attn_func; then check_fa2; checked=yes; fi
    [[ -n "$checked" ]] || { echo "install_flash_attn: neither flash-attn-4 nor flash-attn imports here" >&2; exit 1; }
    ;;
  *) echo "usage: ci/install_flash_attn.sh [fa4|fa2|check]" >&2; exit 2 ;;
esac
