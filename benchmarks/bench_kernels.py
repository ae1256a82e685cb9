"""Benchmark the fused kernels against eager PyTorch and torch.compile at SD-1.x and Swin-T shapes (one GPU).

First measures device-to-device copy bandwidth (read + written bytes), then, per op and shape, times forward and
backward of (a) the eager PyTorch reference, (b) ``torch.compile`` of that reference and (c) our kernel with
``triton.testing.do_bench`` (median after warm-up; compile time is excluded by a warm-up call). Reports the bytes
each op must move at minimum, the achieved GB/s and the fraction of the measured copy bandwidth, and writes JSON.

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h100.json [--dtype bf16] [--ops gn,ln]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from gallery_lib.kernels import geglu, group_norm, layer_norm, soft_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    op: str
    label: str
    make: Callable[[torch.dtype], tuple[list[torch.Tensor], torch.Tensor]]  # -> (inputs, upstream grad)
    reference: Callable[..., torch.Tensor]
    ours: Callable[..., torch.Tensor]
    fwd_bytes: int
    bwd_bytes: int
    n_grad_inputs: int = 3  # leading inputs that get gradients (CE: the logits only, not the targets)


def _gn_case(n: int, c: int, hw: int, channels_last: bool, dtype: torch.dtype) -> Case:
    es = torch.finfo(dtype).bits // 8
    numel = n * c * hw * hw
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def make(dt):
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=dt).to(memory_format=fmt)
        w, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
        return [x, w, b], torch.randn_like(x)

    return Case("group_norm_silu", f"{n}x{c}x{hw}x{hw}{' NHWC' if channels_last else ''}", make,
                lambda x, w, b: F.silu(F.group_norm(x, 32, w.to(x.dtype), b.to(x.dtype), 1e-5)),
                lambda x, w, b: group_norm(x, 32, w, b, 1e-5, "silu"),
                fwd_bytes=2 * numel * es, bwd_bytes=3 * numel * es)


def _ln_case(rows: int, d: int, dtype: torch.dtype) -> Case:
    es = torch.finfo(dtype).bits // 8

    def make(dt):
        x = torch.randn(rows, d, device="cuda", dtype=dt)
        return [x, torch.randn(d, device="cuda"), torch.randn(d, device="cuda")], torch.randn_like(x)

    return Case("layer_norm", f"{rows}x{d}", make,
                lambda x, w, b: F.layer_norm(x, (d,), w.to(x.dtype), b.to(x.dtype)),
                lambda x, w, b: layer_norm(x, w, b), fwd_bytes=2 * rows * d * es, bwd_bytes=3 * rows * d * es)


def _geglu_case(rows: int, d: int, dtype: torch.dtype) -> Case:
    es = torch.finfo(dtype).bits // 8

    def make(dt):
        h = torch.randn(rows, 2 * d, device="cuda", dtype=dt)
        return [h], torch.randn(rows, d, device="cuda", dtype=dt)

    def reference(h):
        value, gate = h.chunk(2, dim=-1)
        return value * F.gelu(gate)

    return Case("geglu", f"{rows}x{2 * d}", make, reference, geglu,
                fwd_bytes=3 * rows * d * es, bwd_bytes=5 * rows * d * es)


def _ce_case(n: int, v: int, dtype: torch.dtype) -> Case:
    es = torch.finfo(dtype).bits // 8

    def make(dt):
        logits = torch.randn(n, v, device="cuda", dtype=dt)
        target = torch.softmax(torch.randn(n, v, device="cuda"), -1).to(dt)
        return [logits, target], torch.tensor(1.0, device="cuda")

    return Case("soft_cross_entropy", f"{n}x{v}", make,
                lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
                lambda x, t: soft_cross_entropy(x, t, 0.1), fwd_bytes=2 * n * v * es, bwd_bytes=3 * n * v * es,
                n_grad_inputs=1)


def build_cases(dtype: torch.dtype, ops: set[str]) -> list[Case]:
    cases = []
    if "gn" in ops:  # SD-1.x UNet ResNet blocks at 512 px, batch 8 (32 groups)
        cases += [_gn_case(8, 320, 64, False, dtype), _gn_case(8, 320, 64, True, dtype),
                  _gn_case(8, 640, 32, False, dtype), _gn_case(8, 1280, 16, False, dtype),
                  _gn_case(8, 1280, 8, True, dtype)]
    if "ln" in ops:  # Swin-T stages at batch 128, then SD transformer widths at batch 8
        cases += [_ln_case(128 * 56 * 56, 96, dtype), _ln_case(128 * 28 * 28, 192, dtype),
                  _ln_case(128 * 14 * 14, 384, dtype), _ln_case(128 * 7 * 7, 768, dtype),
                  _ln_case(8 * 4096, 320, dtype), _ln_case(8 * 256, 1280, dtype)]
    if "geglu" in ops:  # SD FeedForward inner width 4x: tokens x 2*(4*C)
        cases += [_geglu_case(8 * 4096, 1280, dtype), _geglu_case(8 * 1024, 2560, dtype),
                  _geglu_case(8 * 256, 5120, dtype)]
    if "ce" in ops:  # ImageNet-1k Mixup targets, Swin-T / ResNet-50 batch sizes
        cases += [_ce_case(128, 1000, dtype), _ce_case(256, 1000, dtype)]
    return cases


def copy_bandwidth(do_bench: Callable[..., float]) -> float:
    """Device-to-device copy of 1 GiB, counting read + written bytes; GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def time_case(case: Case, dtype: torch.dtype, do_bench: Callable[..., float], copy_gbs: float,
              providers: tuple[str, ...] = ("eager", "compiled", "ours")) -> list[dict]:
    fns = dict(eager=case.reference, compiled=torch.compile(case.reference, dynamic=False), ours=case.ours)
    rows = []
    for provider in providers:
        fn = fns[provider]
        inputs, grad = case.make(dtype)
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(*inputs)  # warm-up: compile / autotune / Triton JIT, excluded from the timing
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        with torch.no_grad():
            fwd_ms = do_bench(lambda: fn(*inputs))
        leaves = [t.requires_grad_() for t in inputs[:case.n_grad_inputs]]
        out = fn(*inputs)
        out.backward(grad, retain_graph=True)
        torch.cuda.synchronize()
        bwd_ms = do_bench(lambda: out.backward(grad, retain_graph=True), grad_to_none=leaves)
        for mode, ms, nbytes in (("forward", fwd_ms, case.fwd_bytes), ("backward", bwd_ms, case.bwd_bytes)):
            gbs = nbytes / ms / 1e6
            rows.append(dict(op=case.op, shape=case.label, provider=provider, mode=mode, median_ms=ms,
                             bytes=nbytes, gb_per_s=gbs, fraction_of_copy_bw=gbs / copy_gbs,
                             warmup_s=warm_s))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (default: none, required)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default: bf16)")
    parser.add_argument("--ops", default="gn,ln,geglu,ce", help="comma list of gn,ln,geglu,ce (default: all)")
    parser.add_argument("--providers", default="eager,compiled,ours",
                        help="comma list of eager,compiled,ours (default: all three)")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per timing (default: 200)")
    args = parser.parse_args(argv)
    providers = tuple(args.providers.split(","))
    if not set(providers) <= {"eager", "compiled", "ours"}:
        parser.error(f"--providers takes eager, compiled, ours; got {args.providers!r}")
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    import triton
    from triton.testing import do_bench

    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per benchmarked shape
    bench = lambda fn, **kw: do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median", **kw)  # noqa: E731
    dtype = DTYPES[args.dtype]
    copy_gbs = copy_bandwidth(bench)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (read + write)")
    results = []
    for case in build_cases(dtype, set(args.ops.split(","))):
        rows = time_case(case, dtype, bench, copy_gbs, providers)
        results += rows
        by = {(r["provider"], r["mode"]): r for r in rows}
        for mode in ("forward", "backward"):
            cells = [f"{p} {by[p, mode]['median_ms']:.4f} ms ({by[p, mode]['fraction_of_copy_bw']:.0%} of copy bw)"
                     for p in reversed(providers)]
            print(f"{case.op:20s} {case.label:22s} {mode:8s} " + " | ".join(cells), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join([sys.executable, *sys.argv]), gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__, dtype=args.dtype,
                       copy_bandwidth_gb_per_s=copy_gbs, results=results), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
