"""Tests for gallery_lib.reports.comparison: runs synthesized on disk with known numbers are read back, compared
and drawn."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from gallery_lib.run.metrics import MetricsWriter
from gallery_lib.reports.comparison import (
    comparison_figure,
    comparison_table,
    load_run,
    load_runs,
    to_markdown,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GPU = "NVIDIA H100 80GB HBM3"
MODEL = "swin_tiny_patch4_window7_224"
BATCH, NPROC = 32, 2

# Each recipe's known figures; losses and step times differ per recipe so that a swapped run is caught.
RUNS = {
    "baseline": dict(samples_per_s=1000.0, median=64.0, p20=63.0, p80=65.5, warmup_s=12.5, peak_mb=10240.0,
                     final_loss=4.31, skipped=0, losses=[6.9 - 0.1 * i for i in range(8)],
                     times=[900.0, 120.0] + [64.0 + (i % 3) for i in range(6)]),
    "compiled": dict(samples_per_s=1600.0, median=40.0, p20=39.5, p80=41.0, warmup_s=40.25, peak_mb=8192.0,
                     final_loss=4.52, skipped=3, losses=[6.8 - 0.08 * i for i in range(8)],
                     times=[30000.0, 9000.0] + [40.0 + (i % 2) for i in range(6)]),
    "accelerated": dict(samples_per_s=2500.0, median=25.6, p20=25.0, p80=26.0, warmup_s=55.0, peak_mb=6144.0,
                        reserved_mb=7168.0,
                        final_loss=4.6, skipped=1, losses=[6.7 - 0.05 * i for i in range(8)],
                        times=[45000.0, 8000.0] + [25.6 + 0.1 * i for i in range(6)]),
}


def peak_gib(known: dict) -> float:
    """The memory a report shows: reserved where the run measured it (what must fit on the GPU), else its peak."""
    return known.get("reserved_mb", known["peak_mb"]) / 1024


def _write_config(run_dir, recipe, *, model=MODEL, batch=BATCH, nproc=NPROC):
    run_dir.mkdir(parents=True, exist_ok=True)
    config = dict(model=model, recipe=recipe, batch_size=batch, nproc_per_node=nproc, amp_level="O1",
                  compile=recipe != "baseline", steps=8, warmup_steps=2, output_dir="output")
    (run_dir / "config.json").write_text(json.dumps(config))


def _write_run(model_dir, recipe, *, losses, times, peak_mb=1024.0, skipped=0, warmup=2, summary=None, batch=BATCH):
    """Writes config.json and metrics.jsonl for one run; ``summary`` (a dict) is appended when given."""
    run_dir = model_dir / recipe
    _write_config(run_dir, recipe, batch=batch)
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for i, (loss, t) in enumerate(zip(losses, times)):
            writer.write({"type": "step", "step": i, "loss": loss, "lr": 1e-3, "step_time_ms": t,
                          "samples_per_s": batch * NPROC * 1000.0 / t, "peak_mem_mb": peak_mb - 100 * (i == 0),
                          "warmup": i < warmup, "skipped_samples": skipped if i >= 3 else 0})  # cumulative
        if summary is not None:
            writer.write({"type": "summary", "model": MODEL, "recipe": recipe, **summary})
    return run_dir


def _write_known_run(model_dir, recipe):
    k = RUNS[recipe]
    summary = {"device_name": GPU, "world_size": NPROC, "global_batch_size": BATCH * NPROC, "steps": 8,
               "warmup_steps": 2, "warmup_time_s": k["warmup_s"], "median_step_time_ms": k["median"],
               "p20_step_time_ms": k["p20"], "p80_step_time_ms": k["p80"], "samples_per_s": k["samples_per_s"],
               "peak_mem_mb": k["peak_mb"], "peak_reserved_mb": k.get("reserved_mb"), "final_loss": k["final_loss"],
               "skipped_samples": k["skipped"], "output_dir": str(model_dir / recipe)}
    return _write_run(model_dir, recipe, losses=k["losses"], times=k["times"], peak_mb=k["peak_mb"],
                      skipped=k["skipped"], summary=summary)


@pytest.fixture
def model_dir(tmp_path):
    model_dir = tmp_path / "output" / "swin"
    for recipe in RUNS:
        _write_known_run(model_dir, recipe)
    return model_dir


def test_table_values_and_speedups_come_from_each_runs_files(model_dir):
    runs = load_runs(model_dir)
    assert [r.recipe for r in runs] == ["baseline", "accelerated", "compiled"]  # baseline first, then alphabetical
    table = comparison_table(runs)
    for row, run in zip(table, runs):
        k = RUNS[row["recipe"]]
        assert row["run_dir"] == str(model_dir / row["recipe"]) == str(run.run_dir)
        assert row["device"] == GPU and row["world_size"] == NPROC and row["global_batch"] == BATCH * NPROC
        assert row["img_per_s"] == k["samples_per_s"]
        assert row["speedup"] == pytest.approx(k["samples_per_s"] / RUNS["baseline"]["samples_per_s"])
        assert (row["median_step_ms"], row["p20_step_ms"], row["p80_step_ms"]) == (k["median"], k["p20"], k["p80"])
        assert row["warmup_s"] == k["warmup_s"]
        # reserved where the run measured it (what must fit on the GPU), else the peak it has
        assert row["peak_mem_gib"] == pytest.approx(peak_gib(k))
        assert row["final_loss"] == k["final_loss"] and row["skipped_samples"] == k["skipped"]
        assert row["finished"] is True
    assert [row["speedup"] for row in table] == pytest.approx([1.0, 2.5, 1.6])


def test_given_recipe_order_and_other_reference(model_dir):
    runs = load_runs(model_dir, ["compiled", "baseline"])
    assert [r.recipe for r in runs] == ["compiled", "baseline"]
    table = comparison_table(runs, reference="compiled")
    assert [row["speedup"] for row in table] == pytest.approx([1.0, 1000.0 / 1600.0])
    assert "speedup vs compiled (x)" in to_markdown(table, reference="compiled")


def test_missing_reference_gives_no_speedup(model_dir):
    table = comparison_table(load_runs(model_dir, ["accelerated", "compiled"]))
    assert [row["speedup"] for row in table] == [None, None]
    assert [row["img_per_s"] for row in table] == [2500.0, 1600.0]
    body = to_markdown(table).splitlines()[2:4]
    assert all("| n/a |" in line for line in body)


def test_markdown_has_every_recipe_and_its_numbers(model_dir):
    markdown = to_markdown(comparison_table(load_runs(model_dir)))
    lines = markdown.splitlines()
    assert lines[0].startswith("| recipe |") and "(img/s)" in lines[0] and "(GiB)" in lines[0] and "(ms)" in lines[0]
    assert set(lines[1]) <= set("|-")
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    for recipe, k in RUNS.items():
        row = next(line for line in lines if line.startswith(f"| {recipe} |"))
        for text in (f"{k['samples_per_s']:.1f}", f"{k['samples_per_s'] / 1000.0:.2f}x",
                     f"{k['median']:.1f} [{k['p20']:.1f}-{k['p80']:.1f}]", f"{k['warmup_s']:.1f}",
                     f"{peak_gib(k):.2f}", f"{k['final_loss']:.4f}", GPU):
            assert text in row, (recipe, text, row)
    legend = lines[-1].lower()
    assert "median" in legend and "steady-state" in legend and "warm-up" in legend and "separately" in legend


def test_figure_draws_each_run_from_its_own_files(model_dir):
    runs = load_runs(model_dir)
    fig = comparison_figure(runs)
    assert len(fig.axes) == 4
    ax_speed, ax_step, ax_mem, ax_loss = fig.axes
    assert len(ax_loss.lines) == len(RUNS)
    reference = np.array(RUNS["baseline"]["losses"])
    for run, line in zip(runs, ax_loss.lines):
        # Compared with what the test wrote into that recipe's folder, not with anything the report read.
        np.testing.assert_allclose(line.get_ydata(), RUNS[run.recipe]["losses"])
        np.testing.assert_array_equal(line.get_xdata(), np.arange(8))
        if run.recipe == "baseline":
            assert line.get_label() == "baseline"
        else:  # the largest per-step loss difference from the baseline, so identical curves show as such
            gap = np.abs(np.array(RUNS[run.recipe]["losses"]) - reference).max()
            assert line.get_label() == f"{run.recipe} (largest step difference from baseline: {gap:.2g})"
    assert len({line.get_linestyle() for line in ax_loss.lines}) == len(RUNS)  # drawn over each other, still seen
    step_lines = ax_step.get_lines()
    assert len(step_lines) == len(RUNS)
    for run, line in zip(runs, step_lines):
        np.testing.assert_allclose(line.get_ydata(), RUNS[run.recipe]["times"])
        assert line.get_label().startswith(run.recipe)
    # Warm-up spikes of 45 s against a 65 ms steady state: log scale, and the warm-up span shaded.
    assert ax_step.get_yscale() == "log"
    assert any(p.get_label() == "warm-up (excluded)" for p in ax_step.patches)
    assert [b.get_height() for b in ax_speed.patches] == [RUNS[r.recipe]["samples_per_s"] for r in runs]
    assert [t.get_text() for t in ax_speed.texts] == ["1.00x", "2.50x", "1.60x"]
    assert [b.get_height() for b in ax_mem.patches] == pytest.approx([peak_gib(RUNS[r.recipe]) for r in runs])
    for i, run in enumerate(runs):  # one colour per recipe in every panel
        colors = {ax_loss.lines[i].get_color(), step_lines[i].get_color()}
        assert len(colors) == 1
        assert np.allclose(ax_speed.patches[i].get_facecolor(), ax_mem.patches[i].get_facecolor())
        assert np.allclose(ax_speed.patches[i].get_facecolor(), to_rgba(colors.pop()))
    assert GPU in fig.get_suptitle() and f"global batch {BATCH * NPROC}" in fig.get_suptitle()
    assert "not speed measurements" not in fig.get_suptitle()  # said on CPU runs only
    assert fig._repr_png_().startswith(PNG_MAGIC)


def test_linear_step_axis_without_warmup_spikes(tmp_path):
    for recipe in ("baseline", "compiled"):
        _write_run(tmp_path, recipe, losses=[1.0] * 6, times=[12.0, 11.0, 10.0, 10.5, 10.2, 10.1])
    assert comparison_figure(load_runs(tmp_path)).axes[1].get_yscale() == "linear"


def test_title_names_each_runs_batch_when_they_differ(model_dir):
    _write_run(model_dir, "big_batch", losses=[6.0, 5.0, 4.0], times=[900.0, 80.0, 81.0], batch=2 * BATCH)
    title = comparison_figure(load_runs(model_dir, ["baseline", "big_batch"])).get_suptitle()
    # The unfinished run has no device name: the title names the one known GPU once.
    assert title == f"{MODEL}: {GPU}\nglobal batch {BATCH * NPROC} (baseline), {2 * BATCH * NPROC} (big_batch)"


def test_unfinished_run_with_truncated_last_line(model_dir):
    losses = [6.0, 5.5, 5.25, 5.0, float("nan"), 4.75]
    times = [500.0, 90.0, 50.0, 52.0, 48.0, 60.0]
    run_dir = _write_run(model_dir, "killed", losses=losses, times=times, peak_mb=3072.0, skipped=2)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"type": "step", "step": 6, "loss": 4.7, "step_ti')  # killed mid-write

    run = load_run(run_dir)
    assert run.finished is False and run.summary is None and len(run.steps) == 6
    row = comparison_table(load_runs(model_dir, ["baseline", "killed"]))[1]
    steady = [50.0, 52.0, 48.0, 60.0]  # the two warm-up steps are excluded
    assert row["finished"] is False and row["device"] is None
    assert row["median_step_ms"] == pytest.approx(51.0)
    assert row["p20_step_ms"] == pytest.approx(np.percentile(steady, 20))
    assert row["p80_step_ms"] == pytest.approx(np.percentile(steady, 80))
    assert row["img_per_s"] == pytest.approx(np.median([BATCH * NPROC * 1000.0 / t for t in steady]))
    assert row["speedup"] == pytest.approx(row["img_per_s"] / 1000.0)
    assert row["warmup_s"] == pytest.approx(0.59)
    assert row["peak_mem_gib"] == pytest.approx(3.0)
    assert row["final_loss"] == 4.75 and row["skipped_samples"] == 2
    assert row["global_batch"] == BATCH * NPROC and row["world_size"] == NPROC

    markdown = to_markdown([row])
    assert "no (no summary)" in markdown and "Unfinished runs" in markdown
    loss_line = comparison_figure([run]).axes[3].lines[0]
    np.testing.assert_allclose(loss_line.get_ydata(), losses)  # the NaN written as null comes back as a gap


def test_run_that_logged_nothing_yet(tmp_path):
    _write_config(tmp_path / "baseline", "baseline")
    row = comparison_table([load_run(tmp_path / "baseline")])[0]
    assert row["finished"] is False and row["img_per_s"] is None and row["speedup"] is None
    assert row["global_batch"] == BATCH * NPROC
    assert "n/a" in to_markdown([row])


def test_missing_directories_name_what_to_run(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*gallery train"):
        load_runs(tmp_path / "output" / "resnet50")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no runs in .*empty.*--recipe baseline"):
        load_runs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"\['ladder_3'\].*found: \['accelerated', 'baseline', 'compiled'\]"
                                                r".*--recipe ladder_3"):
        load_runs(model_dir, ["baseline", "ladder_3"])
    with pytest.raises(ValueError, match=r"recipes=\[\] selects no run"):
        load_runs(model_dir, [])
    with pytest.raises(FileNotFoundError, match=r"holds no run.*--recipe nothing"):
        load_run(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "nope")


def test_metrics_copied_from_another_run_is_refused(model_dir):
    shutil.copy(model_dir / "baseline" / "metrics.jsonl", model_dir / "compiled" / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"compiled.*recipe='baseline'.*recipe='compiled'.*different runs"):
        load_run(model_dir / "compiled")


def test_write_report_writes_markdown_and_png(model_dir):
    report = write_report(model_dir)
    md_path, png_path = model_dir / "report.md", model_dir / "report.png"
    assert report.paths == {"markdown": md_path, "figure": png_path}
    png = png_path.read_bytes()
    assert len(png) > 10_000 and png.startswith(PNG_MAGIC)
    text = md_path.read_text()
    assert text == report.markdown
    assert text.startswith(f"# {MODEL}") and "](report.png)" in text
    assert to_markdown(report.table) in text
    for recipe in RUNS:
        assert f"[{recipe}/metrics.jsonl]({recipe}/metrics.jsonl)" in text and str(model_dir / recipe) in text
    assert len(report.figure.axes) == 4
    shown = report._repr_markdown_()
    assert "data:image/png;base64," in shown and "](report.png)" not in shown
    assert math.isclose(report.table[1]["speedup"], 2.5)


def test_cpu_runs_say_their_timings_are_not_speed_measurements(tmp_path):
    model_dir = tmp_path / "output" / "tiny"
    for recipe in ("baseline", "accelerated"):
        _write_run(model_dir, recipe, losses=[2.0, 1.5, 1.0], times=[50.0, 20.0, 21.0],
                   summary={"device_name": "CPU", "world_size": 1, "global_batch_size": 8, "samples_per_s": 400.0,
                            "median_step_time_ms": 20.0, "output_dir": str(model_dir / recipe)})
    figure = comparison_figure(load_runs(model_dir))
    title = figure.get_suptitle()
    assert "CPU" in title and "they are not speed measurements" in title
    speed_axis = figure.axes[0]
    assert "n/a on CPU (smoke)" in speed_axis.get_title()
    assert not speed_axis.patches  # no bars set side by side: on a CPU they would read as a speedup
    assert "Timings on a CPU are not speedups:\nrun on a GPU for the comparison" in speed_axis.texts[0].get_text()
    report = write_report(model_dir)
    assert "| n/a on CPU (smoke) |" in report.markdown and "1.00x" not in report.markdown
    from gallery_lib.app.workflow import summarize

    said = summarize(report)
    assert "speedup over the baseline n/a on CPU (smoke)" in said and "1.00x" not in said
    assert "GiB;" in said and "reserved" not in said  # a CPU run's peak is its resident memory


def test_the_summary_names_the_peak_it_gives(model_dir):
    from gallery_lib.app.workflow import summarize

    said = summarize(write_report(model_dir))
    assert f"peak memory {peak_gib(RUNS['accelerated']):.2f} GiB reserved;" in said
    assert f"peak memory {peak_gib(RUNS['baseline']):.2f} GiB;" in said  # a summary that measured no reserved peak


def test_a_stopped_run_is_one_line_not_a_row_a_bar_or_a_curve(model_dir):
    from gallery_lib.run.failure import RunFailure
    from gallery_lib.app.workflow import summarize

    log = str(model_dir / "accelerated" / "logs" / "rank0.log")
    _write_run(model_dir, "accelerated", losses=[6.7, float("nan"), float("nan")], times=[900.0, 50.0, 50.0])
    RunFailure("nonfinite", "loss not finite from step 1", log, first_step=1).write(model_dir / "accelerated")
    report = write_report(model_dir, ["baseline", "compiled", "accelerated"])
    line = f"accelerated: stopped, loss not finite from step 1, see {log}"
    assert [row["recipe"] for row in report.table] == ["baseline", "compiled"]
    assert "| accelerated" not in report.markdown and "`accelerated`" not in report.markdown  # no row, no run link
    assert report.markdown.count("accelerated:") == 1 and f"- {line}\n" in report.markdown
    speed_axis, step_axis, _, loss_axis = report.figure.axes
    assert [tick.get_text() for tick in speed_axis.get_xticklabels()] == ["baseline", "compiled"]
    assert not any("accelerated" in str(t.get_text()) for ax in report.figure.axes for t in ax.texts)
    assert [ln.get_label().split(" ")[0] for ln in loss_axis.lines] == ["baseline", "compiled"]
    assert summarize(report).splitlines()[-1] == f"- {line}."
    (model_dir / "accelerated" / "failure.json").unlink()  # without its record, a stopped run is unfinished
    assert [row["recipe"] for row in write_report(model_dir, ["baseline", "accelerated"]).table] == [
        "baseline", "accelerated"]


def test_a_report_of_runs_that_all_stopped_still_writes(tmp_path):
    from gallery_lib.run.failure import RunFailure

    model_dir = tmp_path / "output" / "swin"
    _write_run(model_dir, "baseline", losses=[float("nan")], times=[900.0])
    RunFailure("out_of_memory", "out of memory").write(model_dir / "baseline")
    report = write_report(model_dir, ["baseline"])
    assert report.table == [] and "- baseline: stopped, out of memory\n" in report.markdown
    assert (model_dir / "report.png").stat().st_size > 1000


def test_val_top1_shows_only_where_a_run_scored_the_val_split(model_dir):
    assert "val top-1" not in to_markdown(comparison_table(load_runs(model_dir)))  # no run scored one
    k = RUNS["baseline"]
    scored = dict(device_name=GPU, world_size=NPROC, global_batch_size=BATCH * NPROC, samples_per_s=k["samples_per_s"],
                  final_loss=k["final_loss"], val_top1=0.625, val_loss=1.1, val_images=40)
    _write_run(model_dir, "baseline", losses=k["losses"], times=k["times"], summary=scored)
    lines = to_markdown(comparison_table(load_runs(model_dir))).splitlines()
    assert "| val top-1 |" in lines[0]
    assert "| 62.5% |" in next(line for line in lines if line.startswith("| baseline |"))
    assert lines[0].count("|") == lines[2].count("|")  # every row has the column, empty where unmeasured
