"""Image classification: class-folder images, timm augmentation and Mixup, soft-target cross-entropy."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gallery_lib.data.device_decode import PIPELINES
from gallery_lib.config.sections import Data, Job
from gallery_lib.config.sections.training import Training as TrainingSettings
from gallery_lib.config.settings import ConfigError, setting

if TYPE_CHECKING:
    from gallery_lib.config.family import ModelFamily


@dataclass(frozen=True, kw_only=True)
class ClassificationOptions:
    """The settings of classification runs (augmentation, targets, the loss)."""

    auto_augment: str | None = setting(None, kind=str, optional=True)
    """timm auto-augment policy, e.g. ``rand-m9-mstd0.5-inc1`` (the Swin reference)."""
    re_prob: float = setting(0.0, kind=float, minimum=0, below=1)
    """Random-erasing probability."""
    color_jitter: float = setting(0.4, kind=float, minimum=0, hint="0 disables it")
    """Colour-jitter strength when there is no ``auto_augment`` (timm's default 0.4)."""
    image_pipeline: str = setting("cpu", choices=PIPELINES)
    """``cpu``: timm's transforms in the DataLoader workers. ``gpu_augment``: the workers only decode, the GPU crops,
    resizes and flips the batch; ``gpu_decode``: the GPU decodes it too (``gallery_lib.data.device_decode``). Without
    a CUDA device a run uses ``cpu``."""
    mixup_alpha: float = setting(0.8, kind=float, minimum=0, hint="0 disables it")
    """Mixup alpha (0 disables)."""
    cutmix_alpha: float = setting(1.0, kind=float, minimum=0, hint="0 disables it")
    """CutMix alpha (0 disables)."""
    label_smoothing: float = setting(0.1, kind=float, minimum=0, below=1)
    """Label smoothing applied to the (mixed) targets."""
    fused_loss: bool = setting(False, kind=bool)
    """Soft-target cross-entropy through ``gallery_lib.accel.kernels.soft_cross_entropy`` (one Triton kernel forward
    and one backward on a GPU) instead of timm's ``SoftTargetCrossEntropy``; in no recipe
    (benchmarks/RESULTS.md#kernels)."""

    resume_fields = ()
    """Settings a resumed run must share with its checkpoint (beside the run's own)."""

    @property
    def uses_mixup(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def for_device(self, device_type: str) -> ClassificationOptions:
        """These settings as a run on ``device_type`` applies them: without a GPU, the CPU image pipeline."""
        return self if device_type == "cuda" else dataclasses.replace(self, image_pipeline="cpu")

    def check(self, *, training: TrainingSettings) -> None:
        """The rules that tie these settings to the run's ``training`` settings (Mixup's even batch) and to each
        other."""
        check_mixup_batch(training.batch_size, self.mixup_alpha, self.cutmix_alpha)
        if self.image_pipeline != "cpu" and (self.auto_augment or self.color_jitter):
            raise ConfigError(f"image_pipeline={self.image_pipeline!r} crops and flips on the GPU, but auto_augment "
                              "and color_jitter are CPU transforms: set auto_augment=None and color_jitter=0, or "
                              "image_pipeline='cpu'.")


def check_mixup_batch(batch_size: int, mixup_alpha: float, cutmix_alpha: float) -> None:
    """Mixup and CutMix pair each image with its mirror in the batch: the batch must be even."""
    if (mixup_alpha > 0 or cutmix_alpha > 0) and batch_size % 2:
        raise ConfigError(f"batch_size={batch_size} is invalid with Mixup/CutMix, which pair images within a batch: "
                          "use an even batch size, or set mixup_alpha=0 and cutmix_alpha=0.")


class ClassificationTask:
    name = "classification"
    options = ClassificationOptions

    def __init__(self, dist, precision, *, family: ModelFamily, job: Job, data: Data, options: ClassificationOptions,
                 batch_size: int, channels_last: bool, pretrained: str | None) -> None:
        """The classifier ``job.model`` of ``family`` (from the ``pretrained`` weights, when given) and its loader of
        the ``data`` section's class folders, augmented as the task's ``options`` say, in batches of ``batch_size``
        (channels-last with ``channels_last``)."""
        from gallery_lib.data import RobustImageFolder, build_train_loader

        self.family, self.job, self.data, self.precision = family, job, data, precision
        self.settings = options
        """The run's task settings (an instance of ``options``)."""
        self.batch_size, self.channels_last = batch_size, channels_last
        self.dataset = RobustImageFolder(data.data_dir, split="train")
        self.pipeline = options.for_device(dist.device.type).image_pipeline
        self.loader = build_train_loader(
            self.dataset, batch_size=batch_size, image_size=data.image_size, device=dist.device,
            num_workers=data.num_workers, seed=job.seed, world_size=dist.world_size, rank=dist.rank,
            auto_augment=options.auto_augment, re_prob=options.re_prob, mixup_alpha=options.mixup_alpha,
            cutmix_alpha=options.cutmix_alpha, label_smoothing=options.label_smoothing,
            color_jitter=options.color_jitter, channels_last=channels_last, pipeline=self.pipeline)
        self.model = family.build(job.model, num_classes=self.dataset.num_classes, image_size=data.image_size,
                                  pretrained_file=pretrained).to(dist.device)
        self.criterion = _fused_soft_cross_entropy if options.fused_loss else _timm_soft_cross_entropy()

    @staticmethod
    def check_data(*, model: str, data_dir: str, options: ClassificationOptions) -> None:
        """Refuses, before launch, a missing ``data_dir`` (``FileNotFoundError``) or one that is not class folders
        (``train/<class>/<image>``; ``ConfigError``), saying how to prepare ``model``'s data. The task's ``options``
        do not change what a classifier's data looks like."""
        train = Path(data_dir, "train")
        if not train.is_dir():
            raise FileNotFoundError(f"no training data at {train}: prepare mock data there with `gallery prepare "
                                    f"--model {model} --data-dir {shlex.quote(str(data_dir))}`, or pass --data-dir a "
                                    "folder with train/<class>/<images>.")
        if not any(child.is_dir() and not child.name.startswith(".") for child in train.iterdir()):
            kind = " (it looks like a caption folder, for Stable Diffusion)" if (train / "metadata.jsonl").is_file() \
                else ""
            raise ConfigError(f"{train} holds no class folders{kind}: {model} trains on train/<class>/<images>; "
                              f"prepare its data with `gallery prepare --model {model}`.")

    def loss(self, module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], precision) -> torch.Tensor:
        images, targets = batch
        with precision.autocast():
            output = module(images)
        return self.criterion(output.float(), targets)

    def describe(self) -> str:
        asked = self.settings.image_pipeline
        pipeline = self.pipeline + (f" ({asked} asked for; there is no CUDA device)" if asked != self.pipeline else "")
        return f"{len(self.dataset)} images, {self.dataset.num_classes} classes, image pipeline {pipeline}"

    def train_flops_per_sample(self) -> float | None:
        from gallery_lib.models.flops import train_flops_per_sample

        size = self.data.image_size
        return train_flops_per_sample(
            lambda: self.family.build(self.job.model, num_classes=self.dataset.num_classes, image_size=size),
            lambda model: model(torch.randn(1, 3, size, size)).float().sum())

    def summary(self) -> dict[str, Any]:
        return {}

    def export(self, run_dir, model: torch.nn.Module) -> str | None:
        """Saves the trained weights (the EMA's when the run keeps one) as ``<run_dir>/model.pt``, a plain state dict
        (``--pretrained`` takes it for the timm models, through timm's checkpoint loader); returns the path."""
        path = Path(run_dir) / "model.pt"
        plain = getattr(model, "_orig_mod", model)  # a model compiled whole saves its own module's keys
        torch.save({name: tensor.detach().cpu() for name, tensor in plain.state_dict().items()}, path)
        return str(path)

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        """Top-1 accuracy and loss on the ``val`` split (timm's eval transform: resize, centre crop), with the run's
        autocast; nothing when the data has no ``val`` split."""
        from gallery_lib.data.classification import validation_loader

        loader = validation_loader(self.data.data_dir, image_size=self.data.image_size, batch_size=self.batch_size,
                                   channels_last=self.channels_last)
        if loader is None:
            return {}
        device = next(model.parameters()).device
        was_training, correct, seen, loss_sum = model.training, 0, 0, 0.0
        model.eval()
        with torch.no_grad(), self.precision.autocast():
            for images, labels in loader:
                images, labels = images.to(device), labels.to(device)
                logits = model(images).float()
                loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
                correct += (logits.argmax(1) == labels).sum().item()
                seen += labels.numel()
        model.train(was_training)
        return {"val_top1": correct / seen, "val_loss": loss_sum / seen, "val_images": seen} if seen else {}


def _timm_soft_cross_entropy():
    from timm.loss import SoftTargetCrossEntropy

    return SoftTargetCrossEntropy()


def _fused_soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from gallery_lib.accel.kernels import soft_cross_entropy

    return soft_cross_entropy(logits, targets)
