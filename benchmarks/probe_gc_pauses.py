"""How long Python's garbage collector stops a training run, and how often: a suspect for step-time jitter where the
host sets the step time (DreamBooth at batch 1 with block graphs).

Runs one gallery recipe in this process with a ``gc.callbacks`` timer and prints, per generation and for the
warm-up and the steps after it, how many collections ran and how long they took (total, median, max), plus the
objects the collector tracks at the end.

    python benchmarks/probe_gc_pauses.py --family dreambooth --recipe accelerated [--profile smoke] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="dreambooth")
    parser.add_argument("--recipe", default="accelerated")
    parser.add_argument("--profile", default="smoke")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out")
    args = parser.parse_args()

    from gallery_lib.app.workflow import prepare
    from gallery_lib.reports.provenance import result_header
    from gallery_lib.config.overrides import parse_overrides
    from gallery_lib.recipes import recipe_config
    from gallery_lib.recipes.profiles import base_config
    from gallery_lib.run.train import run

    work = tempfile.mkdtemp(prefix="gc_probe_")
    base = base_config(args.profile, family=args.family, data_root=f"{work}/data", output_dir=f"{work}/output",
                       **parse_overrides(args.set))
    prepare(base)
    cfg = recipe_config(base, args.recipe, {})
    # Each collection is counted in the phase it stops: before the first optimizer step after warm-up, or after.
    pauses: dict[str, dict[int, list[float]]] = {"warm-up": {0: [], 1: [], 2: []}, "steady": {0: [], 1: [], 2: []}}
    started: dict[str, float] = {}
    steps = [0]

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            where = "steady" if steps[0] >= cfg.warmup_steps else "warm-up"
            pauses[where][info["generation"]].append((time.perf_counter() - started.pop("t")) * 1e3)

    def count_step(*_):
        steps[0] += 1

    from torch.optim.optimizer import register_optimizer_step_post_hook

    hook = register_optimizer_step_post_hook(count_step)
    gc.callbacks.append(timer)
    summary = run(cfg)
    gc.callbacks.remove(timer)
    hook.remove()
    record = {
        **result_header(),
        "steps": cfg.steps, "warmup_steps": cfg.warmup_steps, "optimizer_steps_seen": steps[0],
        "median_step_ms": summary.get("median_step_time_ms"),
        "tracked_objects_at_end": len(gc.get_objects()), "gc_thresholds": gc.get_threshold(),
        "collections": {where: {f"gen{g}": {"count": len(p), "total_ms": round(sum(p), 2),
                                            "median_ms": round(statistics.median(p), 3) if p else None,
                                            "max_ms": round(max(p), 2) if p else None} for g, p in by_gen.items()}
                        for where, by_gen in pauses.items()},
    }
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
