"""Reports: reads each recipe's run of one model back from disk and compares them.

A model folder ``output/<model>/`` holds one run folder per recipe (``baseline``, ``compiled``, ...), each with
the ``config.json`` and ``metrics.jsonl`` its run wrote. Every number and curve here is read from the run's own
folder and carries that folder (``RunRecord.run_dir``), so a variant can never be shown with the baseline's logs.

    report = write_report("output/swin")   # writes output/swin/report.md and report.png
    report                                 # in a notebook cell: the table and the figure

Throughput and step times come from the summary line the training loop writes (median over the steady-state steps
after warm-up, CUDA events on a GPU). A run killed before its summary is still shown, flagged unfinished, with the
same figures computed from the steps it logged. A run that stopped with an error (its ``failure.json``) is shown in
one line under the table, ``accelerated: stopped, loss not finite from step 1, see <log>``: its figures are not
compared.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from gallery_lib.config.run_config import flat_config
from gallery_lib.run.failure import RunFailure, read_failure
from gallery_lib.run.memory_plan import MemoryPlan
from gallery_lib.run.metrics import read_metrics

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
REPORT_MD = "report.md"
REPORT_PNG = "report.png"
TRAIN_COMMAND = "gallery train --model <model> --recipe {recipe}"
"""How a missing run is produced, in the errors of this module (``compare`` names the model and its output folder)."""
# Panel (b) switches to a log y-axis when the slowest warm-up step is this many times the steady-state median.
_LOG_Y_RATIO = 10.0

# (row key, markdown header, format) in table order.
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("recipe", "recipe", "{}"),
    ("device", "device", "{}"),
    ("world_size", "world size", "{}"),
    ("global_batch", "global batch", "{}"),
    ("img_per_s", "throughput (img/s)", "{:.1f}"),
    ("speedup", "speedup vs {reference} (x)", "{:.2f}x"),
    ("mfu", "MFU", "{:.1%}"),
    ("median_step_ms", "step time median [p20-p80] (ms)", "{:.1f}"),
    ("warmup_s", "warm-up/compile (s)", "{:.1f}"),
    ("peak_mem_gib", "peak memory (GiB), reserved on a GPU", "{:.2f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("val_top1", "val top-1", "{:.1%}"),
    ("skipped_samples", "skipped samples", "{}"),
    ("finished", "finished", "{}"),
)
_OPTIONAL_COLUMNS = {"val_top1"}
SPEEDUP_ON_CPU = "n/a on CPU (smoke)"
"""What a table or figure shows for a speedup measured on a CPU: the smoke profile checks the code path, and its
CPU timings say nothing about the GPU speed a recipe is for."""


CPU_TIMINGS = "Timings on a CPU are not speedups: run on a GPU for the comparison"
"""What a CPU run says where a GPU run shows its speedups, its fastest recipe or rung, or bars to compare."""


def speedup_text(speedup: float | None, device: str | None, fmt: str = "{:.2f}x") -> str:
    """A speedup as tables and figures show it: ``SPEEDUP_ON_CPU`` for a CPU run."""
    return SPEEDUP_ON_CPU if device == "CPU" else _fmt(speedup, fmt)


@dataclass
class RunRecord:
    """One run read back from its folder."""

    recipe: str
    """The run folder's name (the recipe it was trained with, unless the folder was renamed)."""
    config: dict[str, Any]
    """The resolved ``config.json``, every field under its flat name (empty when the run died before writing it)."""
    steps: list[dict[str, Any]]
    """The ``step`` records of ``metrics.jsonl``, in file order."""
    summary: dict[str, Any] | None
    """The ``summary`` record, or ``None`` when the run did not finish."""
    run_dir: Path
    """The folder everything above was read from."""
    failure: RunFailure | None = None
    """Why the run stopped, when it recorded an error (``failure.json``)."""

    @property
    def finished(self) -> bool:
        return self.summary is not None


@dataclass
class Report:
    """What ``write_report`` produced; a notebook cell displays it as the table plus the figure."""

    table: list[dict[str, Any]]
    markdown: str
    figure: Figure
    paths: dict[str, Path]
    runs: list[RunRecord] = field(repr=False)
    _png: bytes = field(repr=False)
    failures: dict[str, RunFailure] = field(default_factory=dict)
    """The runs that stopped with an error, by recipe: shown in one line each, not in the table or the figure."""

    def _repr_markdown_(self) -> str:
        return with_inline_image(self.markdown, REPORT_PNG, self._png)


def with_inline_image(markdown: str, link: str, png: bytes) -> str:
    """``markdown`` with its image link ``](link)`` replaced by the PNG itself: in a notebook a relative link would
    resolve against the notebook's folder, not the report's."""
    data = base64.b64encode(png).decode("ascii")
    return markdown.replace(f"]({link})", f"](data:image/png;base64,{data})")


class _ReportFigure(Figure):
    """A ``Figure`` that renders itself in Jupyter even when pyplot (and its inline backend) was never imported."""

    def _repr_png_(self) -> bytes:
        return _png_bytes(self)


def _run_hint(recipe: str, train_command: str) -> str:
    return f"train it first: `{train_command.replace('{recipe}', recipe)}` or the notebook's training cell"


def load_run(run_dir: str | os.PathLike, *, train_command: str = TRAIN_COMMAND) -> RunRecord:
    """Reads one run folder (``config.json`` + ``metrics.jsonl``); an unfinished run loads with ``finished=False``.
    ``train_command``: how the errors say to produce a missing run (``{recipe}`` stands for its recipe)."""
    run_dir = Path(run_dir)
    config_path, metrics_path = run_dir / CONFIG_FILE, run_dir / METRICS_FILE
    if not config_path.is_file() and not metrics_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run (neither {CONFIG_FILE} nor {METRICS_FILE}): "
                                + _run_hint(run_dir.name, train_command))
    config = flat_config(json.loads(config_path.read_text(encoding="utf-8"))) if config_path.is_file() else {}
    steps, summary = read_metrics(metrics_path) if metrics_path.is_file() else ([], None)
    for key in ("model", "recipe"):
        # Both files are written by the same run; disagreeing files were copied in from another run's folder.
        if summary is not None and key in config and key in summary and config[key] != summary[key]:
            raise ValueError(f"{run_dir}: {METRICS_FILE} was written by {key}={summary[key]!r} but {CONFIG_FILE} "
                             f"says {key}={config[key]!r}, so the files come from different runs. Delete the "
                             f"folder and {_run_hint(run_dir.name, train_command)}.")
    return RunRecord(recipe=run_dir.name, config=config, steps=steps, summary=summary, run_dir=run_dir,
                     failure=read_failure(run_dir) if summary is None else None)


def load_runs(model_dir: str | os.PathLike, recipes: list[str] | None = None, *,
              train_command: str = TRAIN_COMMAND) -> list[RunRecord]:
    """Loads the runs of one model: the given recipes in that order, else all of them, ``baseline`` first."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"no runs for this model: {model_dir} does not exist; "
                                + _run_hint("baseline", train_command))
    found = sorted(p.name for p in model_dir.iterdir()
                   if p.is_dir() and ((p / CONFIG_FILE).is_file() or (p / METRICS_FILE).is_file()))
    if recipes is None:
        if not found:
            raise FileNotFoundError(f"no runs in {model_dir} (no subfolder with {METRICS_FILE}); "
                                    + _run_hint("baseline", train_command))
        recipes = sorted(found, key=lambda name: (name != "baseline", name))
    if not recipes:
        raise ValueError("recipes=[] selects no run: name at least one recipe, or pass None to load them all.")
    missing = [r for r in recipes if r not in found]
    if missing:
        raise FileNotFoundError(f"no run for recipe(s) {missing} in {model_dir} (found: {found or 'none'}); "
                                + _run_hint(missing[0], train_command))
    return [load_run(model_dir / r, train_command=train_command) for r in recipes]


def comparison_table(runs: list[RunRecord], reference: str = "baseline") -> list[dict[str, Any]]:
    """One row per run: speed, memory and loss figures, with the speedup over the ``reference`` recipe."""
    stats = [_run_stats(run) for run in runs]
    ref_speed = next((s["samples_per_s"] for run, s in zip(runs, stats) if run.recipe == reference), None)
    rows = []
    for run, s in zip(runs, stats):
        speed = s["samples_per_s"]
        rows.append({
            "recipe": run.recipe,
            "device": s["device_name"],
            "world_size": s["world_size"],
            "global_batch": s["global_batch_size"],
            "img_per_s": speed,
            "speedup": speed / ref_speed if speed is not None and ref_speed else None,
            "mfu": mfu(speed, s["train_flops_per_sample"], s["matmul_tflops"]),
            "cache_s": s["cache_time_s"],
            "median_step_ms": s["median_step_time_ms"],
            "p20_step_ms": s["p20_step_time_ms"],
            "p80_step_ms": s["p80_step_time_ms"],
            # Compilation before the first step (precompile) is part of the time to reach steady speed.
            "warmup_s": s["warmup_time_s"] + (s["precompile_time_s"] or 0.0) if s["warmup_time_s"] is not None
            else None,
            # On a GPU, reserved: what must fit (allocated undercounts CUDA graphs' pools and the allocator's cache).
            "peak_mem_gib": (s["peak_reserved_mb"] or s["peak_mem_mb"]) / 1024 if s["peak_mem_mb"] is not None
            else None,
            "peak_mem_reserved": bool(s["peak_reserved_mb"]),
            "final_loss": s["final_loss"],
            "val_top1": s["val_top1"],
            "skipped_samples": s["skipped_samples"],
            "finished": run.finished,
            "run_dir": str(run.run_dir),
        })
    return rows


def to_markdown(table: list[dict[str, Any]], reference: str = "baseline") -> str:
    """The table as GitHub markdown, with units in the headers and a legend line under it; a column no run has a
    figure for (val top-1 of a text-to-image model) is left out."""
    columns = [c for c in _COLUMNS if c[0] not in _OPTIONAL_COLUMNS or any(row[c[0]] is not None for row in table)]
    headers = [h.format(reference=reference) for _, h, _ in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in table:
        cells = []
        for key, _, fmt in columns:
            text = speedup_text(row[key], row["device"], fmt) if key == "speedup" else _fmt(row[key], fmt)
            if key == "median_step_ms" and row[key] is not None:
                text += f" [{_fmt(row['p20_step_ms'], fmt)}-{_fmt(row['p80_step_ms'], fmt)}]"
            if key == "finished":
                text = "yes" if row[key] else "no (no summary)"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    legend = ("Throughput is the median over the steady-state steps after warm-up (step time: median with p20-p80); "
              "warm-up/compile time is reported separately and excluded from it. Peak memory is rank 0's. MFU: "
              "the trained model's forward+backward FLOPs per sample times throughput, over this GPU's measured "
              "bf16 matmul rate (empty on a CPU).")
    if not all(row["finished"] for row in table):
        legend += " Unfinished runs (crashed or killed) show the figures of the steps they logged."
    return "\n".join(lines) + "\n\n" + legend + "\n"


_LINE_STYLES = ("-", "--", ":", "-.")


def comparison_figure(runs: list[RunRecord], reference: str = "baseline") -> Figure:
    """2x2 panels: (a) throughput with speedups, (b) step time per step, (c) peak memory, (d) loss curves."""
    table = comparison_table(runs, reference)
    colors = {run.recipe: f"C{i % 10}" for i, run in enumerate(runs)}
    names = [run.recipe for run in runs]
    fig = _ReportFigure(figsize=(12, 8.5), layout="constrained")
    ax_speed, ax_step, ax_mem, ax_loss = fig.subplots(2, 2).flat

    on_cpu = any(row["device"] == "CPU" for row in table)
    if on_cpu:  # no bars to set side by side: a CPU's timings check the code path (each run's steps are in (b))
        ax_speed.set_axis_off()
        ax_speed.set_title(f"(a) throughput: speedup {SPEEDUP_ON_CPU}")
        ax_speed.text(0.5, 0.5, CPU_TIMINGS.replace(": ", ":\n") + ".\nEach run's step times are in (b).",
                      ha="center", va="center", transform=ax_speed.transAxes, wrap=True)
    else:
        speeds = [row["img_per_s"] if row["img_per_s"] is not None else 0.0 for row in table]
        bars = ax_speed.bar(names, speeds, color=[colors[n] for n in names])
        labels = [_fmt(row["speedup"], "{:.2f}x") if row["speedup"] is not None
                  else _fmt(row["img_per_s"], "{:.1f}") for row in table]
        ax_speed.bar_label(bars, labels=_mark_unfinished(bars, table, labels), padding=2)
        ax_speed.set(title=f"(a) throughput, speedup vs {reference}", ylabel="img/s (higher is better)")
        ax_speed.margins(y=0.15)

    _plot_step_times(ax_step, runs, table, colors)

    mems = [row["peak_mem_gib"] if row["peak_mem_gib"] is not None else 0.0 for row in table]
    bars = ax_mem.bar(names, mems, color=[colors[n] for n in names])
    labels = [_fmt(row["peak_mem_gib"], "{:.2f}") for row in table]
    ax_mem.bar_label(bars, labels=_mark_unfinished(bars, table, labels), padding=2)
    ax_mem.set(title="(c) peak memory (rank 0; reserved on a GPU)", ylabel="GiB (lower is better)")
    ax_mem.margins(y=0.15)

    # Identical curves would hide each other: each run gets its own line style, and its largest per-step distance
    # from the reference's loss is in its label.
    reference_losses = next((dict(zip(*_series(r.steps, "loss"))) for r in runs if r.recipe == reference), None)
    for i, run in enumerate(runs):
        steps, losses = _series(run.steps, "loss")
        label = run.recipe
        shared = [(loss, reference_losses[step]) for step, loss in zip(steps, losses)
                  if reference_losses and run.recipe != reference and step in reference_losses]
        if shared:
            label += f" (largest step difference from {reference}: {max(abs(a - b) for a, b in shared):.2g})"
        ax_loss.plot(steps, losses, color=colors[run.recipe], linestyle=_LINE_STYLES[i % len(_LINE_STYLES)],
                     label=label)
    ax_loss.set(title="(d) training loss", xlabel="step", ylabel="loss")
    if runs:
        ax_loss.legend()

    model = runs[0].config.get("model", runs[0].run_dir.parent.name) if runs else ""
    title = f"{model}: {_describe(table, 'device')}\nglobal batch {_describe(table, 'global_batch')}"
    if on_cpu:
        title += "\non a CPU these timings check the code path; they are not speed measurements"
    fig.suptitle(title)
    return fig


def write_report(model_dir: str | os.PathLike, recipes: list[str] | None = None, reference: str = "baseline", *,
                 train_command: str = TRAIN_COMMAND) -> Report:
    """Writes ``<model_dir>/report.md`` and ``report.png`` comparing the recipes' runs, and returns them;
    ``train_command`` as ``load_run`` takes it."""
    model_dir = Path(model_dir)
    loaded = load_runs(model_dir, recipes, train_command=train_command)
    runs = [run for run in loaded if run.failure is None]
    failures = {run.recipe: run.failure for run in loaded if run.failure is not None}
    table = comparison_table(runs, reference)
    figure = comparison_figure(runs, reference)
    model = loaded[0].config.get("model", model_dir.name)
    run_lines = [f"- `{run.recipe}`: [{run.recipe}/]({run.recipe}/) (`{run.run_dir}`), metrics in "
                 f"[{run.recipe}/{METRICS_FILE}]({run.recipe}/{METRICS_FILE})"
                 + ("" if run.finished else " (unfinished: no summary line)") + _memory_plan(run) for run in runs]
    stopped = "".join(f"- {failure.line(name)}\n" for name, failure in failures.items())
    markdown = (f"# {model}: recipe comparison\n\n{to_markdown(table, reference)}\n"
                + (f"{stopped}\n" if stopped else "") + f"![comparison]({REPORT_PNG})\n\n"
                "## Runs\n\n" + "\n".join(run_lines) + "\n")
    paths = {"markdown": model_dir / REPORT_MD, "figure": model_dir / REPORT_PNG}
    png = _png_bytes(figure)
    paths["figure"].write_bytes(png)
    paths["markdown"].write_text(markdown, encoding="utf-8")
    if any(run.config.get("report_to") == "tensorboard" for run in runs):
        from gallery_lib.run.tensorboard import log_figure

        paths["tensorboard"] = model_dir / "tensorboard"
        log_figure(paths["tensorboard"], "recipe comparison", figure)
    return Report(table=table, markdown=markdown, figure=figure, paths=paths, runs=runs, _png=png,
                  failures=failures)


def _memory_plan(run: RunRecord) -> str:
    """``; memory plan, 22.0 GiB (...): batch 8, gradient checkpointing (...)`` where the run had one."""
    plan = (run.summary or {}).get("memory_plan")
    return f"; {MemoryPlan.from_dict(plan).note()}" if plan else ""


def mfu(samples_per_s: float | None, flops_per_sample: float | None, matmul_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: training FLOPs per second over the GPU's measured bf16 matmul rate (``flops.py``)."""
    if not (samples_per_s and flops_per_sample and matmul_tflops):
        return None
    return samples_per_s * flops_per_sample / (matmul_tflops * 1e12)


def _run_stats(run: RunRecord) -> dict[str, Any]:
    """The summary's figures; those it lacks (an unfinished run) are computed the same way from the step records."""
    steady = [s["step_time_ms"] for s in run.steps if not s.get("warmup") and s.get("step_time_ms") is not None]
    warm = [s["step_time_ms"] for s in run.steps if s.get("warmup") and s.get("step_time_ms") is not None]
    speeds = [s["samples_per_s"] for s in run.steps if not s.get("warmup") and s.get("samples_per_s") is not None]
    mems = [s["peak_mem_mb"] for s in run.steps if s.get("peak_mem_mb") is not None]
    world = run.config.get("nproc_per_node")
    batch = run.config.get("batch_size")
    stats: dict[str, Any] = {
        "device_name": None,
        "world_size": world,
        "global_batch_size": batch * world if batch is not None and world is not None else None,
        "samples_per_s": float(np.median(speeds)) if speeds else None,
        "median_step_time_ms": float(np.median(steady)) if steady else None,
        "p20_step_time_ms": float(np.percentile(steady, 20)) if steady else None,
        "p80_step_time_ms": float(np.percentile(steady, 80)) if steady else None,
        "warmup_time_s": sum(warm) / 1000 if run.steps else None,
        "precompile_time_s": None,
        "peak_mem_mb": max(mems) if mems else None,
        "peak_reserved_mb": None,  # the summary's: step records have no reserved figure
        "final_loss": run.steps[-1].get("loss") if run.steps else None,
        # Step records carry the running total of skipped samples; the summary holds the run's total.
        "skipped_samples": max((s.get("skipped_samples") or 0 for s in run.steps), default=0),
        "train_flops_per_sample": None,
        "matmul_tflops": None,
        "cache_time_s": None,
        "val_top1": None,
    }
    if run.summary is not None:
        stats.update({k: v for k, v in run.summary.items() if k in stats})
    return stats


def _plot_step_times(ax, runs: list[RunRecord], table: list[dict[str, Any]], colors: dict[str, str]) -> None:
    warm_steps = [s["step"] for run in runs for s in run.steps if s.get("warmup")]
    for run, row in zip(runs, table):
        steps, times = _series(run.steps, "step_time_ms")
        ax.plot(steps, times, color=colors[run.recipe],
                label=f"{run.recipe} (median {_fmt(row['median_step_ms'], '{:.1f}')} ms)")
        warm = [(s["step"], s["step_time_ms"]) for s in run.steps
                if s.get("warmup") and s.get("step_time_ms") is not None]
        if warm:
            ax.scatter(*zip(*warm), marker="o", facecolors="none", edgecolors=colors[run.recipe], zorder=3)
    if warm_steps:
        first = min(s["step"] for run in runs for s in run.steps)
        ax.axvspan(first - 0.5, max(warm_steps) + 0.5, color="0.85", zorder=0, label="warm-up (excluded)")
    medians = [row["median_step_ms"] for row in table if row["median_step_ms"]]
    slowest = max((s.get("step_time_ms") or 0.0 for run in runs for s in run.steps), default=0.0)
    if medians and slowest > _LOG_Y_RATIO * max(medians):
        ax.set_yscale("log")
    ax.set(title="(b) step time (warm-up shaded, hollow markers)", xlabel="step", ylabel="ms (lower is better)")
    if runs:
        ax.legend(fontsize="small")


def _series(steps: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """x = step, y = ``key``; missing or non-finite values (written as null) become NaN gaps."""
    x = np.array([s["step"] for s in steps], dtype=float)
    y = np.array([s.get(key) if s.get(key) is not None else math.nan for s in steps], dtype=float)
    return x, y


def _mark_unfinished(bars, table: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """Hatches the bars of unfinished runs and says so in their labels."""
    for bar, row in zip(bars, table):
        if not row["finished"]:
            bar.set_hatch("//")
    return [label + ("" if row["finished"] else "\n(unfinished)") for label, row in zip(labels, table)]


def _describe(table: list[dict[str, Any]], key: str) -> str:
    """One value when the runs that know it agree, else each run's value with its recipe."""
    known = {row[key] for row in table if row[key] is not None}
    if len(known) <= 1:
        return _fmt(known.pop() if known else None, "{}")
    return ", ".join(f"{row[key]} ({row['recipe']})" for row in table if row[key] is not None)


def _fmt(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()
