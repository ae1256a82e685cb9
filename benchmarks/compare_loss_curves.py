"""Compares the per-step losses of runs, pair by pair: do two configurations learn the same thing?

    python benchmarks/compare_loss_curves.py NAME=path/to/metrics.jsonl NAME=... [--early 10] [--out FILE.json]

On a GPU, bf16 runs of one configuration are not bitwise repeatable (atomics in backward kernels), and from a
random init the small differences grow: two runs agree closely for the first steps and then drift apart. So a
configuration change is judged against that spread: its pairs with the reference runs should look like the pairs of
reference runs among themselves. For each pair this prints the largest relative loss difference over the first
``--early`` steps, the first step where the difference passes 1%, the mean relative difference after the early
steps, and each run's mean loss over its last 10 steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gallery_lib.run.metrics import read_metrics  # noqa: E402


def losses(path: str) -> list[float]:
    """The run's per-step losses; a non-finite loss (written as null) reads as NaN."""
    return [math.nan if step["loss"] is None else step["loss"] for step in read_metrics(path)[0]]


def compare(a: list[float], b: list[float], early: int = 10) -> dict:
    """Step-by-step relative differences of two loss curves (over the steps both have)."""
    n = min(len(a), len(b))
    if n <= early:
        raise ValueError(f"the runs share {n} steps: need more than early={early} to compare after them")
    # A step where either run's loss is not finite counts as infinitely far apart: NaN never passes.
    rel = [abs(x - y) / max(abs(x), 1e-12) if math.isfinite(x) and math.isfinite(y) else math.inf
           for x, y in zip(a[:n], b[:n])]
    over = next((i for i, d in enumerate(rel) if d > 0.01), None)
    return {"steps": n, "max_rel_diff_early": max(rel[:early]), "first_step_over_1pct": over,
            "mean_rel_diff_after": statistics.mean(rel[early:]),
            "mean_loss_last_10": [statistics.mean(a[n - 10:n]), statistics.mean(b[n - 10:n])]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="NAME=METRICS_JSONL")
    parser.add_argument("--early", type=int, default=10, help="steps counted as early (default 10)")
    parser.add_argument("--out", help="also write the pairs as JSON")
    args = parser.parse_args(argv)
    if any("=" not in run for run in args.runs) or len(args.runs) < 2:
        parser.error("give at least two runs as NAME=path/to/metrics.jsonl")
    curves = {name: losses(path) for name, path in (run.split("=", 1) for run in args.runs)}
    pairs = []
    for (name_a, a), (name_b, b) in itertools.combinations(curves.items(), 2):
        pairs.append({"a": name_a, "b": name_b, **compare(a, b, args.early)})
        p = pairs[-1]
        print(f"{name_a:>16} vs {name_b:<16} early max {p['max_rel_diff_early']:.4f} | first >1% at step "
              f"{p['first_step_over_1pct']} | mean after {p['mean_rel_diff_after']:.3f} | last 10 "
              f"{p['mean_loss_last_10'][0]:.4f} / {p['mean_loss_last_10'][1]:.4f}")
    if args.out:
        from gallery_lib.reports.provenance import result_header

        Path(args.out).write_text(json.dumps({**result_header(), "early": args.early, "pairs": pairs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
