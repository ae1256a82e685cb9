"""A resolved recipe fitted to the GPU memory the run may use: every recipe (``baseline``, ``peer``, ``accelerated``,
the ladder's rungs) goes through the same plan (``gallery_lib/run/memory_plan.py``), so runs at one memory size
compare fairly. Each setting the plan weighs is the recipe resolved again at that setting (checkpointing, say, turns
its CUDA graphs off), and its peak is read from the family's measured footprints. Where the training state fits
only without the EMA on the GPU, every setting keeps the EMA in the CPU's memory between its updates
(``ema_offload``), and where it fits only without the unfused AdamW's multi-tensor copy, the update runs one tensor at
a time (``foreach_optimizer=False``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable

from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.run.learned_footprints import recalled_each, setting_key, users_allocator
from gallery_lib.run.memory_plan import (HOST_PROCESS_GIB, NAMED, PLAN, PLANNED_FIELDS, Budget, Candidate, MemoryPlan,
                                         TrainingState, candidates, choose, estimate_gib, workers_that_fit)


def fit_to_memory(cfg: RunConfig, resolve: Callable[[dict[str, Any]], RunConfig], budget: Budget | None, *,
                  start_at: Candidate | None = None, builds_on_ran: bool = True,
                  start_held_gib: float | None = None) -> RunConfig:
    """``cfg`` at the fastest setting that fits ``budget`` (``None``: no plan, as on a CPU), with the plan in
    ``cfg.extra[PLAN]``. ``resolve(fields)`` resolves the same recipe with ``fields`` (the planned ones) set on its
    base. ``start_at``: the setting the run this one builds on ran at, where this one's switch frees no memory (a
    ladder rung's): where no measured setting fits, the unmeasured ones faster than it are not tried, since they did
    not fit there. ``builds_on_ran=False``: that run has not run at ``start_at`` but ran out of memory at every
    faster setting (it stopped, or has not run yet). ``start_held_gib``: what that run held at ``start_at`` beyond
    its training state, where it ran there and its peak was measured: where this run's own state there makes it
    more than the budget, the tries start past ``start_at``."""
    if budget is None or cfg.memory_plan == "off" or cfg.find_batch_size or cfg.nproc_per_node > 1:
        return cfg  # the search sizes the batch itself; several processes were never measured
    named = cfg.extra.get(NAMED, ())
    moved = _state_moves(cfg, budget, named)
    if moved:  # the state fits once the EMA waits on the CPU or the optimizer updates one tensor at a time
        as_recipe = resolve

        def resolve(fields: dict[str, Any]) -> RunConfig:
            return as_recipe({**fields, **moved})

        cfg = resolve({})
    configured = Candidate(cfg.batch_size, cfg.gradient_accumulation_steps, cfg.gradient_checkpointing)
    options, configs = [], []
    every = candidates(configured.batch_size, configured.accumulation, configured.checkpointing, named,
                       compiled=cfg.compile)
    for option in every:
        try:
            compiled = cfg if replace(option, uncompiled=False) == configured else resolve(option.fields())
            configs.append(uncompiled(compiled, named) if option.uncompiled else compiled)
        except ConfigError:  # a setting this recipe cannot run (a ladder rung's CUDA graphs under checkpointing)
            continue
        options.append(option)
    options, configs, least, left_out = _within_the_state(options, configs, budget)
    allocator = users_allocator()
    here = recalled_each([budget.gpu and setting_key(config.to_dict(), budget.gpu, allocator) for config in configs],
                         budget.gib)
    estimates = [measured.gib if measured else footprint_gib(config, option.uncompiled)
                 for measured, option, config in zip(here, options, configs)]
    ran_within = {option for option, measured in zip(options, here) if measured and measured.ran_within}
    plan = replace(choose(options, estimates, budget, configured, least, ran_within),
                   ema_offloaded="ema_offload" in moved, per_tensor_update="foreach_optimizer" in moved,
                   left_out=left_out)
    if plan.probe:
        ahead = here[:options.index(plan.probe[0])]
        plan = replace(plan, ran_out_here=sum(1 for measured in ahead if measured and measured.gib >= budget.gib))
    if plan.chosen is None and start_at is not None:  # none measured fits: the ones tried start at start_at
        needs = _needs_at_the_start(start_at, plan.probe, options, configs, start_held_gib, budget)
        plan = replace(_from_the_start(plan, start_at, every, past=needs is not None), builds_on_ran=builds_on_ran)
        if plan.started_past and needs is not None:
            plan = replace(plan, start_needs_gib=needs)
    settings = (plan.chosen,) if plan.chosen is not None else plan.probe
    if not settings:
        return cfg.replace(extra={**cfg.extra, PLAN: plan.as_dict()})
    # each setting with the precompile workers that fit beside it: the recipe's number, each given an equal share of
    # the cap, ran out of memory while compiling an unmeasured one (SD-1.5 in 22 GiB: 6 workers of 1.3 GiB each)
    resolved = [configs[options.index(setting)] for setting in settings]
    fitted = [_with_workers(config, budget) for config in resolved]
    cfg = fitted[0]
    if cfg.precompile_workers != resolved[0].precompile_workers:
        plan = replace(plan, precompile_workers=cfg.precompile_workers)
    # the training process writes what it measures for this GPU, under the user's allocator settings
    noted = {**plan.as_dict(), "gpu": budget.gpu, "allocator": allocator}
    if plan.chosen is None:  # the training process tries them in order (``run/batch_size.py``)
        noted.update(probe_fields=[_difference(cfg, other) for other in fitted], configured=configured.fields())
    return cfg.replace(extra={**cfg.extra, PLAN: noted})


def _within_the_state(options: list[Candidate], configs: list[RunConfig], budget: Budget,
                      ) -> tuple[list[Candidate], list[RunConfig], TrainingState | None, str]:
    """The settings whose training state leaves room in ``budget``, their configs, the smallest such state (of all
    settings where none leaves room: the plan then refuses the run), and what was left out and why. The state can
    differ by setting: a model compiled whole holds a second copy of the gradients under accumulation (the ladder's
    compile rung at 16 GiB: 16.0 GiB of state for SD-1.5, where the eager rung below it trained at batch 4 x 12)."""
    states = [training_state(config) for config in configs]
    room = [state is None or state.leaves_room_in(budget.gib) for state in states]
    if not any(room):  # every state fills it (none is None): the plan refuses the run with the smallest
        return options, configs, min(states, key=lambda state: state.gib, default=None), ""
    least = min((s for s, fits in zip(states, room) if fits and s is not None), key=lambda s: s.gib, default=None)
    if all(room):
        return options, configs, least, ""
    smallest = min((s for s, fits in zip(states, room) if not fits), key=lambda s: s.gib)
    left_out = (f"{room.count(False)} settings left out, in which {smallest.describe()} alone take "
                f"{smallest.gib:.1f} GiB")
    kept = [index for index, fits in enumerate(room) if fits]
    return [options[i] for i in kept], [configs[i] for i in kept], least, left_out


def _counterpart(start_at: Candidate, settings: list[Candidate]) -> Candidate | None:
    """``start_at`` among this run's ``settings``, or its compiled twin (the run it builds on ran uncompiled there);
    ``None`` where this run has no counterpart of it."""
    return next((setting for setting in (start_at, replace(start_at, uncompiled=False)) if setting in settings), None)


def _needs_at_the_start(start_at: Candidate, unmeasured: tuple[Candidate, ...], options: list[Candidate],
                        configs: list[RunConfig], held_gib: float | None, budget: Budget) -> float | None:
    """What this run needs at ``start_at`` where that is more than ``budget``: its own training state there and what
    the run it builds on held there beyond its state (``held_gib``). The compile rung at 22 GiB started where the EMA
    rung had peaked at 21.5 GiB, 12 x 4 checkpointed, and ran out of memory after a whole-model compile: compiled
    whole, it holds 3.2 GiB more (benchmarks/RESULTS.md#ladder-22-gib). ``None`` where it fits, is not known, or
    was measured for this run (not among the ``unmeasured`` settings to try)."""
    start = _counterpart(start_at, options)
    if held_gib is None or start is None or start not in unmeasured:
        return None
    state = training_state(configs[options.index(start)])
    needs = None if state is None else state.gib + held_gib
    return needs if needs is not None and needs > budget.gib else None  # the run below ran within it: no headroom


def _from_the_start(plan: MemoryPlan, start_at: Candidate, every: list[Candidate], *, past: bool = False,
                    ) -> MemoryPlan:
    """``plan``'s settings to try without the unmeasured ones faster than ``start_at`` in ``every`` (all settings,
    fastest first). Where ``start_at`` itself was measured here and ran out of memory, or ``past`` (it does not fit
    this run), the tries start past it: the compile rung at 16 GiB ran out at the bf16 rung's batch 4 x 12
    checkpointed, and a later call started it again at batch 48 (benchmarks/RESULTS.md#memory-plan)."""
    start = _counterpart(start_at, every)
    if start is None:
        return plan
    rank = every.index(start) + past
    probe = tuple(option for option in plan.probe if every.index(option) >= rank)
    skipped = len(plan.probe) - len(probe)
    if not skipped or not probe:  # where every later setting ran out of memory, the faster ones are still tried
        return plan
    return replace(plan, probe=probe, after=probe[1:], skipped_faster=skipped, started_past=probe[0] != start)


def refuse_beyond_host_memory(cfg: RunConfig, budget: Budget | None) -> RunConfig:
    """A run on the CPU, with a plan that refuses it where its training state alone fills the memory the machine has
    available (``budget``); as it is otherwise: the measured footprints are the GPU's."""
    state = training_state(cfg)
    if state is not None:  # torch's unfused AdamW updates one tensor at a time on the CPU unless told otherwise
        state = replace(state, foreach_copy=False)
    if budget is None or state is None or state.gib + HOST_PROCESS_GIB < budget.gib:
        return cfg
    plan = MemoryPlan(budget.gib, budget.source, None, state.gib + HOST_PROCESS_GIB,
                      f"{state.describe()} (and {HOST_PROCESS_GIB} GiB for torch and the frozen modules)", state.fix)
    return cfg.replace(extra={**cfg.extra, PLAN: plan.as_dict()})


COMPILE_ONLY = {"compile_mode": "default", "compile_scope": "model", "compile_whole": "", "precompile_workers": 0,
                "coordinate_descent_tuning": False, "tiled_reductions": False, "channels_last_graphs": False}
"""The settings that act only through ``torch.compile``, at their defaults."""


def uncompiled(cfg: RunConfig, named: Iterable[str] = ()) -> RunConfig:
    """``cfg`` with ``torch.compile`` off and the settings that act only through it (``COMPILE_ONLY``, but those in
    ``named``) at their defaults: the memory plan's setting where no compiled step fits, and a compiled recipe with a
    user's ``compile=false``."""
    named = set(named)
    left = {name: value for name, value in COMPILE_ONLY.items() if name not in named}
    return cfg.replace(compile=False, **left)


def footprint_gib(cfg: RunConfig, uncompiled: bool = False) -> float | None:
    """The run's peak reserved memory from its family's measurements at other batch sizes, or ``None`` where this
    recipe, image size, checkpointing, accumulation or process count was not measured, or the recipe's compilation
    turned off (``uncompiled``) was not."""
    spec = cfg.model_family.model_spec(cfg.model)
    if (cfg.image_size != spec.default_image_size or cfg.nproc_per_node != 1
            or cfg.gradient_accumulation_steps != 1):  # measured without accumulation, which turns CUDA graphs off
        return None
    matching = [footprint for footprint in cfg.model_family.memory_footprints
                if (footprint.model, footprint.recipe, footprint.gradient_checkpointing, footprint.uncompiled) == (
                    cfg.model, recipe_of(cfg), cfg.gradient_checkpointing, uncompiled)]
    offloaded = [footprint for footprint in matching if footprint.ema_offloaded]
    if cfg.ema_offload and offloaded:  # measured as it will run
        return estimate_gib(dict(offloaded[0].reserved_gib), cfg.batch_size)
    on_gpu = [footprint for footprint in matching if not footprint.ema_offloaded]
    return _less_the_offloaded_ema(cfg, estimate_gib(dict(on_gpu[0].reserved_gib), cfg.batch_size)) if on_gpu else None


def _less_the_offloaded_ema(cfg: RunConfig, measured: float | None) -> float | None:
    """A footprint measured with the EMA on the GPU, for a run that keeps it on the CPU between updates: less the
    EMA's fp32 copy, which is back on the GPU only after the gradients are freed (SD-1.5 at batch 1, eager: 17.11
    GiB reserved with it on the GPU, 14.03 offloaded, of its 3.20; benchmarks/RESULTS.md#memory-plan). ``None``
    where the family does not count the trained parameters."""
    if measured is None or not cfg.ema_offload:
        return measured
    state = training_state(cfg)
    return None if state is None else measured - state.buffer_gib


def recipe_of(cfg: RunConfig) -> str:
    """The recipe a run's name starts with: ``accelerated+ema=foreach`` is read from ``accelerated``'s footprints,
    and runs out of memory into its next setting (before its timed steps) where the override needs more."""
    return cfg.recipe.split("+", 1)[0]


def training_state(cfg: RunConfig) -> TrainingState | None:
    """The state a full training of ``cfg``'s model holds whatever its batch, where its family counts the trained
    parameters; ``None`` for LoRA adapters or O2's low-precision weights, which hold less."""
    spec = cfg.model_family.model_spec(cfg.model)
    settings = cfg.to_dict()
    if spec.trained_parameters is None or cfg.amp_level == "O2" or settings.get("lora_rank"):
        return None
    fixes = ([", or without the EMA (--set ema=off)"] if cfg.ema != "off" else []) + (
        [", or train LoRA adapters (--set lora_rank=4)"] if "lora_rank" in settings else [])
    foreach_copy = cfg.optimizer == "adamw" and not cfg.fused_optimizer and cfg.foreach_optimizer
    compiled_copy = cfg.compile and cfg.compile_scope == "model" and cfg.gradient_accumulation_steps > 1
    return TrainingState(spec.trained_parameters, cfg.optimizer, cfg.ema != "off" and not cfg.ema_offload,
                         "".join(fixes), foreach_copy, compiled_copy)


def _state_moves(cfg: RunConfig, budget: Budget, named: Any) -> dict[str, Any]:
    """The fields that make a training state that fills ``budget`` fit it, taken in order until it does: the EMA to
    the CPU between updates (unless the user named ``ema_offload``, or ZeRO-2 shards it already), then the unfused
    optimizer's update one tensor at a time (unless the user named ``foreach_optimizer``); none where it fits as it
    is, or does not fit even so."""
    state = training_state(cfg)
    if state is None or state.leaves_room_in(budget.gib):
        return {}
    moves = {}
    if state.ema and "ema_offload" not in named and cfg.data_parallel != "zero2":
        moves["ema_offload"], state = True, replace(state, ema=False)
    if not state.leaves_room_in(budget.gib) and state.foreach_copy and "foreach_optimizer" not in named:
        moves["foreach_optimizer"], state = False, replace(state, foreach_copy=False)
    return moves if state.leaves_room_in(budget.gib) else {}


def _with_workers(cfg: RunConfig, budget: Budget) -> RunConfig:
    """``cfg`` with the precompile workers that fit beside the training process, where fewer than the recipe's do."""
    measured = cfg.model_family.worker_memory
    if measured is None or not cfg.compile or cfg.precompile_workers < 2:
        return cfg
    workers = workers_that_fit(cfg.precompile_workers, budget.gib, measured.trainer_gib, measured.per_worker_gib)
    return cfg.replace(precompile_workers=workers) if workers != cfg.precompile_workers else cfg


def _difference(base: RunConfig, other: RunConfig) -> dict[str, Any]:
    """The fields of ``other`` that differ from ``base`` (the planned ones always): what the training process changes
    to try ``other``."""
    mine, theirs = base.to_dict(), other.to_dict()
    return {name: value for name, value in theirs.items()
            if name != "extra" and (name in PLANNED_FIELDS or mine.get(name) != value)}
