"""When a run replays CUDA graphs: by the size of its step, and only where the graphs can replay.

A step small enough for its host to set the step time gains from CUDA graphs (the family's
``ModelFamily.block_graphs_below_pixels``); a larger one only pays their memory. A recipe that chose ``compile_mode``
this way notes it in ``RunConfig.extra`` (``GRAPHS_BY_BATCH``), so that a run at another batch size (the batch-size
search's trials, its chosen size) decides again (``at_batch_size``). Recipes choose; the run re-decides.
"""

from __future__ import annotations

from typing import Any

from gallery_lib.config import CUDA_GRAPH_COMPILE_MODES, RunConfig

GRAPHS_BY_BATCH = "block_graphs_by_batch"
"""The note in ``RunConfig.extra`` saying that a recipe chose ``compile_mode`` from the step's size."""


def graph_mode_for_batch(base: RunConfig) -> str:
    """``reduce-overhead`` where a step of ``base`` is small enough for its host to set the step time, so that CUDA
    graphs of the compiled blocks (or model) speed it up (``ModelFamily.block_graphs_below_pixels``), else
    ``default``."""
    limit = base.model_family.block_graphs_below_pixels
    return "reduce-overhead" if limit is None or base.batch_size * base.image_size ** 2 < limit else "default"


def graphs_can_replay(base: RunConfig) -> bool:
    """A block recomputed in the backward (checkpointing) cannot replay as a CUDA graph, and ZeRO-2's collectives run
    in hooks outside the graphs."""
    return not (base.gradient_checkpointing or base.data_parallel == "zero2")


def without_graphs_where_they_cannot_replay(base: RunConfig, switches: dict[str, Any]) -> dict[str, Any]:
    """``switches`` with a CUDA-graph ``compile_mode`` turned back to ``default`` where ``base`` cannot replay them."""
    if not graphs_can_replay(base) and switches.get("compile_mode") in CUDA_GRAPH_COMPILE_MODES:
        return {**switches, "compile_mode": "default"}
    return switches


def at_batch_size(cfg: RunConfig, batch_size: int) -> RunConfig:
    """``cfg`` at another batch size, with the CUDA graphs decided again for that size where a recipe decided them
    by the step's size, and not named by the user."""
    cfg = cfg.replace(batch_size=batch_size)
    return cfg.replace(compile_mode=graph_mode_for_batch(cfg)) if cfg.extra.get(GRAPHS_BY_BATCH) else cfg
