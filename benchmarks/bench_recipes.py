"""Runs a model's recipes side by side on this machine and writes one JSON result file.

    python benchmarks/bench_recipes.py --profile full --recipes baseline,compiled,accelerated \
        [--model sd15] [--set export_model=false] [--variant accelerated:batch_size=32] \
        --out benchmarks/results/swin_full_h200.json

Every run goes through the same launcher as the notebooks (a torchrun subprocess, CUDA-event step
timing, warm-up/compile reported apart), in one session on one machine, so the numbers compare.
``--variant NAME:field=value,...`` adds a run of recipe NAME with config overrides, named as the CLI
names them (``NAME+field=value``; a switch shows as ``+field`` or ``+no-field``), for trying a switch
before it goes into a recipe. ``--set field=value`` changes the base config of every run. ``--cold-compile``
gives every run its own empty Inductor and Triton caches, so each run's compile time is what a first run on a fresh
machine sees (otherwise a later run loads what an earlier one compiled). The result file is rewritten after each
run, so a run killed by a time limit keeps the runs before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from gallery_lib.config import parse_overrides
from gallery_lib.run.launch import launch
from gallery_lib.recipes.profiles import base_config
from gallery_lib.app.bench import gpu_name
from gallery_lib.reports.provenance import result_header
from gallery_lib.recipes import apply_recipe, recipe_config
from gallery_lib.reports.comparison import mfu
from gallery_lib.app.workflow import prepare

_KEYS = ("recipe", "samples_per_s", "median_step_time_ms", "p20_step_time_ms", "p80_step_time_ms", "warmup_time_s",
         "setup_time_s", "precompile_time_s", "peak_reserved_mb", "peak_mem_mb", "final_loss", "mean_loss_last_10",
         "global_batch_size", "world_size", "device_name", "notes", "skipped_samples", "train_flops_per_sample",
         "matmul_tflops", "cache_time_s", "ema", "warmup_step_times_ms", "precompile", "attention_probe_time_s",
         "compile_cache")


def parse_variant(text: str) -> tuple[str, dict]:
    """``"compiled:fused_attention=true,lr=1e-3"`` -> ``("compiled", {"fused_attention": True, "lr": 0.001})``;
    ``"accelerated:kernel_ops=geglu,layer_norm"`` -> ``("accelerated", {"kernel_ops": "geglu,layer_norm"})``."""
    recipe, _, assignments = text.partition(":")
    # A comma starts a new assignment only before "field=": values may hold commas (kernel_ops=geglu,layer_norm).
    return recipe, parse_overrides([a for a in re.split(r",(?=\w+=)", assignments) if a])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="full")
    parser.add_argument("--model")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--recipes", default="baseline,compiled,accelerated")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="base-config override for every run (repeatable)")
    parser.add_argument("--output-dir", default="output/bench")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--cold-compile", action="store_true",
                        help="an empty Inductor/Triton cache per run (compile times as on a fresh machine)")
    args = parser.parse_args(argv)

    base = base_config(args.profile, data_root=args.data_root, model=args.model, batch_size=args.batch_size,
                       steps=args.steps, output_dir=args.output_dir, **parse_overrides(args.set))
    configs = [apply_recipe(name, base) for name in args.recipes.split(",") if name]
    for text in args.variant:
        configs.append(recipe_config(base, *parse_variant(text)))
    start = time.perf_counter()
    prepare(base, progress=False)
    print(f"[bench] data ready in {time.perf_counter() - start:.1f} s", flush=True)

    record = {
        **result_header(),
        "gpu": gpu_name(),  # from nvidia-smi: CUDA stays uninitialized in this process
        "torch": torch.__version__, "python": platform.python_version(),
        "model": base.model, "image_size": base.image_size, "batch_size_per_process": base.batch_size,
        "steps": base.steps, "warmup_steps": base.warmup_steps,
        "timing": "CUDA events per step after warm-up; median with p20/p80; includes data loading unless "
                  "config.reuse_batch",
        "cold_compile": args.cold_compile,
        "results": [],
    }
    for cfg in configs:
        print(f"\n[bench] === {cfg.recipe} ===", flush=True)
        if args.cold_compile:  # the launcher's processes inherit the environment
            cache = Path(tempfile.mkdtemp(prefix="bench_compile_cache_"))
            os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
        try:
            summary = launch(cfg).summary
            row = {k: summary.get(k) for k in _KEYS}
            row["mfu"] = mfu(row["samples_per_s"], row["train_flops_per_sample"], row["matmul_tflops"])
            record["results"].append(row | {"config": cfg.to_dict()})
        except Exception as exc:  # record the failure and keep measuring the others
            record["results"].append({"recipe": cfg.recipe, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"})
        last = record["results"][-1]
        print(f"[bench] {json.dumps({k: last.get(k) for k in ('recipe', 'samples_per_s', 'mfu', 'error')})}",
              flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"[bench] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
