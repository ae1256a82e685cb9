"""The optimizer and EMA update alone, on the SD-1.5 UNet's parameters: separate passes against one fused kernel.

    python benchmarks/bench_adamw_ema.py --out RESULT.json [--rounds 3 --steps 30]

Variants, each on its own copy of the weights with the same random gradients, in alternating rounds in one process
(CUDA events, median and p20/p80 of ``--steps`` after 5 of warm-up):

- ``adamw``: ``torch.optim.AdamW(fused=True)`` alone (what ``ema=off`` runs);
- ``adamw+fused_ema``: the same, then ``ModelEma(mode="fused")``, what ``accelerated`` ran before;
- ``adamw_with_ema``: ``AdamWWithEma`` with ``ModelEma(mode="optimizer")``, one kernel (``--blocks``: elements per
  program and warps, as ``BLOCK:WARPS``).

Then the weights, moments and EMA of the fused kernel are compared with the separate passes' after the same steps.
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
from gallery_lib.accel.adamw_ema import AdamWWithEma  # noqa: E402
from gallery_lib.accel.ema import ModelEma  # noqa: E402
from gallery_lib.accel.kernels import adamw_ema as kernel  # noqa: E402


def build(variant: str, block: tuple[int, int]):
    from gallery_lib.models.sd_parts import build_unet

    torch.manual_seed(0)
    unet = build_unet("sd15").cuda().to(memory_format=torch.channels_last)
    fused = variant == "adamw_with_ema"
    kernel._BLOCK, kernel._NUM_WARPS = block
    opt = (AdamWWithEma if fused else torch.optim.AdamW)(unet.parameters(), lr=1e-4, weight_decay=1e-2, fused=True)
    ema = None
    if variant != "adamw":
        ema = ModelEma(unet, decay=0.9999, ratio_warmup=True, mode="optimizer" if fused else "fused")
        if fused:
            ema.fuse_into(opt, unet)
    g = torch.Generator(device="cuda").manual_seed(1)
    for p in unet.parameters():
        p.grad = torch.empty_like(p).normal_(generator=g).mul_(1e-3)

    def step():
        opt.step()
        if ema is not None:
            ema.update(unet)
    return unet, opt, ema, step


def time_steps(step, steps: int) -> list[float]:
    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def quantiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=10)
    return {"median_ms": statistics.median(xs), "p20_ms": q[1], "p80_ms": q[7]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--blocks", default="1024:4,2048:8,4096:8")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    blocks = [tuple(int(x) for x in b.split(":")) for b in args.blocks.split(",")]
    variants = [("adamw", blocks[0]), ("adamw+fused_ema", blocks[0])] + [("adamw_with_ema", b) for b in blocks]
    results: dict[str, list] = {f"{v} block {b[0]}x{b[1]} warps" if v == "adamw_with_ema" else v: []
                                for v, b in variants}
    for round_ in range(args.rounds):
        for (variant, block), name in zip(variants, results):
            unet, opt, ema, step = build(variant, block)
            times = time_steps(step, args.steps)
            results[name].append(quantiles(times))
            print(f"[bench_adamw_ema] round {round_} {name:28s} {results[name][-1]['median_ms']:7.3f} ms", flush=True)
            del unet, opt, ema, step
            torch.cuda.empty_cache()

    # Agreement after 3 steps from the same start: the fused kernel against the separate passes.
    states = {}
    for variant in ("adamw+fused_ema", "adamw_with_ema"):
        unet, opt, ema, step = build(variant, blocks[0])
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        states[variant] = (list(unet.parameters()), [opt.state[p]["exp_avg_sq"] for p in unet.parameters()],
                           list(ema.module.parameters()))
    diffs = {what: max((a - b).abs().max().item() for a, b in zip(x, y))
             for what, x, y in zip(("weights", "exp_avg_sq", "ema"), states["adamw+fused_ema"], states["adamw_with_ema"])}
    record = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "parameters": sum(p.numel() for p in states["adamw_with_ema"][0]),
              "rounds": results, "max_abs_difference_after_3_steps": diffs}
    print(json.dumps(diffs), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
