"""A ladder for the user's own model: each acceleration's training steps timed against the rung below, with the loss
curves compared step by step (the ``your_model`` notebook).

The loop stays the user's; it marks step boundaries with a ``StepTimer`` (CUDA events on a GPU) and hands its losses
and step times to the ladder::

    ladder = StepLadder(batch_size=64, warmup=10)
    ladder.add("plain PyTorch", losses, times_ms)
    ladder.add("+ compiled blocks", losses, times_ms, changes=[compile_blocks(model)])
    ladder        # in a notebook: the table and the figure

or, so that a rung that runs out of GPU memory is one line and the next still runs, around each rung::

    with ladder.rung("+ compiled blocks") as record:
        record(*train(model), changes=[compile_blocks(model)])
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from gallery_lib.config import ConfigError
from gallery_lib.config.quiet import quiet_known_noise
from gallery_lib.reports.comparison import CPU_TIMINGS, _png_bytes, _ReportFigure, speedup_text, with_inline_image
from gallery_lib.reports.provenance import source_version
from gallery_lib.run.batch_size import allocator_detail, is_out_of_memory
from gallery_lib.run.memory_plan import give_back_cached_gpu_memory
from gallery_lib.run.timing import StepTimer, peak_reserved_mb, reset_peak_memory, summarize_times

__all__ = ["StepLadder", "StepTimer"]

_LINE_STYLES = ("-", "--", ":", "-.")


@dataclass
class StepRung:
    name: str
    losses: list[float]
    times_ms: list[float]
    """Every step's time, warm-up included."""
    changes: list[Any] = field(default_factory=list)
    """What the rung's calls said they changed (``gallery_lib.accel.on_any_model.Change``)."""
    builds_on: str | None = None
    """The rung its gain is measured over (default: the one added before it)."""
    peer: bool = False
    """The strongest plain-PyTorch setup: every rung's speed is also compared with it."""
    peak_reserved_gib: float | None = None
    """The most GPU memory the caching allocator held during the rung (``None`` on a CPU, or where not measured)."""


class StepLadder:
    """Rungs in the order they were added; each is compared with the first (speedup, loss curve) and the one
    before it (gain)."""

    def __init__(self, *, batch_size: int, warmup: int, device: str = "cuda", steps: int | None = None) -> None:
        """``steps``: each rung's steps, where known, checked against ``warmup`` before any rung trains."""
        if warmup < 0:
            raise ConfigError(f"StepLadder: warmup={warmup} must be >= 0")
        if steps is not None and steps <= warmup:
            raise ConfigError(f"steps={steps} with warmup_steps={warmup}: the steps count the warm-up, so there must "
                              "be more of them than of warm-up steps")
        self.batch_size, self.warmup, self.device = batch_size, warmup, device
        self.rungs: list[StepRung] = []
        self.stopped: dict[str, str] = {}
        """Rungs that ran out of GPU memory (``rung``), with the line that says so."""
        quiet_known_noise()  # its rungs train and compile in this process: the same quiet as a gallery run

    def add(self, name: str, losses: Sequence[float], times_ms: Sequence[float], changes: Sequence[Any] = (), *,
            builds_on: str | None = None, peer: bool = False, peak_reserved_gib: float | None = None) -> dict[str, Any]:
        """Records a rung and returns its row; needs more steps than ``warmup`` to time any. ``builds_on`` names
        the rung its gain is over (default: the one before); ``peer`` marks the plain-PyTorch setup to beat;
        ``peak_reserved_gib``, the GPU memory it held at most (``rung`` measures it)."""
        if len(times_ms) <= self.warmup:
            raise ValueError(f"StepLadder.add({name!r}): {len(times_ms)} step times, but the first {self.warmup} "
                             "are warm-up: run more steps")
        if builds_on is not None and builds_on not in [rung.name for rung in self.rungs] + list(self.stopped):
            raise ValueError(f"StepLadder.add({name!r}): builds_on={builds_on!r} names no rung added before it")
        self.rungs.append(StepRung(name, [float(v) for v in losses], [float(t) for t in times_ms], list(changes),
                                   builds_on, peer, peak_reserved_gib))
        return self.rows()[-1]

    @contextlib.contextmanager
    def rung(self, name: str, *, builds_on: str | None = None, peer: bool = False,
             echo: Callable[[str], None] | None = print) -> Iterator[Callable[..., None]]:
        """Around one rung: yields ``record(losses, times_ms, changes=())``, which adds it (``add``) and says its step
        time. The rung starts from a clean compiler: what the rungs before compiled, and the memory of their CUDA
        graphs, is dropped (each rung's warm-up is its own, and a small GPU holds one rung at a time). A rung that
        runs out of GPU memory is recorded as stopped, in one line that says what to try, and the next one runs."""
        torch._dynamo.reset()
        give_back_cached_gpu_memory()
        on_gpu = torch.device(self.device).type == "cuda" and torch.cuda.is_available()
        if on_gpu:
            reset_peak_memory(torch.device(self.device))  # the rung's own peak, not the rungs' before it

        def record(losses: Sequence[float], times_ms: Sequence[float], changes: Sequence[Any] = ()) -> None:
            peak = peak_reserved_mb(torch.device(self.device)) if on_gpu else None
            row = self.add(name, losses, times_ms, changes, builds_on=builds_on, peer=peer,
                           peak_reserved_gib=None if peak is None else peak / 1024)
            if echo:
                echo(f"  -> {row['median_step_time_ms']:.1f} ms/step")

        try:
            yield record
        except Exception as exc:  # noqa: BLE001 - only out of memory is the rung's to record; the rest is raised
            if not is_out_of_memory(exc):
                raise
            reserved = torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else None
            traceback.clear_frames(exc.__traceback__)  # the finished frames' activations, freed with the next rung
            self.stopped[name] = self._out_of_memory_line(reserved, allocator_detail(exc))
            if echo:
                echo(f"  -> {self.stopped[name]}")

    def _out_of_memory_line(self, reserved_gib: float | None, detail: str) -> str:
        """``out of memory at batch 128 with 21.7 GiB reserved (Tried to allocate ...): try batch_size=64 ...``."""
        held = f" with {reserved_gib:.1f} GiB reserved" if reserved_gib is not None else ""
        smaller = f"batch_size={self.batch_size // 2} in the parameters cell, or " if self.batch_size > 1 else ""
        return f"out of memory at batch {self.batch_size}{held}{detail}: try {smaller}a GPU with more free memory"

    def rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for rung in self.rungs:
            timed = summarize_times(rung.times_ms[self.warmup:])
            median = timed["median_step_time_ms"]
            row = {"rung": rung.name, "img_per_s": 1e3 * self.batch_size / median, **timed,
                   "warmup_s": sum(rung.times_ms[:self.warmup]) / 1e3, "peak_reserved_gib": rung.peak_reserved_gib,
                   "changes": [str(c) for c in rung.changes]}
            by_name = {r["rung"]: r for r in rows}
            first = rows[0] if rows else row
            below = by_name.get(rung.builds_on) if rung.builds_on else (rows[-1] if rows else None)
            row["speedup"] = row["img_per_s"] / first["img_per_s"]
            row["gain"] = row["img_per_s"] / below["img_per_s"] if below else None
            row["builds_on"] = below["rung"] if below else None
            reference = self.rungs[0].losses
            shared = list(zip(rung.losses, reference))
            row["loss_difference"] = max((abs(a - b) for a, b in shared), default=None)
            rows.append(row)
        peer = next((r for r, rung in zip(rows, self.rungs) if rung.peer), None)
        for row in rows:
            row["over_peer"] = row["img_per_s"] / peer["img_per_s"] if peer else None
        return rows

    def to_markdown(self) -> str:
        device = "CPU" if self.device == "cpu" else self.device
        rows = self.rows()
        with_peer = any(row["over_peer"] is not None for row in rows)
        with_memory = any(row["peak_reserved_gib"] is not None for row in rows)
        lines = ["| rung | step ms [p20-p80] | img/s | speedup over the first | gain (over) |"
                 + (" over the peer |" if with_peer else "") + " largest loss difference from the first | "
                 "warm-up (s) |" + (" peak GiB reserved |" if with_memory else ""),
                 "|---|---|---|---|---|" + ("---|" if with_peer else "") + "---|---|" + ("---|" if with_memory else "")]
        for row in rows:
            gain = (f"{speedup_text(row['gain'], device)} ({row['builds_on']})" if row["gain"] is not None else "-")
            lines.append(
                f"| {row['rung']} | {row['median_step_time_ms']:.1f} [{row['p20_step_time_ms']:.1f}-"
                f"{row['p80_step_time_ms']:.1f}] | {row['img_per_s']:.1f} | {speedup_text(row['speedup'], device)} | "
                f"{gain} |" + (f" {speedup_text(row['over_peer'], device)} |" if with_peer else "")
                + f" {row['loss_difference']:.2g} | {row['warmup_s']:.1f} |"
                + (f" {_gib(row['peak_reserved_gib'])} |" if with_memory else ""))
        lines.append("")
        lines += [f"Stopped: {name}, {line}." for name, line in self.stopped.items()]
        capture = "" if self.device == "cpu" else ", CUDA-graph capture"
        lines.append(f"Batch {self.batch_size}; medians over the steps after the first {self.warmup} (warm-up: "
                     f"compilation{capture}), which are reported apart.")
        if self.device == "cpu":
            lines.append(f"{CPU_TIMINGS}.")
        return "\n".join(lines)

    def figure(self) -> _ReportFigure:
        """(a) images per second per rung, with its speedup over the first; on a CPU, where timings are no
        speedups, each rung's step times step by step instead (no ratio, no bar to compare); (b) the loss curves."""
        rows = self.rows()
        on_cpu = self.device == "cpu"
        fig = _ReportFigure(figsize=(12, 4.5), layout="constrained")
        ax_speed, ax_loss = fig.subplots(1, 2)
        if on_cpu:
            self._plot_step_times(ax_speed)
        else:
            bars = ax_speed.bar(range(len(rows)), [row["img_per_s"] for row in rows],
                                color=[f"C{i % 10}" for i in range(len(rows))])
            ax_speed.bar_label(bars, labels=[f"{row['speedup']:.2f}x" for row in rows], padding=2)
            ax_speed.set_xticks(range(len(rows)), [row["rung"] for row in rows], rotation=25, ha="right")
            ax_speed.set(title="(a) throughput, speedup over the first rung", ylabel="img/s (higher is better)")
            ax_speed.margins(y=0.15)
        for i, rung in enumerate(self.rungs):
            ax_loss.plot(range(1, len(rung.losses) + 1), rung.losses, label=rung.name, color=f"C{i % 10}",
                         linestyle=_LINE_STYLES[i % len(_LINE_STYLES)])
        ax_loss.set(title="(b) training loss, step by step", xlabel="step", ylabel="loss")
        ax_loss.legend(fontsize=8)
        return fig

    def _plot_step_times(self, ax) -> None:
        """Each rung's step times, step by step, the warm-up shaded: what a CPU run has to show instead of a speed
        comparison."""
        for i, rung in enumerate(self.rungs):
            ax.plot(range(1, len(rung.times_ms) + 1), rung.times_ms, label=rung.name, color=f"C{i % 10}",
                    linestyle=_LINE_STYLES[i % len(_LINE_STYLES)], marker=".")
        if self.warmup:
            ax.axvspan(0.5, self.warmup + 0.5, color="0.85", zorder=0, label="warm-up")
        ax.set_yscale("log")  # a compiling step takes seconds, the others milliseconds
        ax.set(title=f"(a) step time, step by step, on a CPU (smoke)\n{CPU_TIMINGS}", xlabel="step",
               ylabel="ms (log scale)")
        ax.legend(fontsize=8)

    def save(self, path: str | os.PathLike, **meta: Any) -> None:
        """The rows (every step time and loss included) as JSON, with the commit of the code that ran and ``meta``
        (what ran: the parameters or the command, the GPU)."""
        steps = [{"rung": r.name, "losses": r.losses, "times_ms": r.times_ms} for r in self.rungs]
        record = {**source_version(), **meta, "batch_size": self.batch_size, "warmup": self.warmup,
                  "device": self.device, "rows": self.rows(), "stopped": self.stopped, "steps": steps}
        with open(path, "w", encoding="utf-8") as out:
            json.dump(record, out, indent=1)

    def _repr_markdown_(self) -> str:
        return with_inline_image(self.to_markdown() + "\n\n![ladder](ladder.png)\n", "ladder.png",
                                 _png_bytes(self.figure()))


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
