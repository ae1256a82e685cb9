"""What each recipe will run on this machine, read from its resolved config (not from a fixed description).

A recipe resolves differently on a CPU and on a GPU (float16 with a GradScaler or bfloat16, CUDA graphs or not, the
GPU image pipeline or the CPU one), so a notebook shows this table before its runs start.
"""

from __future__ import annotations

from typing import Any, Sequence

from gallery_lib.config import RunConfig, resolve_device, visible_cuda_devices

_COLUMNS = ("recipe", "precision", "compiled", "optimizer", "EMA", "family switches")


class RecipeTable:
    """Rows of ``_COLUMNS``; shows as a Markdown table in a notebook."""

    def __init__(self, rows: list[dict[str, str]], device: str) -> None:
        self.rows, self.device = rows, device

    def _repr_markdown_(self) -> str:
        lines = [f"What each recipe runs on this machine ({self.device}):", "",
                 "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        lines += ["| " + " | ".join(row[c] for c in _COLUMNS) + " |" for row in self.rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._repr_markdown_()


def recipe_table(base: RunConfig, recipes: Sequence[Any]) -> RecipeTable:
    """The resolved settings of each recipe (a name, or ``(name, overrides)``) on top of ``base``."""
    from gallery_lib.recipes import recipe_config

    device = resolve_device(base.device, visible_cuda_devices())
    rows = []
    for spec in recipes:
        name, overrides = (spec, {}) if isinstance(spec, str) else spec
        cfg = recipe_config(base, name, overrides)
        rows.append({"recipe": cfg.recipe, "precision": _precision(cfg, device), "compiled": _compiled(cfg, device),
                     "optimizer": _optimizer(cfg, device),
                     "EMA": _ema(cfg, device), "family switches": _family_switches(cfg, device)})
    return RecipeTable(rows, "a GPU" if device == "cuda" else "a CPU")


def _optimizer(cfg: RunConfig, device: str) -> str:
    from gallery_lib.accel.clipping import run_folds
    from gallery_lib.accel.precision import resolve_amp_dtype

    name = ("fused " if cfg.fused_optimizer else "") + cfg.optimizer
    folds = run_folds(cfg.sections.optimizer, data_parallel=cfg.data_parallel,
                      amp_dtype=resolve_amp_dtype(cfg.sections.precision, device))
    return name + (", clipping in its pass" if folds else "")


def _precision(cfg: RunConfig, device: str) -> str:
    from gallery_lib.accel.precision import resolve_amp_dtype

    dtype = resolve_amp_dtype(cfg.sections.precision, device)
    if dtype is None:
        return "float32"
    name = str(dtype).removeprefix("torch.")
    if cfg.amp_level == "O2":
        return f"{name} weights, float32 master copies"
    return f"{name} autocast" + (" + GradScaler" if name == "float16" else "")


def _compiled(cfg: RunConfig, device: str) -> str:
    if not cfg.compile:
        return "no (eager)"
    scope = "repeated blocks" if cfg.compile_scope == "blocks" else "whole model"
    scope += "".join(f", {name} whole" for name in cfg.compile_whole_types)
    # CUDA graphs replay on a GPU only: on a CPU the mode compiles without them
    graphs = ", CUDA graphs" if cfg.cuda_graphs and device == "cuda" else ""
    return f"{scope}, mode {cfg.resolved_compile_mode}{graphs}"


def _ema(cfg: RunConfig, device: str) -> str:
    from gallery_lib.accel.ema import ema_mode_on

    if cfg.ema == "off":
        return "none"
    if cfg.ema_offload:
        effective = ema_mode_on(cfg.ema, device, offloaded=True)[0]
        through = ", streamed through the GPU in chunks" if effective == "stream" else ""
        return f"{effective}, in the CPU's memory between updates{through}"
    effective, why = ema_mode_on(cfg.ema, device)
    return cfg.ema if why is None else f"{effective} ({cfg.ema} needs a GPU)"


def _family_switches(cfg: RunConfig, device: str) -> str:
    """The switches the family's ``accelerated`` recipe turns, as this recipe runs them on ``device`` (task settings
    through the options' ``for_device`` where they have one)."""
    family = cfg.model_family
    for_device = getattr(cfg.options, "for_device", None)
    options = for_device(device) if for_device is not None else cfg.options
    values = []
    for name in {**family.accelerated, **family.accelerated_on_gpu}:
        if name in ("compile_scope", "compile_whole", "compile_mode", "ema", "amp_dtype") or (
                name in ("kernels", "kernel_ops") and not cfg.kernels):
            continue  # in their own columns; kernels off (a CPU run of a GPU-only switch) say nothing
        value = (getattr(options, name) if hasattr(options, name)
                 else cfg.resolved_kernel_ops if name == "kernel_ops" else getattr(cfg, name))
        values.append(f"{name}={value}")
    return ", ".join(values) or "-"
