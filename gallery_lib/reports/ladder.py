"""The optimization ladder's report: each rung's speed and memory beside the talk's A100 figures.

``ladder_report(results, model_dir)`` takes what ``gallery_lib.recipes.ladder.run_ladder`` returned and writes
``ladder.md``, ``ladder.png`` and ``ladder.json`` into the model's output folder. Speedups are throughput ratios
(images per second), so a rung that changes the batch size is compared fairly; the ``gain`` column compares a rung
with the rung it builds on, which is what the rung itself bought.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from gallery_lib.recipes.ladder import RungResult, recipe_name
from gallery_lib.reports.comparison import CPU_TIMINGS, _png_bytes, _ReportFigure, speedup_text, with_inline_image
from gallery_lib.run.summary import compile_caches, planned_setting
from gallery_lib.run.memory_plan import PLAN, MemoryPlan

LADDER_MD, LADDER_PNG, LADDER_JSON = "ladder.md", "ladder.png", "ladder.json"
BOUGHT_NOTHING = 1.03
"""A rung whose throughput is within 3% of the rung it builds on bought nothing measurable."""


def ladder_rows(results: list[RungResult]) -> list[dict[str, Any]]:
    """One row per rung: its throughput, step time and peak memory, its speedup over the first rung that ran (the
    ladder's first, unless it did not fit this GPU: ``speedup_over``), its gain over the rung it builds on, and the
    talk's figures."""
    speed = {r.rung.name: r.summary["samples_per_s"] for r in results if r.summary}
    reference = next((r.rung for r in results if r.summary), None)
    first = speed[reference.name] if reference else None
    rows = []
    for result in results:
        rung, summary, parent = result.rung, result.summary, result.builds_on
        planned = planned_setting(summary)  # where the memory plan changed the rung's setting to fit its GPU
        row: dict[str, Any] = {
            "rung": recipe_name(rung), "name": rung.name, "title": rung.title, "builds_on": parent,
            "batch_size": result.config.batch_size if result.config else None,
            "img_per_s": None, "median_step_ms": None, "p20_step_ms": None, "p80_step_ms": None, "peak_mem_gib": None,
            "peak_reserved_gib": None,
            "speedup": None, "gain": None, "talk_speedup": rung.talk[0] if rung.talk else None,
            "talk_peak_mem_gb": rung.talk[1] if rung.talk else None, "failure": result.failure,
            "failure_line": result.line() if result.failure else None, "does_not_fit": result.does_not_fit,
            "setting": f"{planned.short()} (memory plan)" if planned else None,
            "device": summary["device_name"] if summary else None,
            "compile_caches": compile_caches(summary) if summary else None,
            "speedup_over": recipe_name(reference) if reference else None,
        }
        if summary:
            row.update(img_per_s=summary["samples_per_s"], median_step_ms=summary["median_step_time_ms"],
                       p20_step_ms=summary["p20_step_time_ms"], p80_step_ms=summary["p80_step_time_ms"],
                       peak_mem_gib=summary["peak_mem_mb"] / 1024)
            if summary.get("peak_reserved_mb"):  # what must fit on a GPU (CUDA graphs' pools included)
                row["peak_reserved_gib"] = summary["peak_reserved_mb"] / 1024
            row["speedup"] = row["img_per_s"] / first if first else None
            row["gain"] = row["img_per_s"] / speed[parent] if parent in speed else None
        rows.append(row)
    return rows


def findings(rows: list[dict[str, Any]], *, failures: bool = True) -> list[str]:
    """What the ladder says on this machine, from its own numbers: the top speedup, the rungs that bought nothing,
    and (``failures``) the ones that did not run, which the report's table lists under it already."""
    lines = []
    ran = [row for row in rows if row["img_per_s"] is not None]
    on_cpu = any(row["device"] == "CPU" for row in ran)
    if on_cpu:  # no fastest rung and no gains: a few timed CPU steps rank nothing
        lines.append(f"{len(ran)} of {len(rows)} rungs ran on a CPU, each checking its code path. {CPU_TIMINGS}.")
    elif ran:
        top = max(ran, key=lambda row: row["img_per_s"])
        over = (f"{top['speedup']:.2f}x {_reference(rows)}" if top["rung"] != top["speedup_over"] else
                "the only rung that ran here" if len(ran) == 1 else "the first that ran here, which no later rung beat")
        lines.append(f"Fastest rung: {top['title']} ({top['rung']}), {top['img_per_s']:.1f} img/s, {over}, "
                     f"on {top['device']}.")
    flat = [f"{row['title']} ({row['gain']:.2f}x)" for row in ran
            if row["gain"] is not None and row["gain"] < BOUGHT_NOTHING and not on_cpu]
    if flat:
        lines.append("Bought no speed here (under 3% over the rung each builds on): " + ", ".join(flat) + ".")
    if ran and not on_cpu:
        lines += _made_of(rows, max(ran, key=lambda row: row["img_per_s"]))
    compiled = [row for row in ran if row["compile_caches"]]
    if compiled:
        lines.append("Compile caches at each compiled rung's start: " + ", ".join(
            f"{row['title']} {row['compile_caches']}" for row in compiled)
            + " (cold: the rung compiled its graphs; warm: it loaded them all from an earlier rung's).")
    for row in rows:
        if row["failure"] and failures:
            lines.append(f"{_failure_line(row)}.")
    return lines


def _made_of(rows: list[dict[str, Any]], top: dict[str, Any]) -> list[str]:
    """What ``top``'s speedup over the first rung is made of: the gains of the rungs on its path (each over the rung
    it builds on multiply to the speedup), largest first, those that bought nothing lumped together."""
    by_name = {row["name"]: row for row in rows}
    path, row = [], top
    while row["rung"] != top["speedup_over"]:
        if row["gain"] is None:
            return []  # a rung on the path did not run: its share is unknown
        path.append(row)
        row = by_name.get(row["builds_on"])
        if row is None:
            return []
    if not path:
        return []
    bought = sorted((r for r in path if r["gain"] >= BOUGHT_NOTHING), key=lambda r: -r["gain"])
    rest = [r for r in path if r["gain"] < BOUGHT_NOTHING]
    parts = [f"{r['title']} {r['gain']:.2f}x" for r in bought]
    if rest:
        product = 1.0
        for r in rest:
            product *= r["gain"]
        parts.append(f"the other {len(rest)} rung{'s' if len(rest) > 1 else ''} together {product:.2f}x")
    return [f"What the {top['speedup']:.2f}x of {top['title']} is made of (each rung's gain over the one it builds on; "
            "they multiply to it): " + ", ".join(parts) + "."]


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """The rungs that ran as a table; each rung that did not, one line under it."""
    head = ("| rung | batch | img/s | step ms [p20-p80] | peak GiB: reserved (allocated) | speedup | "
            "gain over the rung below | talk: speedup | talk: GB |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in _ran(rows):
        step = f"{row['median_step_ms']:.1f} [{row['p20_step_ms']:.1f}-{row['p80_step_ms']:.1f}]"
        lines.append(f"| {row['rung']} ({row['title']}) | {row.get('setting') or _fmt(row['batch_size'], '{}')} | "
                     f"{_fmt(row['img_per_s'], '{:.1f}')} | {step} | {_memory(row)} | "
                     f"{speedup_text(row['speedup'], row['device'])} | "
                     f"{speedup_text(row['gain'], row['device'])} | "
                     f"{_fmt(row['talk_speedup'], '{:.2f}x')} | {_fmt(row['talk_peak_mem_gb'], '{:.1f}')} |")
    if _later_reference(rows) is not None:
        lines += ["", f"Speedups over {_reference(rows)}; the talk's over its first rung."]
    not_run = [f"- {_failure_line(row)}" for row in rows if row["failure"]]
    return "\n".join(lines + ([""] + not_run if not_run else []))


def _memory(row: dict[str, Any]) -> str:
    """Reserved (allocated) GiB on a GPU; the one figure a CPU run has (its resident memory)."""
    allocated = _fmt(row["peak_mem_gib"], "{:.1f}")
    return allocated if row["peak_reserved_gib"] is None else f"{row['peak_reserved_gib']:.1f} ({allocated})"


def _peak_memory(row: dict[str, Any]) -> float | None:
    return row["peak_reserved_gib"] if row["peak_reserved_gib"] is not None else row["peak_mem_gib"]


def _ran(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if row["img_per_s"] is not None]


def _later_reference(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rung the speedups are over where it is not the ladder's first (the rungs below it did not run), or
    ``None``."""
    over = next((row for row in rows if row["rung"] == rows[0]["speedup_over"]), None)
    return None if over is None or over is rows[0] else over


def _reference(rows: list[dict[str, Any]]) -> str:
    """What the speedups are over: the first rung, or the first that ran where the rungs below it did not."""
    over = _later_reference(rows)
    return "the first rung" if over is None else f"{over['title']} ({over['rung']}), the first rung that ran here"


def _talk_over_reference(row: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """The talk's speedup for ``row`` over the rung this machine's speedups are over (``None`` where the talk has
    no figure for either)."""
    over = next((other for other in rows if other["rung"] == row["speedup_over"]), None)
    if row["talk_speedup"] is None or over is None or over["talk_speedup"] is None:
        return None
    return row["talk_speedup"] / over["talk_speedup"]


def _failure_line(row: dict[str, Any]) -> str:
    return row.get("failure_line") or f"{row['rung']} ({row['title']}): did not run, {row['failure']}"


def ladder_figure(rows: list[dict[str, Any]]) -> Figure:
    """(a) cumulative speedup per rung, (b) peak memory per rung, for the rungs that ran; the talk's A100 figures as
    black markers. On a CPU, where timings are no speedups, (a) shows each rung's median step time with its p20-p80
    range instead: no ratio, no bars to compare, no talk's figures. Where the first rungs did not fit, the talk's
    speedups are taken over the rung the bars are over, so the two stay comparable."""
    reference = _reference(rows)
    rows = [{**row, "peak_memory": _peak_memory(row), "talk_over_reference": _talk_over_reference(row, rows)}
            for row in _ran(rows)]
    on_cpu = any(row["device"] == "CPU" for row in rows)
    fig = _ReportFigure(figsize=(12, 8), layout="constrained")
    ax_speed, ax_mem = fig.subplots(2, 1, sharex=True)
    x = range(len(rows))
    labels = [f"{row['rung'].split('-')[1]}. {row['title']}" for row in rows]
    panels = [(ax_mem, "peak_memory", "talk_peak_mem_gb", "{:.1f}", "(b) peak memory" + ("" if on_cpu else " reserved"),
               "GiB (the talk: GB)")]
    if on_cpu:
        _plot_cpu_step_times(ax_speed, rows)
    else:
        panels.insert(0, (ax_speed, "speedup", "talk_over_reference", "{:.2f}x", f"(a) throughput over {reference}",
                          "speedup"))
    for ax, key, talk_key, fmt, title, unit in panels:
        values = [row[key] if row[key] is not None else 0.0 for row in rows]
        bars = ax.bar(x, values, color=["C0" if row["talk_speedup"] is not None else "C1" for row in rows])
        ax.bar([0], [0], color="C0", label="the talk's rungs, this machine")  # legend entries for the two colours
        ax.bar([0], [0], color="C1", label="past the talk, this machine")
        ax.bar_label(bars, labels=[fmt.format(row[key]) if row[key] is not None else "" for row in rows],
                     padding=2, fontsize=8)
        talk = [] if on_cpu else [(i, row[talk_key]) for i, row in enumerate(rows) if row[talk_key] is not None]
        if talk:
            ax.plot(*zip(*talk), "kD--", label="the talk (one 80 GB A100)")
        ax.set(title=title, ylabel=unit)
        top = max([v for v in values] + [value for _, value in talk] + [1.0])
        ax.set_ylim(0, top * 1.35)  # headroom for the legend above the bars
        ax.legend(loc="upper center", ncols=3, fontsize=8)
    ax_mem.set_xticks(list(x), labels, rotation=35, ha="right")
    device = next((row["device"] for row in rows if row["device"]), "no rung ran")
    caveat = " (CPU smoke figures: they check each rung's code path, not its speed)" if on_cpu else ""
    fig.suptitle(f"Stable Diffusion UNet training, rung by rung, on {device}{caveat}")
    return fig


def _plot_cpu_step_times(ax, rows: list[dict[str, Any]]) -> None:
    """Each rung's median step time, p20-p80 as its range: what a CPU ladder shows instead of its speedups."""
    for i, row in enumerate(rows):
        low, high = row["median_step_ms"] - row["p20_step_ms"], row["p80_step_ms"] - row["median_step_ms"]
        ax.errorbar([i], [row["median_step_ms"]], yerr=[[max(low, 0.0)], [max(high, 0.0)]], fmt="o", capsize=3,
                    color="C0" if row["talk_speedup"] is not None else "C1")
    ax.set(title=f"(a) median step time [p20-p80] on a CPU (smoke)\n{CPU_TIMINGS}", ylabel="ms per step")
    ax.set_ylim(bottom=0)


@dataclass
class LadderReport:
    """What ``ladder_report`` wrote; a notebook cell shows the table (the rungs that did not run under it) and the
    figure, and prints the findings after them (``findings``): ``ladder.md`` holds all three."""

    rows: list[dict[str, Any]]
    markdown: str
    figure: Figure
    paths: dict[str, Path]
    png: bytes = field(repr=False)
    """The figure as written to ``ladder.png``, rendered once."""

    def _repr_markdown_(self) -> str:
        shown = f"# The optimization ladder\n\n{to_markdown(self.rows)}\n\n![ladder]({LADDER_PNG})\n"
        return with_inline_image(shown, LADDER_PNG, self.png)


def ladder_report(results: list[RungResult], model_dir: str | os.PathLike) -> LadderReport:
    """Writes ``ladder.md``, ``ladder.png`` and ``ladder.json`` (the rows) into ``model_dir`` and returns them."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    rows = ladder_rows(results)
    figure = ladder_figure(rows)
    markdown = ("# The optimization ladder\n\n" + to_markdown(rows) + "\n\n"
                + "\n".join(f"- {line}" for line in findings(rows, failures=False))
                + f"\n\n![ladder]({LADDER_PNG})\n")
    paths = {"markdown": model_dir / LADDER_MD, "figure": model_dir / LADDER_PNG, "rows": model_dir / LADDER_JSON}
    paths["markdown"].write_text(markdown, encoding="utf-8")
    png = _png_bytes(figure)
    paths["figure"].write_bytes(png)
    paths["rows"].write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return LadderReport(rows=rows, markdown=markdown, figure=figure, paths=paths, png=png)


def _fmt(value: Any, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


class LadderPlan:
    """What each rung changes on this machine, read from the resolved configs, and on a GPU the setting the memory
    plan gives it; shows as a Markdown table."""

    def __init__(self, rows: list[tuple[str, ...]]) -> None:
        self.rows = rows

    def _repr_markdown_(self) -> str:
        planned = any(len(row) > 4 for row in self.rows)
        head = ["rung", "builds on", "switches it changes", "what they do"] + (["on this GPU"] if planned else [])
        lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
        lines += [f"| {' | '.join(row + ('',) * (len(head) - len(row)))} |" for row in self.rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._repr_markdown_()


def ladder_plan(base, rungs: list[str] | None = None, *, sizes=None) -> LadderPlan:
    """Each rung's config against the config it builds on: the fields it changes, as ``field=value``; on a GPU, the
    setting the memory plan picks for it (each rung keeps its global batch)."""
    from gallery_lib.recipes.ladder import fit_rungs, rung_budget, rung_chain, rung_named, rung_parents
    from gallery_lib.recipes import runs_on_gpu

    on_gpu = runs_on_gpu(base)
    configs = rung_chain(base, sizes=sizes, on_gpu=on_gpu)
    wanted = [rung_named(name).name for name in rungs] if rungs else list(configs)
    fitted = fit_rungs(configs, wanted, budget=rung_budget(base, on_gpu))
    parents = rung_parents(on_gpu)
    rows = []
    for name in wanted:
        cfg, rung, under_name = configs[name], rung_named(name), parents[name]
        if cfg is None:
            changes = "(left out: needs a GPU)"
        else:
            now, then = cfg.to_dict(), (configs[under_name] if under_name else base).to_dict()
            changes = ", ".join(f"`{k}={v}`" for k, v in now.items()
                                if then.get(k) != v and k not in ("recipe", "extra"))
        row = (f"{recipe_name(rung)}: {rung.title}", under_name or "the profile", changes, rung.why)
        planned = fitted[name].extra.get(PLAN) if fitted[name] is not None else None
        if planned:
            plan, below = MemoryPlan.from_dict(planned), configs[under_name] if under_name else None
            # run_ladder moves the start of such a rung to where the rung below it ran, once that one has run
            follows = plan.probe and below is not None and not rung.frees_memory and (
                below.global_batch_size == cfg.global_batch_size)
            row += (plan.cell() + (", or from where the rung it builds on ran" if follows else ""),)
        rows.append(row)
    return LadderPlan(rows)
