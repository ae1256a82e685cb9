"""Runs rungs of the optimization ladder on this machine and writes one JSON result file; merges parts into a report.

    python benchmarks/bench_ladder.py --profile full --rungs tf32,amp,loader --steps 25 --out part1.json
    python benchmarks/bench_ladder.py --merge part1.json part2.json --out ladder.json --report-dir benchmarks/results/x

Each rung goes through the launcher as in the notebook (its own torchrun process, CUDA-event step timing, warm-up
and compile reported apart). A time-limited machine may run the ladder in parts: ``--merge`` joins their rungs in
ladder order and writes ``ladder.{md,png,json}`` with the speedups over the first rung. The result file is rewritten
after each rung, so a rung killed by a time limit keeps the rungs before it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from gallery_lib.config import RunConfig, parse_overrides
from gallery_lib.recipes.ladder import (RUNG_NAMES, RungResult, failure_reason, ladder_configs, rung_named,
                                rung_parents)
from gallery_lib.recipes.profiles import base_config
from gallery_lib.app.bench import gpu_name
from gallery_lib.reports.ladder import ladder_report
from gallery_lib.run.launch import RunFailed, launch
from gallery_lib.app.workflow import prepare
from gallery_lib.reports.provenance import result_header

_KEYS = ("recipe", "samples_per_s", "median_step_time_ms", "p20_step_time_ms", "p80_step_time_ms", "warmup_time_s",
         "setup_time_s", "precompile_time_s", "peak_mem_mb", "final_loss", "global_batch_size", "world_size",
         "device_name", "notes", "cache_time_s", "train_flops_per_sample", "matmul_tflops", "compile_cache",
         "precompile", "peak_reserved_mb", "memory_plan")


def run_rungs(args: argparse.Namespace) -> dict:
    base = base_config(args.profile, family="stable_diffusion", data_root=args.data_root, steps=args.steps,
                       output_dir=args.output_dir, **parse_overrides(args.set))
    configs = ladder_configs(base, args.rungs.split(",") if args.rungs else None)
    prepare(base, progress=False)
    record = {**result_header(), "gpu": gpu_name(),  # from nvidia-smi: CUDA stays uninitialized in this process
              "torch": torch.__version__, "python": platform.python_version(), "model": base.model,
              "timing": "CUDA events per step after warm-up; median with p20/p80; data loading included",
              "rungs": []}
    for name, cfg in configs.items():
        entry = {"rung": name, "config": cfg.to_dict() if cfg else None}
        if cfg is None:
            entry["failure"] = "needs a GPU"
        else:
            print(f"\n[ladder] === {cfg.recipe} ===", flush=True)
            started = time.perf_counter()
            try:
                summary = launch(cfg).summary
                entry["summary"] = {k: summary.get(k) for k in _KEYS}
            except RunFailed as exc:
                entry["failure"] = str(exc)[-2000:]
            # the rung's process from start to exit: what a time-limited call has to fit, beyond set-up and steps
            entry["wall_s"] = round(time.perf_counter() - started, 1)
            print(f"[ladder] {name}: " + (f"{entry['summary']['samples_per_s']:.1f} img/s, peak "
                  f"{entry['summary']['peak_mem_mb'] / 1024:.1f} GiB" if "summary" in entry else "failed")
                  + f", {entry['wall_s']:.0f} s in all", flush=True)
        record["rungs"].append(entry)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


def merge(paths: list[str], out: str, report_dir: str | None) -> dict:
    """The rungs of several result files in ladder order (a rung run twice: the later file's), with the report."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    entries = {entry["rung"]: entry for part in parts for entry in part["rungs"]}
    parents = rung_parents(on_gpu=any(part["gpu"] for part in parts))
    results = []
    for name in RUNG_NAMES:
        if name in entries:
            entry = entries[name]
            config = RunConfig.from_dict(entry["config"]) if entry["config"] else None
            failure = failure_reason(entry["failure"]) if entry.get("failure") else None
            results.append(RungResult(rung_named(name), config, summary=entry.get("summary"), failure=failure,
                                      builds_on=parents[name]))
    record = {**result_header(), "parts": [{"file": p, "command": part["command"], "commit": part.get("commit"),
              "dirty": part.get("dirty"), "date": part["date"], "gpu": part["gpu"], "torch": part["torch"]}
                                           for p, part in zip(paths, parts)]}
    if report_dir:
        report = ladder_report(results, report_dir)
        record["rows"] = report.rows
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="full")
    parser.add_argument("--rungs", help=f"comma-separated rung names (default: all): {','.join(RUNG_NAMES)}")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="base-config override for every rung (repeatable)")
    parser.add_argument("--output-dir", default="output/ladder")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--merge", nargs="+", metavar="PART", help="join these result files instead of running")
    parser.add_argument("--report-dir", help="with --merge: write ladder.{md,png,json} here")
    parser.add_argument("--out", required=True, help="JSON result file")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out, args.report_dir)
    else:
        run_rungs(args)
    print(f"[ladder] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
