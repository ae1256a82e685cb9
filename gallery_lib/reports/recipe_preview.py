"""What a recipe's calls change on a model, as a run of it on this machine makes them: the notebooks' preview of
the ``accelerated`` recipe, before any training. Read from the recipe's resolved config, so a switch the recipe keeps
for a GPU is said to be left out on a CPU, and CUDA graphs are named only where they run.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from gallery_lib.accel.on_any_model import (RESULTS, Change, compile_blocks, device_phrase, fuse_attention,
                                            fuse_kernels, graphs_text, use_channels_last)
from gallery_lib.recipes import recipe_config, runs_on_gpu


def recipe_changes(base: Any, model: nn.Module, recipe: str = "accelerated", *,
                   echo: Callable[[str], Any] | None = print) -> list[Change]:
    """What ``recipe``'s calls change on ``model`` (the module ``base``'s runs train, e.g. built on PyTorch's ``meta``
    device: its structure only) as a run of it on this machine makes them, read from the recipe's resolved config:
    a switch the recipe keeps for a GPU is said to be left out on a CPU, and CUDA graphs are named only where they
    run. Returns (and by default prints) the changes.

        with torch.device("meta"):
            unet = base.model_family.build(base.model, image_size=base.image_size).unet
        recipe_changes(base, unet)
    """
    cfg = recipe_config(base, recipe, {})
    device = "cuda" if runs_on_gpu(cfg) else "cpu"
    changes: list[Change] = []
    if cfg.channels_last:
        changes.append(use_channels_last(model, device_type=device))
    elif device != "cuda" and cfg.model_family.accelerated_on_gpu.get("channels_last") and recipe == "accelerated":
        changes.append(Change("channels_last", f"left out on {device_phrase(device)}: the recipe lays the "
                              "convolutions out in NHWC on a GPU only, so this run keeps the default layout",
                              "convolutions on a GPU's tensor cores read NHWC without transposing",
                              f"{RESULTS}#sd15-layout", changed=False))
    if cfg.kernels:
        changes.append(fuse_kernels(model, cfg.kernel_op_names, device_type=device))
    if cfg.fused_attention:
        changes.append(fuse_attention(model))
    mode = cfg.resolved_compile_mode  # its ``auto`` resolved for the step
    if cfg.compile and cfg.compile_scope == "blocks":
        changes.append(compile_blocks(model, mode=None if mode == "default" else mode, device_type=device))
    elif cfg.compile:
        graphs = graphs_text(mode, device)
        changes.append(Change("compiled model", f"the whole {type(model).__name__} compiled as one graph (mode "
                              f"{mode}{graphs}); compilation happens in the first steps",
                              "Inductor fuses the memory-bound ops across the whole step",
                              f"{RESULTS}#dreambooth"))
    if echo is not None:
        for change in changes:
            echo(str(change))
    return changes
