"""benchmarks/compile_times.py: where a run's time before steady speed went, read from its summary record."""

import dataclasses
from pathlib import Path

from gallery_lib.accel.compile.precompile import PrecompileReport
from gallery_lib.run.metrics import MetricsWriter
from script_testing import load_script

compile_times = load_script("benchmarks/compile_times.py")


def write_run(path: Path, summary: dict | None) -> Path:
    path.parent.mkdir(parents=True)
    writer = MetricsWriter(path, mode="w")
    writer.write({"type": "step", "step": 0, "loss": 1.0})
    if summary is not None:
        writer.write({"type": "summary", **summary})
    writer.close()
    return path


def test_each_workers_graphs_in_the_order_it_compiled_them(tmp_path):
    # 2 workers, 3 graphs: worker 1 idles after its one graph, so they are busy 12 of 2 x 8 s
    report = PrecompileReport(blocks=4, graphs=3, workers=2, seconds=9.0, graph_seconds={"a": 5.0, "b": 3.0, "c": 4.0},
                              schedule={"a": (0, 0.0, 5.0), "c": (1, 0.5, 4.0), "b": (0, 5.0, 3.0)},
                              worker_phases={"compile_inner": 10.5, "async_compile.wait": 2.25},
                              load_phases={"bytecode_tracing": 1.5})
    assert report.compile_span() == 8.0 and report.workers_busy() == 12 / 16
    assert "workers busy 75% of the 8.0 s from the queue to the last graph" in report.describe()
    text = compile_times.describe(write_run(tmp_path / "run" / "metrics.jsonl", {
        "to_steady_speed_s": 12.0, "precompile_time_s": 9.0, "precompile": dataclasses.asdict(report)}))
    assert "workers' graphs (start after the queue + seconds; busy 75% of 2 x 8.0 s):" in text
    assert "    worker 0: a 0.0+5.0, b 5.0+3.0\n    worker 1: c 0.5+4.0" in text
    assert "workers' compile phases, all graphs (s, nested): compile_inner 10.5, async_compile.wait 2.2" in text
    assert "this process's loading compile phases, all graphs (s, nested): bytecode_tracing 1.5" in text


def test_runs_without_a_schedule_or_a_summary(tmp_path):
    eager = compile_times.describe(write_run(tmp_path / "eager" / "metrics.jsonl", {"to_steady_speed_s": 1.5}))
    assert "to steady speed 1.5 s" in eager and "workers' graphs" not in eager
    cut_short = compile_times.describe(write_run(tmp_path / "cut" / "metrics.jsonl", None))
    assert cut_short.endswith("no summary record (the run did not finish)")
