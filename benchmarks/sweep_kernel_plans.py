"""Time launch plans of the LayerNorm, GEGLU and cross-entropy kernels against torch.compile (bench_kernels shapes).

A launch plan is a kernel module's knobs (tile elements per program, programs per SM, warps): the same kernel
source, launched differently. For every benchmarked shape and direction this script times ``torch.compile`` of the
PyTorch reference once, then our kernel under each plan, all with `bench_kernels.cuda_graph_ms` (CUDA-graph
replays, cold L2) in one process, and reports the fastest plan next to the compiled time. The winners become the
modules' defaults; the JSON keeps every plan's time so the choice can be checked.

    python benchmarks/sweep_kernel_plans.py --out benchmarks/results/kernel_plans_h100_v2.json [--ops ln,geglu,ce]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import itertools
import json
import sys
import time
from types import ModuleType
from typing import Iterator

import torch

import bench_kernels as bk
from gallery_lib.reports.provenance import result_header
# The modules, not the functions of the same name that gallery_lib.accel.kernels re-exports.
ln_mod = importlib.import_module("gallery_lib.accel.kernels.layer_norm")
geglu_mod = importlib.import_module("gallery_lib.accel.kernels.geglu")
ce_mod = importlib.import_module("gallery_lib.accel.kernels.cross_entropy")

# Knob grids per (op, mode): every combination is one plan. Warps of None means the module's own rule.
GRIDS: dict[tuple[str, str], tuple[ModuleType, dict[str, tuple]]] = {
    ("layer_norm", "forward"): (ln_mod, {"FWD_TILE": (2048, 4096, 8192), "FWD_WARPS": (None, 2, 4),
                                         "FWD_EVICT_FIRST": (None, False, True)}),
    ("layer_norm", "backward"): (ln_mod, {"BWD_TILE": (2048, 4096), "BWD_PROGRAMS_PER_SM": (1, 2, 3),
                                          "BWD_WARPS": (None, 4, 8)}),
    ("geglu", "forward"): (geglu_mod, {"TILE": (2048, 4096, 8192), "MAX_COLS": (256, 1024), "WARPS": (None, 8),
                                       "FWD_EVICT_FIRST": (None, False, True)}),
    ("geglu", "backward"): (geglu_mod, {"TILE": (2048, 4096, 8192), "MAX_COLS": (256, 1024), "WARPS": (None, 8)}),
    ("soft_cross_entropy", "forward"): (ce_mod, {"FWD_WARPS": (None, 1, 2, 4, 8)}),
    ("soft_cross_entropy", "backward"): (ce_mod, {"BWD_WARPS": (None, 1, 2, 4, 8)}),
}
OPS = {"ln": "layer_norm", "geglu": "geglu", "ce": "soft_cross_entropy"}


@contextlib.contextmanager
def knobs(module: ModuleType, **values) -> Iterator[None]:
    """Sets module-level launch knobs for the duration of the block."""
    previous = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


def plans(grid: dict[str, tuple]) -> list[dict]:
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def sweep_case(case: bk.Case, dtype: torch.dtype, timer, l2_bytes: int, copy_gbs: float, device: str = "cuda",
               compile_fn=functools.partial(torch.compile, dynamic=False), grids=GRIDS) -> list[dict]:
    """One row per mode of ``case``: compiled time, the committed defaults' time, every plan's time, the best."""
    rows = []
    compiled = compile_fn(case.reference)
    for mode in bk.MODES:
        module, grid = grids[case.op, mode]
        nbytes, _ = case.bytes(mode)
        n_sets = bk.input_sets(nbytes, l2_bytes)
        build = bk.make_calls(case, compiled, mode, dtype, device)
        build(1)[0]()  # compile outside the timing
        compiled_ms = timer(build, n_sets)
        build_ours = bk.make_calls(case, case.ours, mode, dtype, device)  # the kernels read the knobs per launch
        default_ms = timer(build_ours, n_sets)
        timed = []
        for plan in plans(grid):
            with knobs(module, **plan):
                try:
                    ms = timer(build_ours, n_sets)
                except Exception as e:  # e.g. a tile that runs out of registers or shared memory
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    timed.append(dict(plan=plan, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
            timed.append(dict(plan=plan, gpu_ms=ms))
        best = min((t for t in timed if "gpu_ms" in t), key=lambda t: t["gpu_ms"])
        row = dict(op=case.op, shape=case.label, mode=mode, bytes=nbytes, compiled_ms=compiled_ms,
                   default_ms=default_ms, best_plan=best["plan"], best_ms=best["gpu_ms"],
                   best_vs_compiled=best["gpu_ms"] / compiled_ms,
                   best_fraction_of_copy_bw=nbytes / best["gpu_ms"] / 1e6 / copy_gbs, plans=timed)
        rows.append(row)
        print(f"{case.op:10s} {case.label:14s} {mode[:3]} compiled {compiled_ms * 1e3:7.1f} us | default "
              f"{default_ms * 1e3:7.1f} us | best {best['gpu_ms'] * 1e3:7.1f} us "
              f"({row['best_fraction_of_copy_bw']:4.0%} bw, {row['best_vs_compiled']:.2f}x compiled) {best['plan']}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (required)")
    parser.add_argument("--ops", default="ln,geglu,ce", help="comma list of ln,geglu,ce (default: all)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(bk.DTYPES), help="input dtype (default: bf16)")
    parser.add_argument("--graph-ms", type=float, default=5.0, help="GPU time per graph replay (default: 5)")
    parser.add_argument("--replays", type=int, default=15, help="timed replays per plan (default: 15)")
    args = parser.parse_args(argv)
    unknown = set(args.ops.split(",")) - set(OPS)
    if unknown:
        parser.error(f"--ops takes {', '.join(OPS)}; got {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        sys.exit("sweep_kernel_plans.py needs a CUDA GPU")
    from triton.testing import do_bench

    torch._dynamo.config.cache_size_limit = 64
    dtype = bk.DTYPES[args.dtype]
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    copy_gbs = bk.copy_bandwidth(lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median"))
    timer = functools.partial(bk.cuda_graph_ms, target_ms=args.graph_ms, replays=args.replays)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s, L2 {l2_bytes >> 20} MiB", flush=True)
    t0 = time.perf_counter()
    header = result_header()  # once: the file is rewritten after every case
    rows = []
    for case in bk.build_cases(dtype, set(args.ops.split(","))):
        rows += sweep_case(case, dtype, timer, l2_bytes, copy_gbs)
        with open(args.out, "w") as f:  # after every case, so a run stopped by a time limit keeps what it measured
            json.dump(dict(**header, gpu=torch.cuda.get_device_name(),
                           torch=torch.__version__, dtype=args.dtype, copy_bandwidth_gb_per_s=copy_gbs,
                           timing=f"CUDA graph replays, {args.graph_ms} ms each, median of {args.replays}",
                           seconds=time.perf_counter() - t0, results=rows), f, indent=1)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
