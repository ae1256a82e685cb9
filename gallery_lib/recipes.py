"""Named recipes: each is ``base.replace(...)`` of one base config, so runs differ only where named.

``baseline``    what a user runs today (the Swin reference code): eager, AMP O1 (float16 with a
                GradScaler on a GPU), standard AdamW, DDP when several processes.
``compiled``    the plain ``torch.compile`` peer: compile + bfloat16 autocast + fused AdamW.
``accelerated`` the best this library can do: ``compiled`` plus fused SDPA window attention
                and a data loader using every core. It grows as the kernel,
                EMA and compile-hook work lands; every switch stays because a measurement kept it
                (``benchmarks/results/``).
"""

from __future__ import annotations

import os
from typing import Callable

from gallery_lib.config import ConfigError, RunConfig


def baseline(base: RunConfig) -> RunConfig:
    """Eager PyTorch with AMP O1 and standard AdamW: the reference everyone starts from."""
    return base.replace(recipe="baseline", amp_level="O1", amp_dtype="auto", compile=False, fused_optimizer=False,
                        kernels=False, fused_attention=False, channels_last=False)


def compiled(base: RunConfig) -> RunConfig:
    """``torch.compile`` (default mode) with bfloat16 autocast and fused AdamW: what a user picks next."""
    return base.replace(recipe="compiled", amp_level="O1", amp_dtype="bfloat16", compile=True, compile_mode="default",
                        fused_optimizer=True, kernels=False, fused_attention=False, channels_last=False)


def accelerated(base: RunConfig) -> RunConfig:
    """Everything that measured faster than ``compiled`` on the GPU."""
    # Measured on an H200 (Swin-T, batch 128, model step alone, benchmarks/results/swin_variants_h200.json):
    # compiled 4,213 img/s; + SDPA window attention 4,831 (+15%); + channels_last 4,385 alone but slower
    # combined with SDPA; + O2 4,030 (slower). So: SDPA attention, and a loader fast enough to feed it.
    return compiled(base).replace(
        recipe="accelerated",
        fused_attention=True,
        # Tuned loading: decode + RandAugment is CPU-bound at >3,000 img/s, so use every core but two
        # (the training process launches kernels and the pin-memory thread copies batches).
        num_workers=max(base.num_workers, (os.cpu_count() or 4) // base.nproc_per_node - 2),
    )


RECIPES: dict[str, Callable[[RunConfig], RunConfig]] = {
    "baseline": baseline,
    "compiled": compiled,
    "accelerated": accelerated,
}


def apply_recipe(name: str, base: RunConfig) -> RunConfig:
    """Resolves recipe ``name`` on top of ``base``; unknown names fail with the list of recipes."""
    if name not in RECIPES:
        raise ConfigError(f"recipe={name!r} is not known: choose one of {', '.join(RECIPES)}.")
    return RECIPES[name](base)


def describe(name: str) -> str:
    """The recipe's one-line explanation (its docstring), for notebooks and ``gallery --help``."""
    return (RECIPES[name].__doc__ or "").strip()
