"""The settings a recipe states as intent, and the rule that resolves them for the size of a step.

A step small enough for its host to set the step time gains from CUDA graphs (the family's
``ModelFamily.block_graphs_below_pixels``); a larger one only pays their memory. Some fused kernels pay only once a
step has work enough for them (``ModelFamily.accelerated_on_large_steps`` from ``large_step_pixels``). A recipe
that chooses these by the step's size says so in the config itself, ``compile_mode='auto'`` and
``kernel_ops='auto'`` (``AUTO``), and the config resolves them by this rule from its own batch size, image size and
family wherever they are read (``RunConfig.resolved_compile_mode``, ``RunConfig.cuda_graphs``,
``RunConfig.resolved_kernel_ops``, ``RunConfig.kernel_op_names``). So the config at another batch size (the
batch-size search's trials and its chosen size, the memory plan's settings) runs what the recipe would choose at
that size, with nothing but the config deciding it, and a value the user names, a concrete one, runs as named at
every batch size. Recipes state intent; the config resolves it where the batch size is known.
"""

from __future__ import annotations

from gallery_lib.config.family import ModelFamily
from gallery_lib.config.sections.acceleration import AUTO

__all__ = ["AUTO", "graphs_can_replay", "resolved_compile_mode", "resolved_kernel_ops", "step_pixels"]


def step_pixels(batch_size: int, image_size: int) -> int:
    """The pixels of a step's images per process: what the family's thresholds are in."""
    return batch_size * image_size ** 2


def graphs_can_replay(*, gradient_checkpointing: bool, data_parallel: str, gradient_accumulation_steps: int) -> bool:
    """A block recomputed in the backward (checkpointing) cannot replay as a CUDA graph, ZeRO-2's collectives run
    in hooks outside the graphs, and accumulated batches would add up gradients that the next replay overwrites
    (CUDA-graph trees hand them out of the graphs' memory pool; seen on an H200, benchmarks/RESULTS.md#memory-plan)."""
    return not (gradient_checkpointing or data_parallel == "zero2" or gradient_accumulation_steps > 1)


def resolved_compile_mode(compile_mode: str, family: ModelFamily, pixels: int, can_replay: bool) -> str:
    """The ``torch.compile`` mode of a step of ``pixels`` (``step_pixels``): ``compile_mode``, where ``auto`` is
    ``reduce-overhead`` while the step is small enough for its host to set the step time, so that CUDA graphs of the
    compiled blocks (or model) speed it up (below the family's ``block_graphs_below_pixels``), and the graphs
    ``can_replay`` (``graphs_can_replay``); else ``default``."""
    if compile_mode != AUTO:
        return compile_mode
    limit = family.block_graphs_below_pixels
    return "reduce-overhead" if can_replay and (limit is None or pixels < limit) else "default"


def resolved_kernel_ops(kernel_ops: str, family: ModelFamily, pixels: int) -> str:
    """The kernels a step of ``pixels`` swaps in (with ``kernels=True``): ``kernel_ops``, where ``auto`` is the
    family's ``accelerated_on_large_steps`` kernels once the step holds at least ``large_step_pixels``, else those of
    its ``accelerated`` switches (``all`` where they name none)."""
    if kernel_ops != AUTO:
        return kernel_ops
    if family.large_step_pixels is not None and pixels >= family.large_step_pixels:
        return family.accelerated_on_large_steps["kernel_ops"]
    return family.accelerated.get("kernel_ops", "all")
