"""Where each run under a `gallery bench` output folder spent its time before steady speed: the precompile workers'
start-up phases, the recording, each worker's graphs, the loading, and the first warm-up steps (read from each run's
summary record).

    python benchmarks/compile_times.py /tmp/bench_NAME [...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gallery_lib.accel.compile.precompile import PrecompileReport  # noqa: E402
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
            f"  this process's compile phases (s, nested): {summary.get('compile_phases_s')}"
            + _schedule(pre))


def _schedule(pre: dict) -> str:
    """Each worker's graphs in the order it compiled them (start in seconds after the queue + seconds compiling)."""
    if not pre.get("schedule"):
        return ""
    report = PrecompileReport(**pre)
    lines = [(f"  workers' graphs (start after the queue + seconds; busy {report.workers_busy():.0%} of "
              f"{report.workers} x {report.compile_span():.1f} s):")]
    for worker in sorted({w for w, _, _ in report.schedule.values()}):
        graphs = sorted((start, seconds, name) for name, (w, start, seconds) in report.schedule.items() if w == worker)
        lines.append(f"    worker {worker}: " + ", ".join(f"{name} {start:.1f}+{seconds:.1f}"
                                                   for start, seconds, name in graphs))
    for who, phases in (("workers'", report.worker_phases), ("this process's loading", report.load_phases)):
        if phases:
            lines.append(f"  {who} compile phases, all graphs (s, nested): "
                         + ", ".join(f"{phase} {s:.1f}" for phase, s in list(phases.items())[:12]))
    return "\n" + "\n".join(lines)


if __name__ == "__main__":
    for root in sys.argv[1:]:
        for path in sorted(Path(root).rglob("metrics.jsonl")):
            print(describe(path))
