"""How long the precompile workers would take under each queue order, from per-graph compile times a run measured.

    python benchmarks/archive/simulate_precompile_order.py RUN/metrics.jsonl [...] [--model sd15]

Each worker claims the next graph of the queue when it is free (list scheduling, as ``worker.compile_queue`` does).
For each run's summary (``precompile.graph_seconds``), it prints the time the workers would take with the queue
ordered by parameter count, by ``compile_cost`` (submodules, then parameters: the order the queue has now), and by
the measured times themselves (the best order a cost estimate could give), next to an even split of the work.
The blocks' costs come from the model built on the meta device (no weights, no memory).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gallery_lib.accel.compile.precompile.record import compile_cost  # noqa: E402
from gallery_lib.run.metrics import read_metrics  # noqa: E402


def list_schedule(seconds: dict[str, float], order: list[str], workers: int) -> float:
    """When the last of ``workers`` finishes, each taking the queue's next graph as soon as it is free."""
    free_at = [0.0] * workers
    for name in order:
        heapq.heappush(free_at, heapq.heappop(free_at) + seconds[name])
    return max(free_at)


def orders(seconds: dict[str, float], model: torch.nn.Module) -> dict[str, list[str]]:
    def params(name: str) -> int:
        return compile_cost(model.get_submodule(name))[1]

    return {"parameters": sorted(seconds, key=params, reverse=True),
            "compile_cost": sorted(seconds, key=lambda n: compile_cost(model.get_submodule(n)), reverse=True),
            "measured": sorted(seconds, key=seconds.get, reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--model", default="sd15", help="the SD variant the runs trained (its UNet's blocks)")
    args = parser.parse_args()
    from gallery_lib.models.sd_parts import build_unet

    with torch.device("meta"):
        unet = build_unet(args.model)
    print("run | even split | by parameters | by compile_cost | by measured time (s)")
    for path in args.metrics:
        summary = read_metrics(path)[1] or {}
        pre = summary.get("precompile") or {}
        seconds, workers = pre.get("graph_seconds"), pre.get("workers")
        if not seconds:
            print(f"{path} | no per-graph compile times in its summary")
            continue
        spans = {name: list_schedule(seconds, order, workers) for name, order in orders(seconds, unet).items()}
        print(f"{path} | {sum(seconds.values()) / workers:.1f} | {spans['parameters']:.1f} | "
              f"{spans['compile_cost']:.1f} | {spans['measured']:.1f}")


if __name__ == "__main__":
    main()
