"""Benchmark the fused kernels against eager PyTorch and torch.compile at SD-1.x and Swin-T shapes (one GPU).

First measures device-to-device copy bandwidth (read + written bytes), then, per op and shape, times the training
forward (inputs require grad) and the backward (``torch.autograd.grad(out, leaves, grad, retain_graph=True)``: no
accumulation into ``.grad``) of (a) the eager PyTorch reference, (b) ``torch.compile`` of that reference and (c) our
kernel, two ways:

* ``gpu_ms``, the number that decides: GPU time without host overhead. The calls are captured in one CUDA graph
  and the graph's replays are timed with CUDA events (median over replays, divided by the calls per graph). In a
  training step the GPU runs behind the CPU, and inside a compiled graph our ops run without their Python wrapper,
  so the host's per-call cost is hidden there. The graph cycles through enough independent input sets to
  stream at least twice the L2 cache between two uses of one set, so small shapes read DRAM as they do in a step
  (and as the copy does), not a warm L2. Where capture fails, ``gpu_ms`` falls back to ``call_ms`` and
  ``gpu_ms_method`` says so.
* ``call_ms``: ``triton.testing.do_bench`` of one call (median, L2 flushed before each call), host overhead included:
  Python, autograd and dispatch. Kept for honesty; ``median_ms`` repeats it under the field name of v1/v2 results.

``bytes`` is the least an op must move, counted from gpu_ms into ``gb_per_s`` and ``fraction_of_copy_bw``: every
activation input read once and every activation output written once (forward ``x -> y``, backward ``x, dy -> dx``;
GEGLU and the loss alike). Saved statistics (8 bytes per row or group) are left out: a kernel could recompute
them. The per-channel weight/bias read and gradient write (``param_bytes``, fp32) are added only when they reach 1%
of the activation bytes, which no benchmarked shape does; they are reported either way.

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h200_v3.json [--dtype bf16] [--ops gn,ln]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from gallery_lib.accel.kernels import geglu, group_norm, layer_norm, soft_cross_entropy
from gallery_lib.reports.provenance import result_header

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVIDERS = ("eager", "compiled", "ours")
MODES = ("forward", "backward")
PARAM_BYTES_THRESHOLD = 0.01  # param_bytes count towards `bytes` from this fraction of the activation bytes on

Call = Callable[[], object]
MakeCalls = Callable[[int], list[Call]]  # n -> one call per independent input set


@dataclass
class Case:
    op: str
    label: str
    make: Callable[[torch.dtype, str], tuple[list[torch.Tensor], torch.Tensor]]  # (dtype, device) -> inputs, dy
    reference: Callable[..., torch.Tensor]
    ours: Callable[..., torch.Tensor]
    fwd_bytes: int
    bwd_bytes: int
    n_grad_inputs: int = 3  # leading inputs that get gradients (CE: the logits only, not the targets)
    fwd_param_bytes: int = 0  # fp32 weight + bias read
    bwd_param_bytes: int = 0  # fp32 weight + bias read, their gradients written

    def bytes(self, mode: str) -> tuple[int, int]:
        """(bytes counted for ``mode``, param_bytes): see the module docstring."""
        act, param = (self.fwd_bytes, self.fwd_param_bytes) if mode == "forward" else (self.bwd_bytes,
                                                                                        self.bwd_param_bytes)
        return act + (param if param >= PARAM_BYTES_THRESHOLD * act else 0), param


def _esize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _gn_case(n: int, c: int, hw: int, channels_last: bool, dtype: torch.dtype) -> Case:
    numel, es = n * c * hw * hw, _esize(dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def make(dt, device):
        x = torch.randn(n, c, hw, hw, device=device, dtype=dt).to(memory_format=fmt)
        w, b = torch.randn(c, device=device), torch.randn(c, device=device)
        return [x, w, b], torch.randn_like(x)

    return Case("group_norm_silu", f"{n}x{c}x{hw}x{hw}{' NHWC' if channels_last else ''}", make,
                lambda x, w, b: F.silu(F.group_norm(x, 32, w.to(x.dtype), b.to(x.dtype), 1e-5)),
                lambda x, w, b: group_norm(x, 32, w, b, 1e-5, "silu"),
                fwd_bytes=2 * numel * es, bwd_bytes=3 * numel * es, fwd_param_bytes=8 * c, bwd_param_bytes=16 * c)


def _ln_case(rows: int, d: int, dtype: torch.dtype) -> Case:
    es = _esize(dtype)

    def make(dt, device):
        x = torch.randn(rows, d, device=device, dtype=dt)
        return [x, torch.randn(d, device=device), torch.randn(d, device=device)], torch.randn_like(x)

    return Case("layer_norm", f"{rows}x{d}", make,
                lambda x, w, b: F.layer_norm(x, (d,), w.to(x.dtype), b.to(x.dtype)),
                lambda x, w, b: layer_norm(x, w, b), fwd_bytes=2 * rows * d * es, bwd_bytes=3 * rows * d * es,
                fwd_param_bytes=8 * d, bwd_param_bytes=16 * d)


def _geglu_reference(h: torch.Tensor) -> torch.Tensor:
    value, gate = h.chunk(2, dim=-1)
    return value * F.gelu(gate)


def _geglu_case(rows: int, d: int, dtype: torch.dtype) -> Case:
    es = _esize(dtype)

    def make(dt, device):
        h = torch.randn(rows, 2 * d, device=device, dtype=dt)
        return [h], torch.randn(rows, d, device=device, dtype=dt)

    return Case("geglu", f"{rows}x{2 * d}", make, _geglu_reference, geglu,
                fwd_bytes=3 * rows * d * es, bwd_bytes=5 * rows * d * es, n_grad_inputs=1)


def _ce_case(n: int, v: int, dtype: torch.dtype) -> Case:
    es = _esize(dtype)

    def make(dt, device):
        logits = torch.randn(n, v, device=device, dtype=dt)
        target = torch.softmax(torch.randn(n, v, device=device), -1).to(dt)
        return [logits, target], torch.tensor(1.0, device=device, dtype=dt)

    return Case("soft_cross_entropy", f"{n}x{v}", make,
                lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
                lambda x, t: soft_cross_entropy(x, t, 0.1), fwd_bytes=2 * n * v * es, bwd_bytes=3 * n * v * es,
                n_grad_inputs=1)


def build_cases(dtype: torch.dtype, ops: set[str]) -> list[Case]:
    cases = []
    if "gn" in ops:  # SD-1.x UNet ResNet blocks at 512 px (32 groups): batch 8, then the recipe's batch 32
        cases += [_gn_case(8, 320, 64, False, dtype), _gn_case(8, 320, 64, True, dtype),
                  _gn_case(8, 640, 32, False, dtype), _gn_case(8, 1280, 16, False, dtype),
                  _gn_case(8, 1280, 8, True, dtype),
                  _gn_case(32, 320, 64, False, dtype), _gn_case(32, 320, 64, True, dtype),
                  _gn_case(32, 640, 32, True, dtype), _gn_case(32, 1280, 16, True, dtype),
                  _gn_case(32, 1280, 8, True, dtype)]
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


def input_sets(nbytes: int, l2_bytes: int, cap: int = 256) -> int:
    """Input sets a graph cycles through so that 2x the L2 cache streams between two uses of one set."""
    return max(1, min(cap, 1 + math.ceil(2 * l2_bytes / max(1, nbytes))))


def make_calls(case: Case, fn: Callable[..., torch.Tensor], mode: str, dtype: torch.dtype, device: str) -> MakeCalls:
    """Builds ``n`` fresh input sets (and, for backward, their forward graphs) and returns one call per set.

    The forward runs when the calls are built, on the caller's current stream: backward ops run on the stream of
    their forward, so a CUDA graph timer must build them on its capture stream.
    """

    def build(n: int) -> list[Call]:
        calls = []
        for _ in range(n):
            inputs, grad = case.make(dtype, device)
            leaves = [t.requires_grad_() for t in inputs[:case.n_grad_inputs]]
            if mode == "forward":
                calls.append(functools.partial(fn, *inputs))
            else:
                calls.append(functools.partial(torch.autograd.grad, fn(*inputs), leaves, grad, retain_graph=True))
        return calls

    return build


def cuda_graph_ms(build: MakeCalls, n_sets: int, target_ms: float = 10.0, max_calls: int = 1000,
                  replays: int = 25) -> float:
    """GPU ms per call: median over ``replays`` of one CUDA graph running the calls round-robin, no host overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        calls = build(n_sets)
        for call in calls:  # warm-up on the capture stream (allocator, autograd, lazy compiles)
            call()
        start.record()
        for call in calls:
            call()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / len(calls), 1e-4)  # host-bound, so an upper bound
        rounds = max(1, min(round(target_ms / estimate), max_calls) // len(calls))
        n_calls = rounds * len(calls)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(n_calls):
                calls[i % len(calls)]()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n_calls)
    return statistics.median(times)


@dataclass
class Timers:
    """The two clocks: host-inclusive ``call_ms(call)`` and GPU-only ``gpu_ms(build, n_sets)`` (tests fake both)."""

    call_ms: Callable[[Call], float]
    gpu_ms: Callable[[MakeCalls, int], float]
    gpu_method: str = "cudagraph"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_case(case: Case, dtype: torch.dtype, timers: Timers, copy_gbs: float, l2_bytes: int,
              providers: Sequence[str] = PROVIDERS, device: str = "cuda") -> list[dict]:
    """One row per (provider, mode) of ``case``; see the module docstring for the fields."""
    rows = []
    for provider in providers:
        fn = torch.compile(case.reference, dynamic=False) if provider == "compiled" else (
            case.ours if provider == "ours" else case.reference)
        t0 = time.perf_counter()
        make_calls(case, fn, "backward", dtype, device)(1)[0]()  # compile / autotune / JIT, excluded from timing
        _sync(device)
        warm_s = time.perf_counter() - t0
        for mode in MODES:
            build = make_calls(case, fn, mode, dtype, device)
            nbytes, param_bytes = case.bytes(mode)
            call_ms = timers.call_ms(build(1)[0])
            n_sets = input_sets(nbytes, l2_bytes)
            try:
                gpu_ms, method, note = timers.gpu_ms(build, n_sets), timers.gpu_method, None
            except Exception as e:  # e.g. a provider that cannot be captured: keep the row, say how it was timed
                _sync(device)
                gpu_ms, method, note = call_ms, "do_bench", f"{timers.gpu_method} failed: {type(e).__name__}: {e}"
            gbs = nbytes / gpu_ms / 1e6
            row = dict(op=case.op, shape=case.label, provider=provider, mode=mode, gpu_ms=gpu_ms,
                       gpu_ms_method=method, call_ms=call_ms, median_ms=call_ms, bytes=nbytes,
                       param_bytes=param_bytes, gb_per_s=gbs, fraction_of_copy_bw=gbs / copy_gbs,
                       input_sets=n_sets, warmup_s=warm_s)
            if note:
                row["gpu_ms_note"] = note[:300]
            rows.append(row)
    return rows


def format_rows(rows: list[dict], providers: Sequence[str]) -> list[str]:
    """Compact table lines of one case: per provider GPU ms, its fraction of copy bandwidth and the per-call ms."""
    by = {(r["provider"], r["mode"]): r for r in rows}
    lines = []
    for mode in MODES:
        cells = []
        for p in providers:
            r = by[p, mode]
            mark = "" if r["gpu_ms_method"] != "do_bench" else "*"
            cells.append(f"{r['gpu_ms']:8.4f}{mark:1s} {r['fraction_of_copy_bw']:4.0%} {r['call_ms']:8.4f}")
        lines.append(f"{rows[0]['op']:18s} {rows[0]['shape']:20s} {mode[:3]:3s} | " + " | ".join(cells))
    return lines


def table_header(providers: Sequence[str]) -> str:
    cells = [f"{p + ' gpu ms':>9s} {'bw':>4s} {'call ms':>8s}" for p in providers]
    return f"{'op':18s} {'shape':20s} {'':3s} | " + " | ".join(cells)


def copy_bandwidth(do_bench: Callable[..., float]) -> float:
    """Device-to-device copy of 1 GiB, counting read + written bytes; GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (required)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default: bf16)")
    parser.add_argument("--ops", default="gn,ln,geglu,ce", help="comma list of gn,ln,geglu,ce (default: all)")
    parser.add_argument("--providers", default=",".join(PROVIDERS),
                        help="comma list of eager,compiled,ours (default: all three)")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per call_ms (default: 200)")
    parser.add_argument("--graph-ms", type=float, default=10.0,
                        help="GPU time of one CUDA graph replay for gpu_ms (default: 10)")
    parser.add_argument("--replays", type=int, default=25, help="timed graph replays per gpu_ms (default: 25)")
    parser.add_argument("--note", default="", help="free text stored in the JSON (default: empty)")
    args = parser.parse_args(argv)
    if not set(args.providers.split(",")) <= set(PROVIDERS):
        parser.error(f"--providers takes eager, compiled, ours; got {args.providers!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    providers = tuple(args.providers.split(","))
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    import triton
    from triton.testing import do_bench

    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per benchmarked shape
    bench = lambda fn: do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median")  # noqa: E731
    graph = functools.partial(cuda_graph_ms, target_ms=args.graph_ms, replays=args.replays)
    timers = Timers(call_ms=bench, gpu_ms=graph)
    dtype = DTYPES[args.dtype]
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    copy_gbs = copy_bandwidth(bench)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s (read + write), "
          f"L2 {l2_bytes >> 20} MiB; gpu ms: CUDA graph replay (* = capture failed, per-call time), bw from gpu ms")
    print(table_header(providers))
    results = []
    for case in build_cases(dtype, set(args.ops.split(","))):
        rows = time_case(case, dtype, timers, copy_gbs, l2_bytes, providers)
        results += rows
        print("\n".join(format_rows(rows, providers)), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(**result_header(), note=args.note, gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__, dtype=args.dtype,
                       copy_bandwidth_gb_per_s=copy_gbs, l2_cache_bytes=l2_bytes,
                       timing=dict(gpu_ms=f"CUDA graph replays, {args.graph_ms} ms each, median of {args.replays}",
                                   call_ms=f"triton do_bench median, rep {args.rep_ms} ms"),
                       results=results), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
