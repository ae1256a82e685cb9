"""Peaks measured on this machine's GPU, for the memory plan's next run: a planned run on a GPU writes the peak its
setting reserved, or the memory it ran out of, to ``memory_footprints.json`` in the gallery's cache
(``~/.cache/gallery_lib``, or ``$GALLERY_CACHE_DIR``). The next plan of the same run on the same GPU reads it beside
the family's footprints: a setting that ran under as little memory or less fits, one that ran under more is measured,
and one that ran out of memory under as much memory or more is not tried again, even where it also ran there once, so
a notebook run a second time on a small card starts at once. Delete the file to measure again.

A run is the same run when every field that shapes its step is the same (all but ``NOT_SHAPING``: where it writes,
how long it trains, how it logs), on a GPU of the same name (as the plan's ``Budget`` read it), with the same torch and
the same CUDA allocator settings: the user's ``PYTORCH_CUDA_ALLOC_CONF``, or the gallery's own choice where the user
set none (PyTorch's defaults for a run that fits as configured, expandable segments for one the plan changed). What a
run measured under other settings, or before the gallery chose them, is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping, Sequence

from gallery_lib.accel.optimize import default_cache_file, read_cache, write_cache
from gallery_lib.run.memory_plan import ALLOCATOR_ENV

FILE = "memory_footprints.json"
NOT_SHAPING = frozenset({
    "checkpoint_every", "data_dir", "export_model", "extra", "find_batch_size", "gpu_memory_gib", "keep_checkpoints",
    "log_every", "lr", "lr_warmup_steps", "max_bad_fraction", "max_nonfinite_steps", "max_restarts", "memory_plan",
    "num_workers", "output_dir", "precompile_workers", "profile", "recipe", "report_to", "resume", "resume_from",
    "seed", "steps", "verbose", "warmup_steps"})
"""Fields that leave the memory a step holds as it is. The precompile workers are processes of their own: the plan
sizes them after it picked the setting."""


def setting_key(fields: Mapping[str, Any], gpu: str, allocator: str | None = None) -> str:
    """The key of a run's step on ``gpu``, from the run's config ``fields`` (``RunConfig.to_dict()``): its model and
    setting in words, the GPU, torch's version, the CUDA allocator settings the user gave (``users_allocator()``;
    ``None``: the gallery's) and a digest of every field that shapes the step."""
    shaping = {name: value for name, value in fields.items() if name not in NOT_SHAPING}
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]
    setting = f"batch {fields.get('batch_size')}" + (
        f" x {fields['gradient_accumulation_steps']}" if fields.get("gradient_accumulation_steps", 1) > 1 else "") + (
        ", checkpointing" if fields.get("gradient_checkpointing") else "") + (
        ", compiled" if fields.get("compile") else "")
    return (f"{fields.get('model')} | {setting} | {gpu} | torch {_torch_version()} | "
            f"allocator {allocator or 'by the plan'} | {digest}")


def users_allocator() -> str | None:
    """The CUDA allocator settings the user gave, read where the plan is made: the launcher sets its own in the
    training processes only where the user set none."""
    return os.environ.get(ALLOCATOR_ENV) or None


@dataclass(frozen=True)
class Recalled:
    """What this GPU measured for a step, as a plan under some budget reads it."""

    gib: float
    """The peak it reserved, or the memory it ran out of (where that is the budget or more: it does not fit)."""
    ran_within: bool = False
    """It ran to the end here under this budget or a smaller one, so it fits whatever its peak: under a cap the
    allocator caches up to the cap (SD-1.5 under 22 GiB reserved 21.99 at batch 12 x 4 checkpointed), and a peak
    read with the plan's headroom would turn away the setting that ran (benchmarks/RESULTS.md#ladder-22-gib)."""


def recalled(key: str | None, budget_gib: float, path: Path | None = None) -> Recalled | None:
    """What this GPU measured for the step ``key`` names, for a plan under ``budget_gib``; ``None`` where it has
    neither run nor run out of memory here under as much memory or more."""
    return recalled_each([key], budget_gib, path)[0]


def recalled_each(keys: Sequence[str | None], budget_gib: float, path: Path | None = None) -> list[Recalled | None]:
    """``recalled`` for each of ``keys`` (a plan's settings), the file read once."""
    entries = _read(path)
    return [_recalled(entries.get(key) if key else None, budget_gib) for key in keys]


def _recalled(entry: Any, budget_gib: float) -> Recalled | None:
    if not isinstance(entry, dict):
        return None
    peak, ran_under, ran_out = (entry.get(name) for name in (
        "peak_reserved_gib", "ran_under_gib", "out_of_memory_under_gib"))
    if _number(ran_out) and ran_out >= budget_gib:
        # first, though it also ran there: a step at the edge of its budget that ran once can stop the next run
        # (SD's ladder under 22 GiB on an H100: benchmarks/RESULTS.md#ladder-22-gib)
        return Recalled(float(ran_out))
    if _number(peak) and _number(ran_under) and ran_under <= budget_gib:
        return Recalled(float(peak), ran_within=True)
    return Recalled(float(peak)) if _number(peak) else None


def remember(key: str, *, peak_gib: float | None = None, ran_under: float | None = None,
             out_of_memory_under: float | None = None, path: Path | None = None) -> None:
    """Writes what the step ``key`` names did: the peak it reserved and the budget it ran under (of several runs the
    smallest of each: what it needs at most), or the budget it ran out of memory under (the largest is kept)."""
    path = path or cache_path()
    entry = dict(_read(path).get(key) or {})
    if peak_gib is not None:
        entry["peak_reserved_gib"] = min(round(peak_gib, 2), entry.get("peak_reserved_gib") or peak_gib)
    if ran_under is not None:
        entry["ran_under_gib"] = min(ran_under, entry.get("ran_under_gib") or ran_under)
    if out_of_memory_under is not None:
        entry["out_of_memory_under_gib"] = max(out_of_memory_under, entry.get("out_of_memory_under_gib") or 0.0)
    write_cache(path, key, entry)


def ran_out_in_training(step: int | None, steps: int) -> bool:
    """Whether out of memory at ``step`` (``None``: before the first) of a run of ``steps`` says the step does not
    fit: out of memory after the last step (saving the model, step ``steps``) says nothing of it."""
    return step is None or step < steps


def cache_path() -> Path:
    return default_cache_file(FILE)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _read(path: Path | None) -> dict[str, Any]:
    return read_cache(path or cache_path())


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:  # pragma: no cover - torch runs the gallery
        return "unknown"
