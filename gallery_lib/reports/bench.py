"""The table and figure of a ``gallery bench`` result file: samples/s per model, recipe and batch size, each as a
ratio over the ``peer`` recipe at the same batch (the strongest plain-PyTorch setup, which ``accelerated`` has to
beat). Both read the file's rows only; a failed run shows its error where its numbers would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

REFERENCE = "peer"

Row = dict[str, Any]


def processes(row: Row) -> int:
    """How many processes (GPUs) the row's run used; rows written before the bench recorded it ran on one."""
    return row.get("processes", 1)


def find_row(rows: Sequence[Row], model: str, recipe: str, batch_size: int,
             procs: int | None = None) -> Row | None:
    """The row of ``recipe`` for ``model`` at ``batch_size`` per process, on ``procs`` processes (any, if None; the
    first, if the file holds several)."""
    return next((r for r in rows if (r["model"], r["recipe"], r["batch_size"]) == (model, recipe, batch_size)
                 and procs in (None, processes(r))), None)


def ratio_over_peer(rows: Sequence[Row], row: Row) -> float | None:
    """``row``'s samples/s over the peer's at the same model, batch size and process count; ``None`` if either has
    no number."""
    peer = find_row(rows, row["model"], REFERENCE, row["batch_size"], processes(row))
    if "error" in row or peer is None or "error" in peer:
        return None
    return row["samples_per_s"] / peer["samples_per_s"]


def scaling(rows: Sequence[Row], row: Row) -> float | None:
    """``row``'s samples/s over N times the same run's on one process (N = its process count): 1.0 is perfect
    scaling. ``None`` on one process, or without a one-process row to compare with."""
    one = find_row(rows, row["model"], row["recipe"], row["batch_size"], 1)
    if processes(row) == 1 or "error" in row or one is None or "error" in one:
        return None
    return row["samples_per_s"] / (processes(row) * one["samples_per_s"])


def bench_table(rows: Sequence[Row]) -> str:
    """A markdown table of the rows, in run order."""
    head = ("| model | recipe | batch | processes | samples/s | vs peer | scaling | step ms: median (p20-p80) | "
            "peak GiB: reserved (allocated) | MFU | compile s | to steady speed s (caches) |\n" + "|---" * 12 + "|")
    return "\n".join([head, *(_table_line(rows, row) for row in rows)])


def _table_line(rows: Sequence[Row], row: Row) -> str:
    start = f"| {row['model']} | {row['recipe']} | {row['batch_size']} | {processes(row)} |"
    if "error" in row:
        return f"{start} error: {row['error']} | | | | | | | |"
    return (f"{start} {row['samples_per_s']:,.1f} | {_fmt(ratio_over_peer(rows, row), '{:.2f}x')} | "
            f"{_fmt(scaling(rows, row), '{:.1%}')} | {row['median_step_ms']:.1f} "
            f"({row['p20_step_ms']:.1f}-{row['p80_step_ms']:.1f}) | {_memory(row)} | "
            f"{_fmt(row['mfu'], '{:.1%}')} | {row['compile_s']:.1f} | {_steady(row)} |")


def _memory(row: Row) -> str:
    """Peak reserved memory, what must fit on the GPU (allocated undercounts: CUDA graphs' pools, the allocator's
    cache), then peak allocated; a CPU run has its peak resident size only."""
    allocated = f"{row['peak_mem_gib']:.2f}"
    if row.get("peak_reserved_gib") is None:
        return allocated if row.get("peak_mem_kind") != "cpu_max_rss" else f"{allocated} (resident)"
    return f"{row['peak_reserved_gib']:.2f} ({allocated})"


def _steady(row: Row) -> str:
    """Rows written before ``to_steady_s`` existed have no such number."""
    if row.get("to_steady_s") is None:
        return ""
    return f"{row['to_steady_s']:.1f}" + (f" ({row['compile_caches']})" if row.get("compile_caches") else "")


def _fmt(value: float | None, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


def bench_figure(record: dict) -> Figure:
    """One panel per model: samples/s of each recipe (bars) at each batch size (groups), labelled with the ratio
    over ``peer``; a failed run is a labelled gap."""
    rows = record["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    fig = Figure(figsize=(max(6.0, 1.6 * len(recipes) * _most_batches(rows)), 3.4 * max(1, len(models))),
                 layout="constrained")
    colors = {recipe: f"C{i}" for i, recipe in enumerate(recipes)}
    for i, model in enumerate(models):
        ax = fig.add_subplot(len(models), 1, i + 1)
        _plot_model(ax, [r for r in rows if r["model"] == model], recipes, colors)
        ax.set_title(model, loc="left")
    fig.legend(handles=[Patch(color=colors[r], label=r) for r in recipes], loc="outside lower center",
               ncols=len(recipes), fontsize="small")
    fig.suptitle(f"gallery bench on {record.get('device') or record.get('gpu') or 'CPU'} (torch {record['torch']}, "
                 f"{record['date'][:10]})\ntraining step alone; bar labels: samples/s as a ratio over {REFERENCE}",
                 fontsize="medium")
    return fig


def _most_batches(rows: Sequence[Row]) -> int:
    per_model: dict[str, set[int]] = {}
    for r in rows:
        per_model.setdefault(r["model"], set()).add(r["batch_size"])
    return max((len(v) for v in per_model.values()), default=1)


def _plot_model(ax, rows: Sequence[Row], recipes: Sequence[str], colors: dict[str, str]) -> None:
    batches = sorted({r["batch_size"] for r in rows})
    width = 0.8 / len(recipes)
    top = max((r["samples_per_s"] for r in rows if "error" not in r), default=1.0)
    for j, recipe in enumerate(recipes):
        for k, batch in enumerate(batches):
            row = find_row(rows, rows[0]["model"], recipe, batch)
            if row is None:
                continue
            x = k - 0.4 + width * (j + 0.5)
            if "error" in row:
                ax.text(x, 0.02 * top, "OOM" if row["error"] == "out of memory" else "failed", rotation=90,
                        ha="center", va="bottom", fontsize="x-small", color=colors[recipe])
                continue
            ax.bar(x, row["samples_per_s"], width, color=colors[recipe])
            ratio = ratio_over_peer(rows, row)
            if ratio is not None and recipe != REFERENCE:
                ax.text(x, row["samples_per_s"], f"{ratio:.2f}x", ha="center", va="bottom", fontsize="x-small")
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("samples/s")
    ax.set_ylim(0, top * 1.18)


def write_figure(record: dict, path: str | Path) -> Path:
    """Saves the figure of ``record`` as a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bench_figure(record).savefig(path, dpi=110)
    return path
