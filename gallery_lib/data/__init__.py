"""Datasets and loaders of the gallery: robust class-folder images, caption folders, the endless loader every task
shares (``loader``) and the image-classification batches (``classification``). Names are imported on first use, so
a task imports only what it reads (a text-to-image run does not import timm's augmentation)."""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "CaptionFolder": "gallery_lib.data.captions",
    "caption_image_transform": "gallery_lib.data.captions",
    "RobustImageDataset": "gallery_lib.data.image_folder",
    "RobustImageFolder": "gallery_lib.data.image_folder",
    "load_rgb": "gallery_lib.data.image_folder",
    "TrainLoader": "gallery_lib.data.loader",
    "build_train_loader": "gallery_lib.data.classification",
    "smooth_one_hot": "gallery_lib.data.classification",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gallery_lib.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
