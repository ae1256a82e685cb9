"""Where the SD-1.5 UNet's training step spends its GPU time: kernel time by kind, from torch.profiler.

    python benchmarks/archive/profile_sd_step.py --batch 32 --out RESULT.json

The question is which levers could make the step at batch 32 faster than plain ``torch.compile``; this says where the
time is before choosing one. The step is ``bench_sd_float8.py``'s bf16 variant (random SD-1.5 UNet, bf16 autocast,
fused AdamW, blocks compiled as the gallery compiles them). After warm-up, ``--steps`` steps run under the profiler;
every CUDA kernel's time is summed by kind (convolution, matmul, attention, Inductor's Triton kernels, normalization,
optimizer, copies, other), with the 25 costliest kernels by name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sd_float8 import build, make_step  # noqa: E402 - the same step the FP8 comparison times

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gallery_lib.run.profiling import kernel_table  # noqa: E402 - the kinds `profile_steps` sums by too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    unet, opt, _ = build("bf16")
    step = make_step(unet, opt, args.batch)
    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start

    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
              "warmup_s": warmup_s, **kernel_table(prof, args.steps, "cuda")}
    total = result["kernel_ms_per_step"]
    for kind, ms in result["by_kind_ms"].items():
        print(f"[profile_sd_step] {kind:28s} {ms:7.1f} ms/step  {100 * ms / total:5.1f}%", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
