"""Image classification: class-folder images, timm augmentation and Mixup, soft-target cross-entropy."""

from __future__ import annotations

from typing import Any

import torch

from gallery_lib.config import RunConfig
from gallery_lib.distributed import DistInfo
from gallery_lib.precision import Precision


class ClassificationTask:
    def __init__(self, cfg: RunConfig, dist: DistInfo) -> None:
        from timm.loss import SoftTargetCrossEntropy

        from gallery_lib.data import RobustImageFolder, build_train_loader
        from gallery_lib.models import build_model

        self.cfg = cfg
        self.dataset = RobustImageFolder(cfg.data_dir, split="train")
        self.loader = build_train_loader(
            self.dataset, batch_size=cfg.batch_size, image_size=cfg.image_size, device=dist.device,
            num_workers=cfg.num_workers, seed=cfg.seed, world_size=dist.world_size, rank=dist.rank,
            auto_augment=cfg.auto_augment, re_prob=cfg.re_prob, mixup_alpha=cfg.mixup_alpha,
            cutmix_alpha=cfg.cutmix_alpha, label_smoothing=cfg.label_smoothing, channels_last=cfg.channels_last)
        self.model = build_model(cfg.model, num_classes=self.dataset.num_classes, image_size=cfg.image_size,
                                 pretrained_file=cfg.pretrained).to(dist.device)
        self.criterion = SoftTargetCrossEntropy()

    def loss(self, module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
             precision: Precision) -> torch.Tensor:
        images, targets = batch
        with precision.autocast():
            output = module(images)
        return self.criterion(output.float(), targets)

    def describe(self) -> str:
        return f"{len(self.dataset)} images, {self.dataset.num_classes} classes"

    def train_flops_per_sample(self) -> float | None:
        from gallery_lib.flops import train_flops_per_sample
        from gallery_lib.models import build_model

        size = self.cfg.image_size
        return train_flops_per_sample(
            lambda: build_model(self.cfg.model, num_classes=self.dataset.num_classes, image_size=size),
            lambda model: model(torch.randn(1, 3, size, size)).float().sum())

    def summary(self) -> dict[str, Any]:
        return {}

    def export(self, run_dir, ema) -> str | None:
        return None  # classifiers keep their checkpoints; there is no pipeline to assemble
