"""The optimization ladder: Stable Diffusion training made faster one switch at a time.

A talk on PyTorch training optimizations for Stable Diffusion measured, on one 80 GB A100, what each optimization
buys for SD UNet training over a TF32 HuggingFace baseline at batch 8 (``Rung.talk``). The ladder runs those rungs
on the GPU at hand, each a recipe that adds one switch to the rung it builds on, then the rungs past the talk that
this library adds. ``ladder_configs(base)`` resolves every rung; ``run_ladder(base)`` runs them one after another
(``notebooks/optimization_ladder.ipynb``); each rung is also a recipe of its own (``gallery train --recipe
ladder-05-batch``), and ``gallery_lib.reports.ladder`` tables and plots the results.

Two rungs leave the straight line:

- ``zero2`` shards gradients and optimizer states over the GPUs (a memory technique for several GPUs). The rungs
  past the talk build on ``ema``, the rung before it, so that every rung above it runs the same on one GPU and on
  several; on one GPU ZeRO-2 has nothing to shard and shows only its own cost.
- ``cuda_graphs`` needs a GPU. On a CPU (the smoke profile) it is left out and the rungs above it build on the rung
  below it.

Batch sizes: the talk went from batch 8 to 48, which FlashAttention's memory savings allowed; activation
checkpointing then doubles that. Custom profiles scale the base batch by the same factors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable

from gallery_lib.config import ConfigError, RunConfig, validate_for_machine
from gallery_lib.recipes.named import (accelerated, baseline, describe, precompile_workers_for_machine,
                                       register_recipes, runs_on_gpu)
from gallery_lib.recipes.memory_fit import fit_to_memory, training_state, uncompiled
from gallery_lib.recipes.profiles import base_config
from gallery_lib.run.failure import RunsFailed
from gallery_lib.run.launch import RunFailed, launch
from gallery_lib.run.memory_plan import NAMED, PLAN, Budget, Candidate, read_budget


@dataclass(frozen=True)
class LadderSizes:
    """The batch sizes and loader workers the rungs switch to."""

    large_batch: int
    """The ``batch`` rung's batch size (the talk's 48)."""
    checkpointing_batch: int
    """The ``checkpointing`` rung's batch size: what activation checkpointing makes room for."""
    loader_workers: int
    """The ``loader`` rung's worker processes (the baseline loads in the main process, as diffusers' default)."""


# Per profile: the first rungs' batch, and the larger batch and the checkpointing rung's batch (full: the talk's
# sizes; smoke: twice the first for both). Smoke starts at 2, so that from the batch rung on the UNet sees the SD and
# DreamBooth notebooks' smoke shapes (batch 4) and a CPU gallery compiles the accelerated blocks once for all three;
# the smoke checkpointing rung keeps that batch (a smoke run checks that the switch trains, not the memory it frees),
# so it loads most of the kernels rung's graphs instead of compiling a set of its own.
_FIRST_BATCH = {"full": 8, "smoke": 2}
_LARGER_BATCHES = {"full": lambda first: (48, 96), "smoke": lambda first: (2 * first, 2 * first)}


def ladder_base(profile: str = "auto", **overrides: Any) -> RunConfig:
    """The SD base config the ladder climbs from: the profile's, at the ladder's first batch size unless
    ``batch_size`` is given, and without saving each rung's trained model unless ``export_model`` is: the ladder
    measures speed, and an SD-1.5 pipeline a rung would fill some 60 GB of a cloud machine's disk."""
    base = base_config(profile, family="stable_diffusion", **{"export_model": False, **overrides})
    # not named: the memory plan may change the ladder's own batch sizes (keeping each rung's global batch)
    return base if overrides.get("batch_size") is not None else base.replace(batch_size=_FIRST_BATCH[base.profile])


def default_sizes(base: RunConfig) -> LadderSizes:
    larger = _LARGER_BATCHES.get(base.profile, lambda first: (6 * first, 12 * first))
    large, checkpointing = larger(base.batch_size)
    workers = max(base.num_workers, min(8, (os.cpu_count() or 1) // 2))
    return LadderSizes(large_batch=large, checkpointing_batch=checkpointing, loader_workers=workers)


@dataclass(frozen=True)
class Rung:
    """One rung: the switches it adds to the rung it builds on, and what they buy."""

    name: str
    title: str
    """Its label in the table and the plot."""
    adds: Callable[[RunConfig, LadderSizes], dict[str, Any]]
    """``adds(config it builds on, sizes)`` -> the fields it changes."""
    why: str
    """What the switch does, and what it costs (one or two sentences for the notebook)."""
    talk: tuple[float, float] | None = None
    """The talk's (speedup over its baseline, peak memory in GB) on an 80 GB A100; ``None`` past the talk."""
    builds_on: str | None = None
    """The rung it adds to; ``None``: the one listed before it."""
    needs_gpu: bool = False
    frees_memory: bool = False
    """Its switch lowers the memory a step holds. Under the memory plan such a rung tries its settings from the
    fastest; any other starts at the setting the rung it builds on ran at, since every faster one did not fit there,
    or where that rung stopped out of memory, at the first setting it has not run out of memory at (at 16 GiB each
    large-batch rung otherwise ran out of memory at the same 12 settings first: benchmarks/RESULTS.md#memory-plan)."""


def _tf32_baseline(base: RunConfig, sizes: LadderSizes) -> dict[str, Any]:
    plain = baseline(base).to_dict()  # eager, unfused AdamW, a per-tensor EMA loop, online VAE and CLIP
    del plain["recipe"], plain["extra"]
    return {**plain, "amp_level": "O0", "sdpa_math": True, "num_workers": 0}


RUNGS: tuple[Rung, ...] = (
    Rung("tf32", "baseline: TF32", _tf32_baseline,
         "fp32 weights and activations with TF32 matmuls, the frozen VAE and CLIP encoding every batch, attention "
         "as explicit matmuls (PyTorch's math kernel, as the talk's baseline ran), data loaded in the training "
         "process (diffusers' default), a per-tensor EMA loop.", talk=(1.00, 69.5)),
    Rung("amp", "fp16 AMP", lambda cfg, s: {"amp_level": "O1", "amp_dtype": "auto"},
         "autocast to float16 with a GradScaler (bfloat16 on a CPU): tensor-core matmuls at half the bytes; the "
         "fp32 weights stay.", talk=(1.18, 71.7), frees_memory=True),
    Rung("loader", "tuned data loader", lambda cfg, s: {"num_workers": s.loader_workers},
         "worker processes decode and augment the next batches into pinned memory while the GPU trains.",
         talk=(1.41, 71.7)),
    Rung("fused", "fused layers + fused AdamW", lambda cfg, s: {"kernels": True, "kernel_ops": "all",
                                                                 "fused_optimizer": True},
         "the library's Triton kernels (GroupNorm+SiLU, LayerNorm, GEGLU) in place of several eager kernels each, "
         "and one kernel for the whole AdamW update.", talk=(1.56, 66.9), frees_memory=True),
    Rung("attention", "fused attention", lambda cfg, s: {"sdpa_math": False},
         "PyTorch's SDPA picks its fused kernels again (FlashAttention, cuDNN): the 4096 x 4096 attention matrices "
         "are never stored, which frees most of the memory.", talk=(2.23, 25.5), frees_memory=True),
    Rung("batch", "larger batch", lambda cfg, s: {"batch_size": s.large_batch},
         "the freed memory goes to a larger batch: fewer, fuller kernels per image.", talk=(2.91, 73.0)),
    Rung("ema", "fused EMA on a side stream", lambda cfg, s: {"ema": "off" if cfg.ema == "off" else "stream"},
         "one Triton kernel updates the whole EMA, on a side CUDA stream beside the next forward and on half the "
         "SMs, so that it sips bandwidth instead of taking the whole GPU (the talk ran its fused EMA on several "
         "streams; a full-width update on a side stream measured slower: gallery_lib/accel/ema.py).",
         talk=(2.93, 72.9)),
    Rung("zero2", "ZeRO-2", lambda cfg, s: {"data_parallel": "zero2"},
         "gradients and AdamW states sharded over the GPUs (FSDP2): less memory per GPU with several GPUs, nothing "
         "to shard on one. The talk spent the memory on batch 56.", talk=(2.96, 72.4)),
    Rung("bf16", "bfloat16", lambda cfg, s: {"amp_dtype": "bfloat16"}, builds_on="ema",
         why="bfloat16 autocast needs no loss scaling: no GradScaler, no unscale pass, no inf check per step."),
    Rung("compile", "torch.compile", lambda cfg, s: {"compile": True, "compile_mode": "default",
                                                      "compile_scope": "model"},
         "Inductor fuses the elementwise work around the matmuls and convolutions of the whole UNet into generated "
         "kernels (minutes of compilation on the first run)."),
    Rung("regional", "regional compile, precompiled",
         lambda cfg, s: {"compile_scope": "blocks", "precompile_workers": precompile_workers_for_machine()},
         "each repeated block compiled once and shared by its copies, the distinct ones compiled in parallel "
         "processes before the first step: the same speed for a fraction of the compile time."),
    Rung("cuda_graphs", "CUDA graphs",
         lambda cfg, s: {"compile_mode": "reduce-overhead", "compile_whole": accelerated(cfg).compile_whole},
         needs_gpu=True,
         why="each block's kernels replay as one CUDA graph: no Python or launch overhead between them. The up "
             "blocks compile whole, so that their skip connections are joined inside a graph, not between graphs "
             "with each output copied into the next one."),
    Rung("cached_latents", "cached latents", lambda cfg, s: {"cache_latents": True},
         "every image encoded by the VAE and every caption by CLIP once, before training; each step samples a fresh "
         "latent from the cached distribution (the same function), so the frozen encoders leave the loop.",
         frees_memory=True),
    Rung("channels_last", "channels_last", lambda cfg, s: {"channels_last": True, "channels_last_graphs": True},
         needs_gpu=True,
         why="the UNet's convolutions read and write NHWC, the layout cuDNN's fastest kernels use, instead of "
             "converting to it and back around each one; Inductor keeps that layout inside every compiled graph, "
             "the gradients of the backward included (measured on GPUs only)."),
    Rung("kernels", "kernels that beat the compiler",
         lambda cfg, s: {"kernel_ops": accelerated(cfg).resolved_kernel_ops},  # named, as each rung names its switch
         "the accelerated recipe's kernels, those that measured faster than Inductor's own code in a compiled SD "
         "step: GEGLU, and on a GPU from 32 images of 512 px a step GroupNorm+SiLU too; the compiler fuses "
         "LayerNorm (and GroupNorm+SiLU at smaller steps) itself. The gain over the rung below says whether that "
         "choice holds on this GPU at this batch."),
    Rung("checkpointing", "activation checkpointing, larger batch",
         lambda cfg, s: {"gradient_checkpointing": True, "batch_size": s.checkpointing_batch,
                         "compile_mode": "default", "compile_whole": ""},
         "blocks recompute their activations in the backward instead of storing them: about a third more compute "
         "for room for a batch twice as large. It pays only if the larger batch runs that much faster per image. "
         "Without CUDA graphs: a block recomputed in the backward cannot replay inside its graph (and the up blocks "
         "compiled as their blocks again, as the accelerated recipe does with checkpointing).", frees_memory=True),
)
RUNG_NAMES = tuple(rung.name for rung in RUNGS)


def recipe_name(rung: Rung) -> str:
    """The rung's recipe and run-folder name, e.g. ``ladder-05-batch``."""
    return f"ladder-{RUNGS.index(rung):02d}-{rung.name}"


def rung_named(name: str) -> Rung:
    """A rung by its name (``batch``) or recipe name (``ladder-05-batch``)."""
    for rung in RUNGS:
        if name in (rung.name, recipe_name(rung)):
            return rung
    raise ConfigError(f"rung {name!r} is not on the ladder: choose from {', '.join(RUNG_NAMES)}.")


def rung_parents(on_gpu: bool) -> dict[str, str | None]:
    """The rung each rung builds on, by name (``None`` for the first): its ``builds_on``, else the nearest rung below
    it that this machine runs (a rung left out passes the one below it up)."""
    parents: dict[str, str | None] = {}
    below = None
    for rung in RUNGS:
        parents[rung.name] = rung.builds_on or below
        if on_gpu or not rung.needs_gpu:
            below = rung.name
    return parents


def ladder_configs(base: RunConfig, rungs: list[str] | None = None, *, sizes: LadderSizes | None = None,
                   on_gpu: bool | None = None) -> dict[str, RunConfig | None]:
    """The config of every rung (or of ``rungs``), by rung name, as it runs here: ``None`` for a rung this machine
    cannot run (a GPU rung on a CPU); on a GPU each fitted to the memory the run may use as every recipe is
    (``memory_fit.py``), at the rung's global batch."""
    on_gpu = runs_on_gpu(base) if on_gpu is None else on_gpu
    return fit_rungs(rung_chain(base, sizes=sizes, on_gpu=on_gpu), rungs, budget=rung_budget(base, on_gpu))


def rung_budget(base: RunConfig, on_gpu: bool) -> Budget | None:
    """The GPU memory the rungs may use (``read_budget``); ``None`` on a CPU, where no plan is made."""
    return read_budget(base.gpu_memory_gib) if on_gpu else None


def fit_rungs(chain: dict[str, RunConfig | None], rungs: list[str] | None = None, *,
              budget: Budget | None) -> dict[str, RunConfig | None]:
    """``ladder_configs`` from a chain already built (``rung_chain``): its rungs, or ``rungs``, fitted to ``budget``
    (``rung_budget``)."""
    wanted = [rung_named(name).name for name in rungs] if rungs is not None else list(chain)
    return {name: None if chain[name] is None else _fitted(chain[name], budget) for name in wanted}


def rung_chain(base: RunConfig, *, sizes: LadderSizes | None = None,
               on_gpu: bool | None = None) -> dict[str, RunConfig | None]:
    """Every rung's config before the memory plan, by rung name: each resolved on the rung below it, with the switch
    it adds (``None`` for a rung this machine cannot run)."""
    _check_family(base)
    sizes = sizes or default_sizes(base)
    on_gpu = runs_on_gpu(base) if on_gpu is None else on_gpu
    parents = rung_parents(on_gpu)
    resolved: dict[str, RunConfig | None] = {}
    for rung in RUNGS:
        if rung.needs_gpu and not on_gpu:
            resolved[rung.name] = None
            continue
        parent = parents[rung.name]
        start = base if parent is None else resolved[parent]
        cfg = start.replace(**rung.adds(start, sizes), recipe=recipe_name(rung))
        if cfg.compile:  # what a compiled rung measures: the memory plan keeps it compiled, or says it does not fit
            cfg = cfg.replace(extra={**cfg.extra, NAMED: sorted({*cfg.extra.get(NAMED, ()), "compile"})})
        resolved[rung.name] = cfg
    return resolved


@dataclass(frozen=True)
class Start:
    """Where a rung above may start its tries: the setting a rung ran at (``ran``), or, where it stopped out of
    memory or has not run, the first setting it has not tried, every faster one having run out of memory."""

    setting: Candidate
    ran: bool
    held_gib: float | None = None
    """Where it ran and its peak was measured: what it held there beyond its training state (its activations, the
    frozen modules, the allocator's slack), which a rung above with a larger state holds too."""
    state_gib: float | None = None
    """The training state of the rung it comes from, at ``setting``: a rung above with a smaller one may fit the
    settings that rung did not (compiled in blocks, the regional rung holds 3.2 GiB less for SD-1.5 under
    accumulation than the compile rung below it)."""


def _fitted(cfg: RunConfig, budget: Budget | None, start: Start | None = None) -> RunConfig:
    """The rung with its switches, at the setting the memory plan picks: each setting it weighs is the rung's config
    with that batch, accumulation and checkpointing (a rung that replays CUDA graphs refuses the last two).
    ``start``: where the rung it builds on ran or goes on trying (``fit_to_memory``'s ``start_at``)."""
    return fit_to_memory(cfg, lambda planned: cfg.replace(**planned), budget, start_at=start and start.setting,
                         builds_on_ran=start is None or start.ran, start_held_gib=start and start.held_gib)


def _ran_at(cfg: RunConfig, setting: Candidate, peak_gib: float | None) -> Start:
    """Where a rung (``cfg`` as fitted to the memory) ran, with what it held there beyond its training state where its
    peak reserved memory (``peak_gib``) was measured."""
    state = _state_gib(cfg, setting)
    held = None if peak_gib is None or state is None else peak_gib - state
    return Start(setting, ran=True, held_gib=held, state_gib=state)


def _state_gib(cfg: RunConfig, setting: Candidate) -> float | None:
    """The training state (``training_state``) of a rung (``cfg`` as fitted: the EMA on the CPU where the plan moved
    it there) at ``setting``; ``None`` where its family does not count it, or the rung cannot run there."""
    try:
        at = cfg.replace(**setting.fields())
    except ConfigError:  # CUDA graphs under checkpointing: the plan passes such a setting by
        return None
    state = training_state(uncompiled(at) if setting.uncompiled else at)
    return None if state is None else state.gib


def _holds_as_much(cfg: RunConfig, start: Start | None) -> bool:
    """Whether a rung (``cfg`` as fitted) holds at ``start``'s setting at least the training state of the rung the
    start comes from: only then do the settings that rung did not fit not fit this one either. At 22 GiB the
    compile rung, compiled whole, trained 6 x 8 checkpointed and the regional rung above it 12 x 4 checkpointed
    (benchmarks/RESULTS.md#ladder-22-gib)."""
    state = None if start is None or start.state_gib is None else _state_gib(cfg, start.setting)
    return state is None or state >= start.state_gib


def _check_family(base: RunConfig) -> None:
    needed = ("cache_latents",)  # the ladder's own switches of the text-to-image task
    own = {f.name for f in fields(base.model_family.options)}
    if not set(needed) <= own:
        raise ConfigError(f"the optimization ladder trains Stable Diffusion's UNet; {base.model!r} is a "
                          f"{base.task} model. Use model='sd15' (or 'sd_tiny' on a CPU).")


def rung_recipes() -> dict[str, Callable[[RunConfig], RunConfig]]:
    """Every rung as a recipe (``base -> config``), registered beside the named recipes."""
    def make(rung: Rung) -> Callable[[RunConfig], RunConfig]:
        def recipe(base: RunConfig) -> RunConfig:  # ``recipe_config`` fits it to the memory
            cfg = rung_chain(base)[rung.name]
            if cfg is None:
                raise ConfigError(f"the ladder's {rung.name} rung needs a GPU: this machine has none.")
            return cfg
        recipe.__doc__ = f"Optimization ladder, rung {RUNGS.index(rung)}: {rung.title}. {rung.why}"
        recipe.planned_on_top = True  # the memory plan's setting goes on the rung, as in ``ladder_configs``
        return recipe
    return {recipe_name(rung): make(rung) for rung in RUNGS}


register_recipes(rung_recipes())


SMALLER_SIZES = "or climb the ladder at smaller batches (its batch_size, large_batch and checkpointing_batch)"
"""The way out for a rung too large for the GPU, after what the memory plan says."""


@dataclass
class RungResult:
    """One rung's run: its config and summary, or why it did not run."""

    rung: Rung
    config: RunConfig | None
    summary: dict | None = None
    failure: str | None = None
    """``None`` when it ran; otherwise why not (``needs a GPU``, ``out of memory``, ``loss not finite from step 1``)."""
    builds_on: str | None = None
    """The rung it builds on on this machine (``rung_parents``), whether or not that one ran too."""
    log: str | None = None
    """The log of a rung that stopped."""
    does_not_fit: bool = False
    """The memory plan refused it before it started: no setting of it fits the GPU's memory (``failure`` says how
    much it needs). Not an error: the rung is too large for this GPU."""

    @property
    def stopped(self) -> bool:
        """It started and stopped with an error (a rung left out on this machine, or too large for its GPU, did not
        start)."""
        return self.config is not None and self.failure is not None and not self.does_not_fit

    def line(self) -> str:
        """``ladder-13-kernels (<title>): stopped, <why>, see <log>``, ``...: does not fit in 16.0 GiB: <why>``, or
        why it was left out."""
        if self.does_not_fit:
            return f"{recipe_name(self.rung)} ({self.rung.title}): {self.failure}; {SMALLER_SIZES}"
        verb = "stopped" if self.stopped else "left out"
        return (f"{recipe_name(self.rung)} ({self.rung.title}): {verb}, {self.failure}"
                + (f", see {self.log}" if self.log else ""))


class LadderRuns(list):
    """The rungs' results in ladder order; ``raise_if_failed`` once everything that ran is shown."""

    def raise_if_failed(self) -> None:
        stopped = [result.line() for result in self if result.stopped]
        if stopped:
            raise RunsFailed(stopped)


def run_ladder(base: RunConfig, rungs: list[str] | None = None, *, sizes: LadderSizes | None = None,
               echo: Callable[[str], None] | None = print, console: str = "result") -> LadderRuns:
    """Runs the rungs one after another, each in its own training process. Every config is resolved and checked for
    this machine before the first starts; a rung that fails (out of memory, say) is reported and the ladder goes on.
    Where the memory plan has no measurement for a rung and must try its settings, a rung whose switch frees no
    memory starts at the setting the rung it builds on ran at (``Rung.frees_memory``): in this call, or for a rung
    below the ones asked for, where the plan knows it runs. Where that rung stopped out of memory, or has not run
    here, it starts at the first setting that rung has not run out of memory at; of the rungs below, down to one
    that frees memory, the start furthest down the settings. ``console``: one line per rung
    (``result``) or every line of each (``all``), as ``launch`` takes it."""
    on_gpu = runs_on_gpu(base)
    chain = rung_chain(base, sizes=sizes, on_gpu=on_gpu)
    budget = rung_budget(base, on_gpu)  # read once: the rungs fitted again below take the same
    configs = fit_rungs(chain, rungs, budget=budget)
    parents = rung_parents(on_gpu)
    for cfg in configs.values():
        if cfg is not None:
            validate_for_machine(cfg)
    results = LadderRuns()
    starts_from = {name: _rungs_it_starts_from(name, parents) for name in configs}
    starts = {name: _where_it_starts(chain.get(name), budget, learned_only=True)
              for name in {rung for rungs in starts_from.values() for rung in rungs} - set(configs)}
    for name, cfg in configs.items():
        rung = rung_named(name)
        if cfg is None:
            results.append(RungResult(rung, None, failure="needs a GPU", builds_on=parents[name]))
            continue
        below = _furthest([start for start in (starts.get(rung_below) for rung_below in starts_from[name])
                           if _holds_as_much(cfg, start)], chain[name])
        if below is not None and not rung.frees_memory and cfg.extra.get(PLAN, {}).get("probe"):
            cfg = _fitted(chain[name], budget, below)
            validate_for_machine(cfg)
        else:
            below = None
        if echo and console == "all":
            echo(f"\n=== {cfg.recipe}: {describe(cfg.recipe)} ===")
        try:
            results.append(RungResult(rung, cfg, summary=launch(cfg, echo=echo, console=console).summary,
                                      builds_on=parents[name]))
            summary = results[-1].summary or {}
            if summary.get(PLAN, {}).get("chosen"):
                peak_mb = summary.get("peak_reserved_mb")
                starts[name] = _ran_at(cfg, Candidate(**summary[PLAN]["chosen"]), peak_mb and peak_mb / 1024)
        except RunFailed as exc:
            reason, log = (exc.failure.reason, exc.failure.log) if exc.failure else (failure_reason(str(exc)), None)
            too_large = exc.failure is not None and exc.failure.kind == "does_not_fit"
            if exc.failure is not None and exc.failure.kind == "out_of_memory":
                # its settings that ran out are now in this GPU's footprints: the rung above starts past them (the
                # EMA rung stopped mid-run at 22 GiB, and the compile rung above tried from batch 48 again)
                starts[name] = _where_it_starts(chain[name], budget, below)
            results.append(RungResult(rung, cfg, failure=reason, builds_on=parents[name], log=None if too_large
                                      else log, does_not_fit=too_large))
            if echo:
                echo(f"[ladder] {results[-1].line()}; going on with the next rung")
    return results


def _rungs_it_starts_from(name: str, parents: dict[str, str | None]) -> list[str]:
    """The rungs whose setting a rung may start at, nearest first: the one it builds on, the one below it, and so on,
    as long as the rungs passed free no memory (``_furthest`` takes the start furthest down of those). At 16 GiB
    the compile rung does not fit (compiled whole, a step that accumulates holds a second copy of the gradients), and
    the regional rung above it starts where the bf16 rung ran, not from the fastest setting."""
    rungs = []
    below = parents[name]
    while below is not None:
        rungs.append(below)
        if rung_named(below).frees_memory:
            break
        below = parents[below]
    return rungs


def _furthest(starts: list[Start | None], cfg: RunConfig) -> Start | None:
    """Of the starts the rungs below give (``None``: nothing known), the one furthest down the settings at ``cfg``'s
    global batch: each rules out the settings faster than it, since the rungs between free no memory. A rung that
    ran there wins over one that only ran out of memory before it."""
    total = cfg.batch_size * cfg.gradient_accumulation_steps
    known = [start for start in starts if start and start.setting.batch_size * start.setting.accumulation == total]
    return max(known, key=lambda start: (start.setting.slowness(), start.ran), default=None)


def _where_it_starts(cfg: RunConfig | None, budget: Budget | None, start: Start | None = None, *,
                     learned_only: bool = False) -> Start | None:
    """Where a rung (not run in this call, or stopped out of memory in it) runs, as the plan knows it without trying:
    measured, or run on this GPU before (a ladder climbed in parts); where none of its settings is known to fit, the
    first it would try. ``start``: where its own tries started. ``learned_only``: that first setting only where
    faster ones ran out of memory on this GPU (otherwise it tells nothing, and a rung further below may)."""
    fitted = _fitted(cfg, budget, start) if cfg is not None else None
    plan = fitted.extra.get(PLAN) if fitted is not None else None
    if plan and plan.get("chosen"):
        return _ran_at(fitted, Candidate(**plan["chosen"]), plan.get("estimate_gib"))
    if not plan or not plan.get("probe") or learned_only and not plan.get("ran_out_here"):
        return None
    setting = Candidate(**plan["probe"][0])
    return Start(setting, ran=False, state_gib=_state_gib(fitted, setting))


def failure_reason(message: str) -> str:
    """A failed run's message in a table cell's worth: ``out of memory``, else its last error line."""
    if "out of memory" in message.lower():
        return "out of memory"
    lines = [line.strip() for line in message.splitlines() if "Error" in line]
    return lines[-1][:200] if lines else message.splitlines()[0][:200]
