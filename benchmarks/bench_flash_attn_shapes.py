"""FlashAttention-4 at the SD shapes: speed and accuracy of SDPA, FA4 and FA4 padded, and what auto picks.

On one Hopper GPU, in bf16: forward+backward ms of PyTorch's SDPA (its own kernel choice), FA4 (``flash_attn4``) and
FA4 with the head dim zero-padded to a multiple of 32 (``flash_attn4_padded``); the max error of out, dq, dk and dv of
each against exact math at the correctness gate's probe (batch 1 of the shape, ``gallery_lib/accel/attention/gate.py``)
with what the gate allows there; and what ``auto`` picks (the gate, then the timings of every backend it passed).
Times are CUDA events after 3 warm-up steps, median of 20 with p20/p80. The JSON file is rewritten after each shape,
so a run cut short keeps the shapes it finished.

    python3 benchmarks/bench_flash_attn_shapes.py --out $OUT/flash_attn_shapes.json   (benchmarks/gpu_flash_attn.sh)
"""

import argparse
import importlib.metadata
import json
import os
import time

import torch
import torch.nn.functional as F
from gpu_timing import event_ms

from gallery_lib.accel.attention import BACKENDS, BackendSelector, sdpa_choice
from gallery_lib.accel.attention.gate import GateProbe
from gallery_lib.reports.provenance import result_header

SHAPES = [  # name, batch, heads, q tokens, kv tokens, head dim
    ("SD self-attention 64x64", 32, 8, 4096, 4096, 40),
    ("SD cross-attention 64x64", 32, 8, 4096, 77, 40),
    ("SD self-attention 32x32", 32, 8, 1024, 1024, 80),
    ("SD self-attention 16x16", 32, 8, 256, 256, 160),
    ("DreamBooth self-attention 64x64", 2, 8, 4096, 4096, 40),
    ("head dim 64", 32, 8, 4096, 4096, 64),
]
RUNNERS = {
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "flash_attn4": lambda q, k, v: BACKENDS["flash_attn4"].run(q, k, v, None, None),
    "flash_attn4_padded": lambda q, k, v: BACKENDS["flash_attn4_padded"].run(q, k, v, None, None),
}
DEVICE = "cuda"
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def measure(name: str, batch: int, heads: int, q_tokens: int, kv_tokens: int, head_dim: int) -> dict:
    q_shape, kv_shape = (batch, heads, q_tokens, head_dim), (batch, heads, kv_tokens, head_dim)
    row = {"shape": name, "q_shape": list(q_shape), "kv_shape": list(kv_shape), "runners": {}}
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(s, device=DEVICE, generator=g, dtype=torch.bfloat16).requires_grad_()
               for s in (q_shape, kv_shape, kv_shape))
    grad = torch.randn(q_shape, device=DEVICE, generator=g, dtype=torch.bfloat16)
    row["sdpa_kernel"] = sdpa_choice(q, k, v)
    probe = GateProbe(q_shape, kv_shape, torch.bfloat16, DEVICE, False)
    row["probe"] = probe.summary()
    for runner, run in RUNNERS.items():
        result = {}
        try:
            result["errors"] = errors = probe.errors(lambda q, k, v, bias: run(q, k, v))
            result["over_allowed"] = [t for t, err in errors.items() if not err <= probe.allowed[t]]
            result["ms"] = event_ms(lambda: torch.autograd.grad(run(q, k, v), (q, k, v), grad), reps=20, warmup=3)
        except Exception as e:  # noqa: BLE001 - a runner that cannot take the shape is a finding, not the end
            result["error"] = _error_text(e)
        row["runners"][runner] = result
        ms = result.get("ms")
        log(f"{name}: {runner:<18} " + (f"{ms[0]:7.3f} ms [{ms[1]:.3f}-{ms[2]:.3f}]" if ms else "    -   ")
            + "  errors " + (", ".join(f"{t} {e:.2g}" for t, e in result.get("errors", {}).items())
                             or result.get("error", "")))
    del q, k, v, grad
    torch.cuda.empty_cache()
    selector = BackendSelector()
    try:
        chosen = selector.select(q_shape, torch.bfloat16, torch.device(DEVICE), False, kv_shape)
        key = next(iter(selector.cache))  # a fresh selector: this call's
        row["auto"] = {"backend": chosen, **{k: selector.cache[key][k] for k in ("timings_ms", "refused", "failed")}}
        log(f"{name}: auto picks {selector.chosen[key]}")
    except Exception as e:  # noqa: BLE001
        row["auto"] = {"error": _error_text(e)}
        log(f"{name}: auto failed: {row['auto']['error'].splitlines()[0]}")
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--shapes", help="comma list of shape numbers (1-based) to run; default all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_flash_attn_shapes: needs a CUDA GPU")
    if not BACKENDS["flash_attn4"].installed:
        raise SystemExit("bench_flash_attn_shapes: flash-attn-4 does not import here (benchmarks/gpu_flash_attn.sh "
                         "installs it, ci/install_flash_attn.sh elsewhere)")
    picked = SHAPES if not args.shapes else [SHAPES[int(i) - 1] for i in args.shapes.split(",")]
    report = {**result_header(), "command_via": os.environ.get("GALLERY_COMMAND"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "flash_attn_4": _version("flash-attn-4"), "nvidia_cutlass_dsl": _version("nvidia-cutlass-dsl-libs-base"),
              "dtype": "bfloat16", "shapes": []}
    for shape in picked:
        report["shapes"].append(measure(*shape))
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    log(f"wrote {args.out}")
    print(f"{'shape':<34} {'sdpa ms':>9} {'fa4 ms':>9} {'padded ms':>9}  {'fa4 dq err':>10} {'allowed':>8}  auto")
    for row in report["shapes"]:
        ms = [row["runners"][r].get("ms", [float("nan")])[0] for r in RUNNERS]
        dq = row["runners"]["flash_attn4"].get("errors", {}).get("dq", float("nan"))
        auto = row["auto"].get("backend") or row["auto"]["error"].splitlines()[0]
        print(f"{row['shape']:<34} {ms[0]:9.3f} {ms[1]:9.3f} {ms[2]:9.3f}  {dq:10.2g} "
              f"{row['probe']['allowed']['dq']:8.2g}  {auto}")


if __name__ == "__main__":
    main()
