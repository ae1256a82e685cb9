"""Stochastic depth that lets a model's blocks share their compiled graphs.

timm's ``DropPath`` keeps each block's rate as a Python float, which Dynamo bakes into the block's graph: blocks
compiled in place then compile a graph each where blocks of one shape would share one (timm's Swin, built with
``drop_path_rate=0.1``: 24 graphs for Swin-S's blocks, of at most 8 shapes), and the graphs of the states
``accelerate`` times fill the code object's cache until blocks run eagerly (benchmarks/RESULTS.md#your-model).
``rates_as_tensors`` holds each rate in a 0-dim buffer instead, which the graph takes as an input: the same
function, drawn and scaled as timm does, in one graph per shape.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch import nn

KEEP = "_gallery_keep_prob"
"""The buffer (not saved: ``state_dict`` is unchanged) that holds a block's probability of keeping its path."""


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ``drop_path`` with the rate read from ``KEEP``: a path kept with its probability, scaled by its
    inverse where ``scale_by_keep``."""
    if not self.training:
        return x
    keep = getattr(self, KEEP)
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)  # one draw per sample
    kept = x.new_empty(shape).bernoulli_(keep)
    return x * (kept / keep if self.scale_by_keep else kept)


def _is_timm_drop_path(module: nn.Module) -> bool:
    rate = getattr(module, "drop_prob", None)
    return (type(module).__name__ == "DropPath" and type(module).__module__.startswith("timm.")
            and isinstance(rate, float) and 0.0 <= rate < 1.0 and hasattr(module, "scale_by_keep"))


def rates_as_tensors(model: nn.Module) -> tuple[int, Callable[[], None]]:
    """Holds each timm ``DropPath`` rate of ``model`` in a buffer on its parameters' device, so that Dynamo does not
    specialize a block's graph on it. Returns how many it changed and the call that undoes them."""
    changed = [module for module in model.modules() if _is_timm_drop_path(module) and KEEP not in module._buffers]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for module in changed:
        module.register_buffer(KEEP, torch.tensor(1.0 - module.drop_prob, device=device), persistent=False)
        module.forward = types.MethodType(_forward, module)

    def undo() -> None:
        for module in changed:
            del module.forward
            del module._buffers[KEEP]

    return len(changed), undo
