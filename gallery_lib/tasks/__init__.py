"""Tasks: what a model family trains on and how its loss is computed.

The loop in ``train.py`` is the same for every model; a task supplies the four things that differ:

- ``model``: the module that is trained (accelerations, the optimizer and the EMA apply to it);
- ``loader``: an endless, resumable iterator of device batches (``gallery_lib.data.loader.TrainLoader``);
- ``dataset``: the data source, which counts and judges unreadable samples (``skipped``, ``check_bad_fraction``);
- ``loss(module, batch, precision)``: one forward pass and the scalar loss, run by the loop before ``backward``.

Plus ``describe()`` for the log's first line, ``train_flops_per_sample()`` for MFU, ``summary()`` for task-specific numbers in the run summary (e.g. the
latent-cache time) and ``export(run_dir, ema)`` to save the trained model at the end.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gallery_lib.config import RunConfig
from gallery_lib.distributed import DistInfo
from gallery_lib.precision import Precision


class Task(Protocol):
    model: torch.nn.Module
    loader: Any
    dataset: Any

    def loss(self, module: torch.nn.Module, batch: Any, precision: Precision) -> torch.Tensor: ...

    def describe(self) -> str: ...

    def summary(self) -> dict[str, Any]: ...

    def train_flops_per_sample(self) -> float | None: ...

    def export(self, run_dir, ema) -> str | None: ...


def build_task(cfg: RunConfig, dist: DistInfo, precision: Precision) -> Task:
    """The task of ``cfg.model`` with its data and (plain, unaccelerated) model on ``dist.device``."""
    if cfg.task == "text_to_image":
        from gallery_lib.tasks.text_to_image import TextToImageTask

        return TextToImageTask(cfg, dist, precision)
    from gallery_lib.tasks.classification import ClassificationTask

    return ClassificationTask(cfg, dist)
