"""Tasks: what a model family trains on and how its loss is computed.

The loop in ``train.py`` is the same for every model; a task supplies the four things that differ:

- ``model``: the module that is trained (accelerations, the optimizer and the EMA apply to it);
- ``loader``: an endless, resumable iterator of device batches (``gallery_lib.data.loader.TrainLoader``), whose
  ``close()`` the loop calls as the run ends;
- ``dataset``: the data source, which counts and judges unreadable samples (``skipped``, ``check_bad_fraction``);
- ``loss(module, batch, precision)``: one forward pass and the scalar loss, run by the loop before ``backward``.

A task is built from the parts of the run's config it reads (``build_task`` unpacks them): the model's family (its
``build``), the ``job`` section (the model's name, the seed), the ``data`` section, the task's own settings
(``options``, an instance of the task's ``options`` dataclass), the batch size per process, whether images are
channels-last and the weights it starts from (``pretrained``). A task may also declare a static
``check_data(model=, data_dir=, options=)``, which the launcher runs before anything starts, refusing data of the
wrong kind.

Plus ``describe()`` for the log's first line, ``train_flops_per_sample()`` for MFU, ``summary()`` for task-specific
numbers in the run summary (e.g. the latent-cache time), ``export(run_dir, model)`` to save the trained model at the
end and ``evaluate(model)`` for what it scores on held-out data (an empty dict where the task has none): ``model`` is
the trained one (the EMA of the weights when the run keeps one), a plain module on the CPU or the device (a ZeRO-2 run
gathers its shards into one first), given on rank 0 only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from gallery_lib.config.sections import Data, Job

if TYPE_CHECKING:
    from gallery_lib.config import RunConfig
    from gallery_lib.config.family import ModelFamily


class Task(Protocol):
    name: ClassVar[str]
    """What the model learns, e.g. ``classification``."""
    options: ClassVar[type]
    """The frozen dataclass of the task's own settings (``cfg.options``), declared with ``gallery_lib.config.settings``;
    its ``check(training=)`` holds the rules that tie them to the run's training settings, ``resume_fields`` those a
    resumed run must share with its checkpoint."""
    model: torch.nn.Module
    loader: Any
    dataset: Any

    def __init__(self, dist, precision, *, family: ModelFamily, job: Job, data: Data, options: Any, batch_size: int,
                 channels_last: bool, pretrained: str | None) -> None: ...

    def loss(self, module: torch.nn.Module, batch: Any, precision) -> torch.Tensor: ...

    def describe(self) -> str: ...

    def summary(self) -> dict[str, Any]: ...

    def train_flops_per_sample(self) -> float | None: ...

    def export(self, run_dir, model: torch.nn.Module) -> str | None: ...

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]: ...


def build_task(cfg: RunConfig, dist, precision) -> Task:
    """The task of ``cfg.model``'s family with its data and (plain, unaccelerated) model on ``dist.device``, given the
    parts of ``cfg`` it reads."""
    return cfg.model_family.task(dist, precision, family=cfg.model_family, job=cfg.sections.job,
                                 data=cfg.sections.data, options=cfg.options, batch_size=cfg.batch_size,
                                 channels_last=cfg.channels_last, pretrained=cfg.pretrained)
