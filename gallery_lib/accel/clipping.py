"""Gradient-norm clipping folded into a fused optimizer's pass.

``clip_grad_norm_`` makes two passes over the gradients: one for their total norm, one that scales every gradient in
place by ``min(1, max_norm / (norm + 1e-6))``. A fused optimizer (``torch.optim.AdamW(fused=True)``, Adam, SGD) can
divide each gradient by a device scalar as it reads it: its ``grad_scale`` input, which ``GradScaler`` uses to unscale
fp16 gradients. Handing it the clip factor's inverse computes the same update without the scaling pass; the gradients
it leaves behind are the clipped ones, as after ``clip_grad_norm_``.

Where the pass cannot take the factor (no fused optimizer, a ``GradScaler`` that owns ``grad_scale``, sharded DTensor
gradients whose norm needs a reduction over the processes), ``clip_then_step`` clips as its own pass. ``can_fold``
decides that at each step; ``run_folds`` reads the same rule from a run's config, for what a notebook shows first.
"""

from __future__ import annotations

import torch

from gallery_lib.config.sections.training import Optimizer as OptimizerSettings

_EPS = 1e-6  # clip_grad_norm_'s: the factor is max_norm / (norm + 1e-6)


def can_fold(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> bool:
    """Whether ``optimizer``'s step can apply the clip factor to ``grads`` itself."""
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)  # set by the fused Adam, AdamW and SGD
    return (fused and getattr(optimizer, "grad_scale", None) is None
            and not any(hasattr(g, "to_local") for g in grads))


def run_folds(optimizer: OptimizerSettings, *, data_parallel: str, amp_dtype: torch.dtype | None) -> bool:
    """Whether a run with these ``optimizer`` settings (its autocast dtype ``amp_dtype``) clips in its optimizer's
    pass: ``can_fold``'s rule read from the config (float16 brings a GradScaler; ZeRO-2 shards the gradients)."""
    return bool(optimizer.clip_in_optimizer and optimizer.clip_grad and optimizer.fused_optimizer
                and amp_dtype != torch.float16 and data_parallel != "zero2")


def clip_then_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float | None,
                   fold: bool = True) -> torch.Tensor | None:
    """Clips the gradients of ``params`` to a total 2-norm of ``max_norm`` (``None``: no clipping) and steps
    ``optimizer``, in the optimizer's pass when ``fold`` and it ``can_fold``; returns the total norm before clipping,
    as ``clip_grad_norm_`` does."""
    if not max_norm:
        optimizer.step()
        return None
    grads = [p.grad for p in params if p.grad is not None]
    if not (fold and can_fold(optimizer, grads)):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    optimizer.grad_scale = torch.clamp((norm + _EPS) / max_norm, min=1.0).float()
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None
    return norm
