"""Time to steady speed of the SD-1.5 UNet training step under each compile strategy (one GPU), as JSON.

Each strategy runs in its own process with its own empty Inductor cache folder (so compile times are cold), builds
the UNet (random weights, 859.5M parameters), and runs the accelerated recipe's step (bf16 autocast, fused AdamW,
64x64 latents, 77x768 text states):

- ``eager``: no compilation (reference speed);
- ``whole``: ``torch.compile(unet)``, the compiled recipe today;
- ``blocks``: ``regional_compile(unet, dynamic=False)``: each distinct Transformer2DModel / ResnetBlock2D graph;
- ``blocks+pN``: the same after ``precompile_blocks`` compiled the distinct block graphs in N parallel processes;
- ``blocks-cg`` / ``blocks-cg+pN``: the blocks with ``mode="reduce-overhead"`` (each block's forward and backward
  replayed as CUDA graphs: fewer host launches where the step is host-bound);
- ``whole-warm``: ``whole`` again in ``whole``'s cache folder (what a second run on the same machine sees).

``time_to_steady_s`` runs from the start of compilation (precompile included) to the end of the warm-up steps;
``compile_s`` subtracts the warm-up steps' steady cost. Steady speed is the median of the timed steps (CUDA events).

    python benchmarks/bench_compile_time.py --out benchmarks/results/compile_time_h200.json [--batch 8] \
        [--variants eager,whole,blocks,blocks+p8,whole-warm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write (orchestrator mode)")
    p.add_argument("--batch", type=int, default=8, help="UNet batch size (default 8, the full profile's)")
    p.add_argument("--variants", default="eager,whole,blocks,blocks+p8,whole-warm")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--timed-steps", type=int, default=20)
    p.add_argument("--diagnose", action="store_true",
                   help="also record host ms per step, steady ms with guard evaluation skipped, and GPU busy ms")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # child mode: run one variant, print one JSON line
    return p.parse_args(argv)


def run_variant(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_ema_compile_attention import build_sd15_unet, make_step

    from gallery_lib.accel.compile.regional import block_names, regional_compile
    from gallery_lib.accel.compile.precompile import precompile_blocks

    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda")
    torch.manual_seed(0)
    unet = build_sd15_unet(device)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
    step = make_step(torch, args.batch, device, opt)
    if "-cg" in args.variant:  # CUDA-graph trees: a new training step starts a new generation of graph outputs
        plain_step = step

        def step(model):
            torch.compiler.cudagraph_mark_step_begin()
            plain_step(model)
    result: dict = {"variant": args.variant, "batch": args.batch}
    kind = args.variant.split("+")[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = unet
    if kind in ("whole", "whole-warm"):
        model = torch.compile(unet)
    elif kind in ("blocks", "blocks-cg"):
        kwargs = {"backend": "inductor", "dynamic": False}
        if kind == "blocks-cg":
            kwargs["mode"] = "reduce-overhead"
        if "+p" in args.variant:
            latents = torch.randn(args.batch, 4, 64, 64, device=device)
            text = torch.randn(args.batch, 77, 768, device=device)
            timesteps = torch.randint(0, 1000, (args.batch,), device=device)

            def forward():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    unet(latents, timesteps, encoder_hidden_states=text)

            report = precompile_blocks(unet, forward, block_names(unet), workers=int(args.variant.split("+p")[1]),
                                       compile_kwargs=kwargs)
            result["precompile"] = {"seconds": report.seconds, "graphs": report.graphs, "blocks": report.blocks,
                                    "workers": report.workers, "failures": report.failures,
                                    "graph_seconds": report.graph_seconds,
                                    "record_seconds": report.record_seconds,
                                    "startup_seconds": report.startup_seconds}
        result["regions"] = len(regional_compile(unet, **kwargs))
    from torch._dynamo.utils import counters

    counters.clear()
    for i in range(args.warmup_steps):
        step(model)
        if i == 0:
            torch.cuda.synchronize()
            result["first_step_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    result["time_to_steady_s"] = time.perf_counter() - t0
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(args.timed_steps)]
    for start, end in events:
        start.record()
        step(model)
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    result.update(steady_ms=statistics.median(ms), p20_ms=ms[len(ms) // 5], p80_ms=ms[4 * len(ms) // 5],
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                  cache={k: dict(v) for k, v in counters.items() if k in ("aot_autograd", "inductor") and v})
    if args.diagnose:
        result["diagnosis"] = diagnose(torch, step, model)
    result["compile_s"] = max(0.0, result["time_to_steady_s"] - args.warmup_steps * result["steady_ms"] / 1e3)
    for key in ("inductor", "aot_autograd"):  # keep only the cache counters
        result["cache"][key] = {k: v for k, v in result["cache"].get(key, {}).items() if "cache" in k}
    return result


def diagnose(torch, step, model) -> dict:
    """Where a step's time goes: host time to enqueue it, the same step with Dynamo's guard checks skipped, and the
    GPU's busy time (sum of kernel times in a profile) against the step time."""
    host = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(model)
        host.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
    out = {"host_ms_per_step": statistics.median(host)}
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            step(model)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                step(model)
            torch.cuda.synchronize()
        out["steady_ms_skip_guards"] = 1e3 * (time.perf_counter() - t) / 5
    except Exception as e:  # noqa: BLE001 - an older torch without the option
        out["steady_ms_skip_guards"] = f"{type(e).__name__}: {e}"[:200]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(model)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    out["gpu_busy_ms_per_step"] = gpu_us / 3e3
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    out["top_self_cpu_ms_per_step"] = {e.key[:80]: round(e.self_cpu_time_total / 3e3, 2) for e in top}
    return out


def orchestrate(args: argparse.Namespace) -> None:
    import torch

    from gallery_lib.reports.provenance import result_header

    header = result_header()
    root = tempfile.mkdtemp(prefix="compile_bench_")
    results = []
    for variant in args.variants.split(","):
        cache = os.path.join(root, "whole" if variant == "whole-warm" else variant)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        cmd = [sys.executable, __file__, "--variant", variant, "--batch", str(args.batch),
               "--warmup-steps", str(args.warmup_steps), "--timed-steps", str(args.timed_steps)]
        cmd += ["--diagnose"] if args.diagnose else []
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            row = {"variant": variant, "error": (proc.stderr or proc.stdout)[-1500:]}
        else:
            row = json.loads(lines[-1])
        row["process_wall_s"] = time.perf_counter() - t
        results.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every variant: a timeout keeps what was measured
            json.dump({**header, "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "cpus": os.cpu_count(), "results": results}, f, indent=1)


def main() -> None:
    args = parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
    elif not args.out:
        sys.exit("--out is required")
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
