"""The optimizer's part of the SD-1.5 step: gradient clipping then fused AdamW, against the clipping folded into the
fused step (``gallery_lib.accel.precision.step_with_clipped_grads``), on the UNet's 860M fp32 parameters.

    python benchmarks/bench_clip_step.py --out RESULT.json [--steps 30 --rounds 3]

Random gradients, channels_last conv weights as the accelerated recipe has them; CUDA-event time of each variant's
update, the variants alternating within each round, median and p20/p80 over ``--steps`` updates after 5 warm-ups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gallery_lib.accel.precision import step_with_clipped_grads  # noqa: E402
from gallery_lib.models.sd_parts import build_unet  # noqa: E402

MAX_NORM = 1.0  # the SD family's clip_grad


def clip_then_step(optimizer, params, grads):
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
    optimizer.step()


def folded(optimizer, params, grads):
    step_with_clipped_grads(optimizer, grads, MAX_NORM)


def time_updates(update, optimizer, params, grads, steps: int) -> list[float]:
    times = []
    for i in range(steps + 5):
        for p, g in zip(params, grads):
            p.grad = g
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        update(optimizer, params, grads)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    unet = build_unet("sd15").cuda().to(memory_format=torch.channels_last)
    params = [p for p in unet.parameters() if p.requires_grad]
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(p.shape, device="cuda", generator=gen).to(memory_format=torch.channels_last)
             if p.dim() == 4 else torch.randn(p.shape, device="cuda", generator=gen) for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-2, fused=True)
    variants = {"clip_grad_norm_ then fused AdamW": clip_then_step, "clipping folded into fused AdamW": folded}
    rows = []
    for round_ in range(args.rounds):
        for name, update in variants.items():
            times = sorted(time_updates(update, optimizer, params, grads, args.steps))
            q = statistics.quantiles(times, n=5)
            rows.append({"round": round_, "variant": name, "median_ms": statistics.median(times),
                         "p20_ms": q[0], "p80_ms": q[3]})
            print(f"[bench_clip_step] round {round_} {name:34s} {rows[-1]['median_ms']:.2f} ms "
                  f"[{q[0]:.2f}-{q[3]:.2f}]", flush=True)
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "parameters": sum(p.numel() for p in params), "tensors": len(params), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
