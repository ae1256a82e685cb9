"""Named recipes: each is ``base.replace(...)`` of one base config, so runs differ only where named.

``baseline``    what a user runs today (the Swin reference code, diffusers' ``train_text_to_image.py``):
                eager, AMP O1 (float16 with a GradScaler on a GPU), standard AdamW, a per-tensor EMA loop
                when the profile trains an EMA, DDP when several processes.
``compiled``    the plain ``torch.compile`` peer: compile + bfloat16 autocast + fused AdamW + foreach EMA.
``accelerated`` the best this library can do, switch by switch as measurements keep them, per task
                (``_ACCELERATED``): for Swin-T, ``compiled`` plus window attention through the backend
                registry. Every switch stays because a measurement kept it (``benchmarks/results/``).

Whether a run keeps an EMA at all is the profile's choice (``ema`` on or ``off``); a recipe only picks how the
update runs.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from gallery_lib.config import ConfigError, RunConfig, resolve_device, visible_cuda_devices


def baseline(base: RunConfig) -> RunConfig:
    """Eager PyTorch with AMP O1 and standard AdamW: the reference everyone starts from."""
    return base.replace(recipe="baseline", amp_level="O1", amp_dtype="auto", compile=False, fused_optimizer=False,
                        kernels=False, fused_attention=False, channels_last=False, ema=_ema_mode(base, "loop"),
                        cache_latents=False)


def compiled(base: RunConfig) -> RunConfig:
    """``torch.compile`` (default mode) with bfloat16 autocast, fused AdamW and a foreach EMA: what a user picks next."""
    return base.replace(recipe="compiled", amp_level="O1", amp_dtype="bfloat16", compile=True, compile_mode="default",
                        fused_optimizer=True, kernels=False, fused_attention=False, channels_last=False,
                        ema=_ema_mode(base, "foreach"), cache_latents=False)


def accelerated(base: RunConfig) -> RunConfig:
    """Everything that measured faster than ``compiled`` on the GPU, for the model's task."""
    # Per task, the switches that measured faster than compiled, with the measurements beside them (_ACCELERATED).
    cfg = compiled(base).replace(recipe="accelerated")
    switches = dict(_ACCELERATED[base.task])
    if "ema" in switches:
        switches["ema"] = _ema_mode(base, switches["ema"])
    if switches.get("compile_scope") == "blocks" and _runs_on_gpu(base):  # CUDA graphs per block, precompiled
        switches.update(compile_mode="reduce-overhead", precompile_workers=_precompile_workers())
    return cfg.replace(**switches)


_ACCELERATED: dict[str, dict[str, Any]] = {
    # Swin-T at batch 128, the training step alone, one H100: window attention through gallery_lib.attention (auto
    # picks the memory-efficient SDPA kernel, the fastest that takes the relative-position bias: 1.37 ms vs plain
    # SDPA's cuDNN pick at 2.50 ms for stage 1, attention_h100.json). The recipes as committed, same run
    # (swin_accelerated_step_h100.json): 4,479 against 3,790 img/s, 28.6 vs 33.8 ms/step in every 10-step window,
    # 6.96 vs 7.72 GiB, same losses. A first run of the switch (swin_fused_attention_step_h100_v2.json) gave 4,061
    # against 3,794 img/s with bimodal steps (p20 28.6 ms, p80 34.1 ms). timm's own SDPA switch (cuDNN with a mask)
    # had swung between +15% and -8% on an H200. Not kept, all on an H200: channels_last (+4% in one run), AMP O2
    # (-4%), max-autotune (autotuning did not finish in 8 minutes).
    "classification": {"fused_attention": True},
    # Stable Diffusion (text_to_image), measured on an H200 at 512 px, batch 8, EMA on (benchmarks/results/sd15_*):
    # compiled 51.8 img/s, accelerated 88.3 img/s (1.70x). Cached latents take the VAE encoder (~46% of the UNet's
    # training FLOPs per image), the text encoder and PNG decoding out of every step; the fused EMA kernel is the
    # fastest update (4.3 ms vs 5.0 foreach for the 860M UNet, ema_compile_attention_h200.json). channels_last:
    # +0.6% at batch 32 (131.0 -> 131.8 img/s), within noise, so it stays off. The batch size is the run's: at the
    # largest batch that fits comfortably (64, 62 GiB) accelerated reaches 140.0 img/s, 45% MFU.
    # Fused kernels: only GEGLU beat torch.compile's own code at every SD shape (kernels_h200_v3.json); in the UNet
    # step at batch 32 it gave 133.3 against 130.8 img/s, same run, no overlap of p20-p80, same memory
    # (sd15_geglu_kernel_b32_h200.json). GroupNorm+SiLU and LayerNorm stay with Inductor: the redesigned GroupNorm+SiLU
    # kernel beats compiled GroupNorm alone at 18 of 20 shape/direction cases (kernels_gn_h200_v5.json), yet in the step
    # at batch 8 it ran at 86.0 ms against 84.8 (sd15_gn_kernel_b8_h200.json), probably because Inductor fuses the
    # time-embedding add and the casts around its own norm, which an opaque custom op prevents (not profiled); a
    # second, cold-cache run gave 86.7 ms (sd15_gn_kernel_precompile_b8_h200.json).
    # Compilation, cold caches, the whole recipe at batch 8 (sd15_accelerated_compile_scope_b8_h200.json): with
    # torch.compile of the whole UNet the warm-up takes 134 s and the step 100.8 ms (p20-p80 94.6-111.5). Compiling
    # the 38 repeated blocks in place (19 distinct graphs), each replayed as CUDA graphs (the batch-8 step is
    # host-bound: 141 ms without them, compile_time_b8_cudagraphs_h200.json), precompiled by 8 processes that start
    # with the run: 43.0 s of precompilation + 15.7 s of warm-up, then 85.0 ms (84.8-85.4), 1.19x. Since then the
    # run loads each graph as it lands (precompile_overlap) and the workers skip cuDNN's autotuning: 34.9-49.1 s to
    # steady speed in three runs against 135.8 s for the whole UNet (122.3 ms/step) on one machine
    # (sd15_precompile_loading_h200/). On a CPU the blocks compile in the warm-up steps, without CUDA graphs.
    "text_to_image": {"cache_latents": True, "ema": "fused", "kernels": True, "kernel_ops": "geglu",
                      "compile_scope": "blocks"},
}


def _runs_on_gpu(base: RunConfig) -> bool:
    return resolve_device(base.device, visible_cuda_devices()) == "cuda"


def _precompile_workers() -> int:
    """Half the cores, at most 8 (on 16 cores, 8 workers precompiled SD's blocks in 60 s, 4 in 67 s); 0 (compile in
    the warm-up steps) where there are too few cores for parallel compilation to pay."""
    workers = min(8, (os.cpu_count() or 1) // 2)
    return workers if workers >= 2 else 0


def _ema_mode(base: RunConfig, mode: str) -> str:
    """``mode`` when the profile keeps an EMA, else ``off``."""
    return "off" if base.ema == "off" else mode


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


def recipe_config(base: RunConfig, recipe: str, overrides: dict[str, Any]) -> RunConfig:
    """Recipe ``recipe`` with explicit ``overrides`` on top, named after both (``baseline+amp_level=O2+compile``)
    so an overridden run never writes over the plain recipe's results."""
    cfg = apply_recipe(recipe, base)
    if overrides:
        label = "+".join(f"{k}={v}" if not isinstance(v, bool) else (k if v else f"no-{k}")
                         for k, v in overrides.items())
        cfg = cfg.replace(recipe=f"{recipe}+{label}", **overrides)
    return cfg
