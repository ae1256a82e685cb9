"""Structured run metrics: one JSON object per line in ``metrics.jsonl``.

Every run writes its own file, so a report never has to recover numbers from printed text.
Two kinds of records share the file, told apart by ``"type"``:

``step`` (one per training step, written by rank 0)::

    {"type": "step", "step": 3, "loss": 6.91, "lr": 0.0005, "step_time_ms": 71.2,
     "samples_per_s": 1797.8, "peak_mem_mb": 10321.0, "warmup": false, "skipped_samples": 0}

``step_time_ms`` is measured with CUDA events on a GPU (wall clock on a CPU) and covers
forward, backward and the optimizer step of the whole global batch. Steps flagged ``warmup``
include compilation and autotuning and are excluded from the summary's speed figures.
``skipped_samples`` is the running total of undecodable samples skipped by rank 0's loader;
``skipped_step`` marks a step whose loss was not finite (its optimizer step was skipped). The summary
adds ``nonfinite_steps`` and ``resumed_from_step`` (0 for a run that did not resume).

A run resumed from step ``k`` trains steps ``k...`` again, so ``supersede_steps`` first moves the records of
steps ``>= k`` (logged after the checkpoint by the stopped run) and any old summary into ``metrics.superseded.jsonl``
beside the file: ``metrics.jsonl`` then holds each step once, in order, and nothing logged is lost.

``summary`` (the last line of a finished run)::

    {"type": "summary", "model": "swin_tiny_patch4_window7_224", "recipe": "compiled",
     "device_name": "NVIDIA H100 80GB HBM3", "world_size": 1, "global_batch_size": 128,
     "steps": 50, "warmup_steps": 10, "warmup_time_s": 41.3, "median_step_time_ms": 35.5,
     "p20_step_time_ms": 35.1, "p80_step_time_ms": 35.9, "samples_per_s": 3605.6,
     "peak_mem_mb": 11020.4, "final_loss": 6.82, "skipped_samples": 0, "output_dir": "..."}
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends JSON records to a ``metrics.jsonl`` file, flushing each line."""

    def __init__(self, path: str | os.PathLike, mode: str = "w"):
        """``mode="w"`` starts a fresh file (a new run); ``"a"`` continues one (a resumed run)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, mode, encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_finite_or_none(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _finite_or_none(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf; a diverged loss is written as null rather than an invalid file.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_metrics(path: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Reads a ``metrics.jsonl`` file back as ``(step_records, summary_or_None)``.

    Lines that are not valid JSON (a run killed mid-write leaves a truncated last line) are skipped
    rather than failing the report.
    """
    steps: list[dict[str, Any]] = []
    summary: dict[str, Any] | None = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("type") == "step":
                steps.append(record)
            elif record.get("type") == "summary":
                summary = record
    return steps, summary


SUPERSEDED_SUFFIX = ".superseded.jsonl"


def superseded_path(path: str | os.PathLike) -> Path:
    """``metrics.jsonl`` -> ``metrics.superseded.jsonl``, beside it."""
    path = Path(path)
    return path.with_name(path.stem + SUPERSEDED_SUFFIX)


def supersede_steps(path: str | os.PathLike, first_step: int) -> int:
    """Keeps in ``path`` only the step records of steps ``< first_step``; returns how many lines were moved out.

    The other lines (later steps, a summary, a line truncated by a kill) are appended to ``superseded_path(path)``
    first and ``path`` is then replaced atomically, so a kill at any point loses no line (at worst a line is in
    both files). A missing ``path`` is left missing.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    moved: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            line = line if line.endswith("\n") else line + "\n"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            earlier = isinstance(record, dict) and record.get("type") == "step" and isinstance(record.get("step"), int)
            (kept if earlier and record["step"] < first_step else moved).append(line)
    if not moved:
        return 0
    with open(superseded_path(path), "a", encoding="utf-8") as f:
        f.writelines(moved)
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(moved)
