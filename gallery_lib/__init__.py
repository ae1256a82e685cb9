"""gallery_lib: the support package of the accelerated-training notebook gallery.

The notebooks stay thin; this package holds the run configuration, the recipes, the model families, the data
pipeline, the training loop, the launcher and the reports, in layers (``docs/DESIGN.md``). What a notebook calls is
importable from here: ``base_config``, ``prepare``, ``run_recipes``, ``compare``, ``summarize`` (and
``optimize(model)`` for a plain PyTorch loop). Names are imported on first use, so ``import gallery_lib`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "base_config": "gallery_lib.recipes.profiles",
    "prepare": "gallery_lib.app.workflow",
    "run_recipes": "gallery_lib.app.workflow",
    "compare": "gallery_lib.app.workflow",
    "summarize": "gallery_lib.app.workflow",
    "model_step_config": "gallery_lib.app.workflow",
    "config_controls": "gallery_lib.reports.widgets",
    "notebook_recipes": "gallery_lib.recipes.named",
    "dataset_preview": "gallery_lib.reports.sampling",
    "dreambooth_preview": "gallery_lib.reports.sampling",
    "load_pipeline": "gallery_lib.reports.sampling",
    "sample_grid": "gallery_lib.reports.sampling",
    "compare_samples": "gallery_lib.reports.sampling",
    "RunConfig": "gallery_lib.config",
    "register_family": "gallery_lib.families",
    "optimize": "gallery_lib.accel.optimize",
    "accelerate": "gallery_lib.accel.on_any_model",
    "add_ema": "gallery_lib.accel.on_any_model",
    "AdamWWithEma": "gallery_lib.accel.adamw_ema",
    "use_channels_last": "gallery_lib.accel.on_any_model",
    "fuse_kernels": "gallery_lib.accel.on_any_model",
    "fuse_attention": "gallery_lib.accel.on_any_model",
    "compile_blocks": "gallery_lib.accel.on_any_model",
    "compile_whole": "gallery_lib.accel.on_any_model",
    "compile_channels_last_graphs": "gallery_lib.accel.on_any_model",
    "pipeline_throughput": "gallery_lib.data.throughput",
    "recipe_table": "gallery_lib.reports.recipe_table",
    "run_ladder": "gallery_lib.recipes.ladder",
    "default_sizes": "gallery_lib.recipes.ladder",
    "ladder_base": "gallery_lib.recipes.ladder",
    "ladder_plan": "gallery_lib.reports.ladder",
    "ladder_report": "gallery_lib.reports.ladder",
    "StepLadder": "gallery_lib.reports.step_ladder",
    "StepTimer": "gallery_lib.run.timing",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gallery_lib' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
