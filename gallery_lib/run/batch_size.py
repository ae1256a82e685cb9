"""Find the largest batch size that fits in memory by backing off on out-of-memory errors.

``find_batch_size`` calls a trial function at a batch size; on an out-of-memory error it frees what it can and
tries again with ``floor(batch * factor)`` rounded down to a multiple of ``multiple_of``, so the sequence of tried
sizes is a pure function of the arguments (128 -> 114 -> 102 -> 90 ... with the defaults). Any other error propagates
unchanged. Each trial must run several training steps (``steps_per_trial``, at least three): torch.compile and
kernel autotuning allocate differently on their first steps, so one step under-reports the peak.

``search_run_batch_size`` drives the search for a run (``RunConfig.find_batch_size``): each trial is the real
pipeline (task, model, accelerations, optimizer, compile) trained for ``TRIAL_STEPS`` steps, writing into
``<run_dir>/batch_size_search/batch_<N>/``. ``train_first_that_fits`` trains at the memory plan's first setting
that runs, where the family measured none (``memory_plan.py``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from gallery_lib.config import RunConfig
from gallery_lib.run.memory_plan import PLAN, DoesNotFit, MemoryPlan, OutOfMemory, give_back_cached_gpu_memory

TRIAL_STEPS = 3
"""Training steps per trial: the first steps compile and autotune, which changes peak memory."""
SEARCH_DIR = "batch_size_search"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an accelerator out-of-memory error (typed, or the older RuntimeError message)."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def allocator_detail(exc: BaseException) -> str:
    """PyTorch's own account of an out-of-memory error behind ``exc`` (what it tried to allocate, what was free, and
    how much of the reserved memory was allocated), in parentheses; empty where there is none."""
    text = " ".join(str(exc.__cause__ or exc).split())
    start = text.find("Tried to allocate")
    end = text.find(" If reserved but unallocated")
    return f" ({text[start:end if end > start else None].rstrip('.')})" if start >= 0 else ""


def next_batch_size(batch: int, factor: float, multiple_of: int) -> int:
    """``floor(batch * factor)`` rounded down to ``multiple_of``, always strictly below ``batch``."""
    smaller = math.floor(batch * factor) // multiple_of * multiple_of
    return min(smaller, batch - 1)


def find_batch_size(
    try_steps: Callable[[int], None],
    start: int,
    *,
    minimum: int = 2,
    factor: float = 0.9,
    multiple_of: int = 2,
    steps_per_trial: int = 3,
    log: Callable[[str], None] = print,
) -> int:
    """Returns the first batch size, from ``start`` downwards, at which ``try_steps(batch)`` runs without OOM.

    Args:
        try_steps: Runs at least ``steps_per_trial`` training steps at the given batch size (forward, backward and
            optimizer step, with compilation if the run compiles); raises on failure.
        start: First batch size tried (rounded down to ``multiple_of``).
        minimum: Smallest batch size worth trying; below it a RuntimeError says what to change.
        factor: Multiplier applied after each out-of-memory error, in (0, 1).
        multiple_of: Every tried size is a multiple of this (2 keeps Mixup/CutMix pairs whole).
        steps_per_trial: How many steps ``try_steps`` must run; checked here, passed on to the log only.
        log: Receives one line per trial.
    """
    if not 0 < factor < 1:
        raise ValueError(f"factor={factor!r} is invalid: expected a number in (0, 1).")
    for name, value in (("start", start), ("minimum", minimum), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1.")
    if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int) or steps_per_trial < 3:
        raise ValueError(f"steps_per_trial={steps_per_trial!r} is invalid: expected an integer >= 3 (compilation "
                         "and autotuning change peak memory over the first steps).")
    batch = start // multiple_of * multiple_of
    tried: list[int] = []
    while batch >= minimum:
        tried.append(batch)
        log(f"[gallery] batch-size search: trying {batch} ({steps_per_trial} steps)")
        try:
            try_steps(batch)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        else:
            log(f"[gallery] batch-size search: {batch} fits")
            return batch
        # Outside the except block, so the traceback (and the failed trial's tensors in its frames) is gone.
        log(f"[gallery] batch-size search: {batch} ran out of memory")
        give_back_cached_gpu_memory()  # the failed trial's tensors
        batch = next_batch_size(batch, factor, multiple_of)
    raise RuntimeError(
        f"no batch size >= {minimum} fits in memory (tried {', '.join(map(str, tried)) or 'none'}, starting from "
        f"{start}): lower image_size, turn on mixed precision (amp_level='O1' or 'O2'), use a smaller model, or "
        f"lower minimum (now {minimum}).")


def trial_config(cfg: RunConfig, batch: int) -> RunConfig:
    """``cfg`` cut down to one trial at ``batch`` (what its recipe stated by the step's size resolves for that
    batch: ``config/step_size.py``): ``TRIAL_STEPS`` steps, no checkpoint, no export, its own folder."""
    return cfg.replace(
        batch_size=batch, steps=TRIAL_STEPS, warmup_steps=min(cfg.warmup_steps, TRIAL_STEPS - 1),
        find_batch_size=False, checkpoint_every=0, export_model=False,
        output_dir=str(cfg.run_dir / SEARCH_DIR / f"batch_{batch}"))


def search_run_batch_size(cfg: RunConfig, train: Callable[[RunConfig], Any],
                          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Finds the batch size of ``cfg`` from ``cfg.batch_size`` down; returns ``{"tried": [...], "chosen": N}``.

    ``train(trial_cfg)`` trains one trial config (``trial_config``) to the end. Between trials, and after the
    search, compiled graphs are dropped and cached memory is released, so the next model starts from a clean slate.
    """
    import torch._dynamo

    tried: list[int] = []

    def trial(batch: int) -> None:
        tried.append(batch)
        try:
            train(trial_config(cfg, batch))
        finally:
            # Compiled graphs and their guards keep the trial's model (and its memory) alive.
            torch._dynamo.reset()

    chosen = find_batch_size(trial, cfg.batch_size, steps_per_trial=TRIAL_STEPS, log=log)
    give_back_cached_gpu_memory()
    return {"tried": tried, "chosen": chosen}


def train_first_that_fits(cfg: RunConfig, train: Callable[[RunConfig], dict],
                          log: Callable[[str], None] = print) -> dict:
    """Trains ``cfg`` at the first of its memory plan's unmeasured settings that runs: one that runs out of memory
    before its timed steps (compilation, CUDA-graph capture and the optimizer's state reach the peak in the warm-up;
    at least ``TRIAL_STEPS`` steps) gives way to the next, from step 0; later it stops the run. Costs nothing where
    the first fits. Returns ``train``'s summary; ``DoesNotFit`` naming what was tried when none fits."""
    import torch._dynamo

    plan = dict(cfg.extra[PLAN])
    options = MemoryPlan.from_dict(plan).probe
    tried: list[str] = []
    window = max(TRIAL_STEPS, cfg.warmup_steps)
    configured = plan.get("configured")
    for index, fields in enumerate(plan.pop("probe_fields")):
        setting = options[index]
        changed = configured is None or setting.fields() != configured
        chosen = MemoryPlan(plan["budget_gib"], plan["source"], setting, None, changed=changed,
                            after=options[index + 1:], ema_offloaded=plan.get("ema_offloaded", False),
                            per_tensor_update=plan.get("per_tensor_update", False),
                            skipped_faster=plan.get("skipped_faster", 0) if index == 0 else 0,
                            started_past=plan.get("started_past", False) and index == 0,
                            builds_on_ran=plan.get("builds_on_ran", True),
                            start_needs_gib=plan.get("start_needs_gib", 0.0) if index == 0 else 0.0)
        attempt = cfg.replace(**fields, extra={**cfg.extra, PLAN: {**chosen.as_dict(), "gave_way": list(tried),
                                                                   "gpu": plan.get("gpu")}})
        if tried:
            log(f"[gallery] memory plan: {tried[-1]} ran out of memory before its timed steps; trying "
                f"{setting.describe()} from step 0")
        try:
            return train(attempt)
        except Exception as exc:
            if not is_out_of_memory(exc) or getattr(exc, "step", None) is not None and exc.step >= window:
                raise
            said = str(exc) if isinstance(exc, OutOfMemory) else "out of memory"  # where, how much, at which setting
            log(f"[gallery] memory plan: {said}{allocator_detail(exc)}")
        finally:
            torch._dynamo.reset()  # compiled graphs and their guards keep the attempt's model alive
        give_back_cached_gpu_memory()  # the failed trial's tensors
        tried.append(setting.describe())
    raise DoesNotFit(f"does not fit in {plan['budget_gib']:.1f} GiB: {'; '.join(tried)} each ran out of memory "
                     "before its timed steps; use a GPU with more free memory, or lower image_size or the model")
