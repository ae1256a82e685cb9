"""What a recipe decides by the size of a step: its CUDA graphs, and the family's switches for large steps.

A step small enough for its host to set the step time gains from CUDA graphs (the family's
``ModelFamily.block_graphs_below_pixels``); a larger one only pays their memory. Some fused kernels pay only once a
step has work enough for them (``ModelFamily.accelerated_on_large_steps`` from ``large_step_pixels``). A recipe that
chose this way notes it in ``RunConfig.extra`` (``GRAPHS_BY_BATCH``, ``SMALL_STEP_SWITCHES``), so that a run at another
batch size (the batch-size search's trials, its chosen size) decides again (``at_batch_size``), and a setting the user
names stays (``kept_as_named``). Recipes choose; the run re-decides.
"""

from __future__ import annotations

from typing import Any, Iterable

from gallery_lib.config.run_config import CUDA_GRAPH_COMPILE_MODES, RunConfig

GRAPHS_BY_BATCH = "block_graphs_by_batch"
"""The note in ``RunConfig.extra`` saying that a recipe chose ``compile_mode`` from the step's size."""

SMALL_STEP_SWITCHES = "small_step_switches"
"""The note in ``RunConfig.extra`` saying that a recipe chose the family's large-step switches from the step's size:
the values those settings take below ``ModelFamily.large_step_pixels``."""


def graph_mode_for_batch(base: RunConfig) -> str:
    """``reduce-overhead`` where a step of ``base`` is small enough for its host to set the step time, so that CUDA
    graphs of the compiled blocks (or model) speed it up (``ModelFamily.block_graphs_below_pixels``), else
    ``default``."""
    limit = base.model_family.block_graphs_below_pixels
    return "reduce-overhead" if limit is None or _step_pixels(base) < limit else "default"


def switches_for_step(cfg: RunConfig, small: dict[str, Any]) -> dict[str, Any]:
    """The family's ``accelerated_on_large_steps`` where a step of ``cfg`` holds at least ``large_step_pixels``,
    else ``small`` (the same settings as they are without them)."""
    limit = cfg.model_family.large_step_pixels
    large = limit is not None and _step_pixels(cfg) >= limit
    return dict(cfg.model_family.accelerated_on_large_steps) if large else dict(small)


def with_large_step_switches(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the family's large-step switches where its step is large enough, noted so that another batch size
    decides again."""
    names = cfg.model_family.accelerated_on_large_steps
    if not names:
        return cfg
    small = {name: getattr(cfg, name) for name in names}
    return cfg.replace(**switches_for_step(cfg, small), extra={**cfg.extra, SMALL_STEP_SWITCHES: small})


def graphs_can_replay(base: RunConfig) -> bool:
    """A block recomputed in the backward (checkpointing) cannot replay as a CUDA graph, ZeRO-2's collectives run
    in hooks outside the graphs, and accumulated batches would add up gradients that the next replay overwrites
    (CUDA-graph trees hand them out of the graphs' memory pool; seen on an H200, benchmarks/RESULTS.md#memory-plan)."""
    return not (base.gradient_checkpointing or base.data_parallel == "zero2" or base.gradient_accumulation_steps > 1)


def without_graphs_where_they_cannot_replay(base: RunConfig, switches: dict[str, Any]) -> dict[str, Any]:
    """``switches`` with a CUDA-graph ``compile_mode`` turned back to ``default`` where ``base`` cannot replay them."""
    if not graphs_can_replay(base) and switches.get("compile_mode") in CUDA_GRAPH_COMPILE_MODES:
        return {**switches, "compile_mode": "default"}
    return switches


def at_batch_size(cfg: RunConfig, batch_size: int) -> RunConfig:
    """``cfg`` at another batch size, with what a recipe decided by the step's size (and the user did not name)
    decided again for that size."""
    cfg = cfg.replace(batch_size=batch_size)
    if cfg.extra.get(GRAPHS_BY_BATCH):
        cfg = cfg.replace(compile_mode=graph_mode_for_batch(cfg))
    if SMALL_STEP_SWITCHES in cfg.extra:
        cfg = cfg.replace(**switches_for_step(cfg, cfg.extra[SMALL_STEP_SWITCHES]))
    return cfg


def kept_as_named(cfg: RunConfig, named: Iterable[str]) -> RunConfig:
    """``cfg`` without the notes that would decide a setting in ``named`` (the user's) again at another batch size."""
    named = set(named)
    drop = {GRAPHS_BY_BATCH} if "compile_mode" in named else set()
    if named & set(cfg.extra.get(SMALL_STEP_SWITCHES, {})):
        drop.add(SMALL_STEP_SWITCHES)
    return cfg.replace(extra={k: v for k, v in cfg.extra.items() if k not in drop}) if drop else cfg


def _step_pixels(cfg: RunConfig) -> int:
    """The pixels of a step's images per process."""
    return cfg.batch_size * cfg.image_size ** 2


COMPILE_ONLY = {"compile_mode": "default", "compile_scope": "model", "compile_whole": "", "precompile_workers": 0,
                "coordinate_descent_tuning": False, "tiled_reductions": False, "channels_last_graphs": False}
"""The settings that act only through ``torch.compile``, at their defaults."""


def uncompiled(cfg: RunConfig, named: Iterable[str] = ()) -> RunConfig:
    """``cfg`` with ``torch.compile`` off and the settings that act only through it (``COMPILE_ONLY``, but those in
    ``named``) at their defaults: the memory plan's setting where no compiled step fits, and a compiled recipe with a
    user's ``compile=false``."""
    left = {name: value for name, value in COMPILE_ONLY.items() if name not in set(named)}
    return cfg.replace(compile=False, **left, extra={k: v for k, v in cfg.extra.items() if k != GRAPHS_BY_BATCH})
