"""Where each run under a `gallery bench` output folder spent its time before steady speed: the precompile workers'
start-up phases, the recording, the loading, and the first warm-up steps (read from each run's summary record).

    python benchmarks/compile_times.py /tmp/bench_NAME [...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gallery_lib.run.metrics import read_metrics  # noqa: E402


def describe(metrics: Path) -> str:
    summary = read_metrics(metrics)[1]
    if summary is None:
        return f"{metrics.parent}: no summary record (the run did not finish)"
    pre = summary.get("precompile") or {}
    startup = {phase: round(s, 1) for phase, s in (pre.get("startup_seconds") or {}).items()}
    return (f"{metrics.parent}: to steady speed {summary.get('to_steady_speed_s', float('nan')):.1f} s, "
            f"precompile {summary.get('precompile_time_s', 0.0):.1f} s (workers' start-up {startup}, recording "
            f"{pre.get('record_seconds', float('nan')):.1f} s, workers done {pre.get('workers_done_seconds', float('nan')):.1f} s, "
            f"loading {sum((pre.get('load_seconds') or {}).values()):.1f} s), setup {summary.get('setup_time_s', float('nan')):.1f} s\n"
            f"  first warm-up steps (ms): {[round(t) for t in summary.get('warmup_step_times_ms', [])[:10]]}, "
            f"median step {summary.get('median_step_time_ms', float('nan')):.1f} ms\n"
            f"  this process's compile phases (s, nested): {summary.get('compile_phases_s')}")


if __name__ == "__main__":
    for root in sys.argv[1:]:
        for path in sorted(Path(root).rglob("metrics.jsonl")):
            print(describe(path))
