"""The fused BatchNorm(+residual, +ReLU) kernel against PyTorch at ResNet-50's 53 batch-norm shapes, forward + backward.

For each shape (batch 256, bf16, channels_last, fp32 weights): the kernel (`gallery_lib.accel.kernels.batch_norm_act`,
eager launches) under a few plans, PyTorch eager (cuDNN's batch norm, then the add and ReLU) and ``torch.compile`` of
the same function (Inductor's batch-norm fusions, as a compiled ResNet runs them). CUDA-event medians; totals weigh
each shape by how often ResNet-50 has it.

    python benchmarks/bench_batch_norm.py --out results.json [--no-compiled] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import batch_norm as bn

# (channels, resolution, how many in ResNet-50, residual add, ReLU): the stem, then per stage the first block's
# wider conv1 output, the 3x3 outputs, the residual norms and the shortcut's norm.
RESNET50 = [(64, 112, 1, False, True),
            (64, 56, 6, False, True), (256, 56, 3, True, True), (256, 56, 1, False, False),
            (128, 56, 1, False, True), (128, 28, 7, False, True), (512, 28, 4, True, True), (512, 28, 1, False, False),
            (256, 28, 1, False, True), (256, 14, 11, False, True), (1024, 14, 6, True, True),
            (1024, 14, 1, False, False),
            (512, 14, 1, False, True), (512, 7, 5, False, True), (2048, 7, 3, True, True), (2048, 7, 1, False, False)]

# (channels per program, largest tile in elements, programs per SM)
PLANS = [(64, 4096, 4), (128, 4096, 4), (64, 8192, 4), (64, 2048, 4), (64, 4096, 8), (32, 2048, 4), (128, 8192, 2)]


def torch_fn(x, w, b, rm, rv, r, relu):
    y = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    if r is not None:
        y = y + r
    return F.relu(y) if relu else y


def time_ms(fn, warmup=5, iters=25) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def fwd_bwd(call, x, dy):
    def step():
        x.grad = None
        call().backward(dy)
    return step


def bytes_moved(n, c, hw, residual, relu) -> int:
    """The kernel's DRAM traffic in bf16: forward reads x twice, the residual once, writes y; backward reads x and
    dy twice (y twice when its mask comes from it), writes dx (and the residual's gradient)."""
    elems = n * c * hw * hw
    mask_y = residual and relu
    return 2 * elems * ((3 + residual) + (5 + 2 * mask_y + residual))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--no-compiled", action="store_true", help="skip torch.compile (its compiles take minutes)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows, totals = [], {}
    for c, hw, count, residual, relu in RESNET50:
        gen = torch.Generator(device=dev).manual_seed(0)
        cl = dict(memory_format=torch.channels_last)
        shape = (args.batch, c, hw, hw)
        x = torch.randn(shape, device=dev, generator=gen).to(torch.bfloat16).to(**cl).requires_grad_()
        dy = torch.randn(shape, device=dev, generator=gen).to(torch.bfloat16).to(**cl)
        r = torch.randn(shape, device=dev, generator=gen).to(torch.bfloat16).to(**cl) if residual else None
        w = torch.ones(c, device=dev, requires_grad=True)
        b = torch.zeros(c, device=dev, requires_grad=True)
        rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
        row = dict(channels=c, resolution=hw, count=count, residual=residual, relu=relu,
                   gbytes=bytes_moved(args.batch, c, hw, residual, relu) / 1e9)
        for plan in PLANS:
            bn._BLOCK_CHANNELS, tu.MAX_BLOCK, bn._PROGRAMS_PER_SM = plan
            bn._cached_plan.cache_clear()
            ms = statistics.median(time_ms(fwd_bwd(lambda: bn.batch_norm_act(x, w, b, 1e-5, r, relu)[0], x, dy)))
            row[f"ours_{plan[0]}x{plan[1]}x{plan[2]}_ms"] = ms
        row["torch_eager_ms"] = statistics.median(time_ms(fwd_bwd(lambda: torch_fn(x, w, b, rm, rv, r, relu), x, dy)))
        if not args.no_compiled:
            compiled = torch.compile(torch_fn, dynamic=False)
            t0 = time.perf_counter()
            row["torch_compile_ms"] = statistics.median(time_ms(fwd_bwd(lambda: compiled(x, w, b, rm, rv, r, relu),
                                                                        x, dy)))
            row["compile_s"] = time.perf_counter() - t0
        for key, value in row.items():
            if key.endswith("_ms"):
                totals[key] = totals.get(key, 0.0) + value * count
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = min((k for k in totals if k.startswith("ours")), key=totals.get)
    summary = {"totals_ms_per_step": totals, "best_plan": best, "gbytes_per_step": sum(r["gbytes"] * r["count"]
                                                                                       for r in rows)}
    summary["best_plan_tb_per_s"] = summary["gbytes_per_step"] / totals[best]
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows, **summary}, fh, indent=1)


if __name__ == "__main__":
    main()
