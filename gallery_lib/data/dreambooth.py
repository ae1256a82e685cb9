"""DreamBooth's data: a folder of subject pictures paired with a folder of class pictures, as diffusers pairs them.

diffusers' ``DreamBoothDataset`` has ``max(instances, class images)`` examples; example ``k`` holds instance picture
``k mod instances`` and, with prior preservation, class picture ``k mod class images``, and a batch is the instance
half followed by the class half. ``DreamBoothPairs`` yields ``(instance image, class image, k)`` (uint8 tensors;
without a class folder the class image is an empty tensor) for ``gallery_lib.data.loader.sampled_loader``.
Unreadable files are skipped and counted by ``ImageFiles`` (the machinery of ``RobustImageDataset``).
"""

from __future__ import annotations

import os
import pathlib
from typing import Callable

import torch

from gallery_lib.data.image_folder import IMAGE_EXTENSIONS, RobustImageDataset


class ImageFiles(RobustImageDataset):
    """The images directly in ``folder`` (sorted by name; the first ``limit`` of them when given), transformed."""

    _prepare_hint = "run `gallery prepare --model dreambooth_tiny` or point the option at a folder of images"

    def __init__(self, folder: str | os.PathLike, transform: Callable | None, limit: int | None = None) -> None:
        folder = pathlib.Path(folder)
        super().__init__(folder.parent, folder.name, transform)
        self.folder = folder
        self.files = sorted(image_files(folder))[:limit]

    @property
    def _location(self) -> pathlib.Path:
        return self.folder

    def _image_path(self, i: int) -> pathlib.Path:
        return self.files[i]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        _, image = self._load_image(index)
        return self.transform(image) if self.transform else image


def image_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The image files directly in ``folder`` (by extension; hidden files left out)."""
    return [p for p in folder.iterdir()
            if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file()]


class DreamBoothPairs(torch.utils.data.Dataset):
    """Example ``k``: instance picture ``k mod len(instance)`` and class picture ``k mod len(class_images)``."""

    def __init__(self, instance: ImageFiles, class_images: ImageFiles | None) -> None:
        self.instance, self.class_images = instance, class_images
        self.parts = [d for d in (instance, class_images) if d is not None]

    def __len__(self) -> int:
        return max(len(d) for d in self.parts)

    def __getitem__(self, k: int):
        image = self.instance[k % len(self.instance)]
        other = self.class_images[k % len(self.class_images)] if self.class_images is not None else torch.empty(0)
        return image, other, k

    @property
    def skipped(self) -> int:
        return sum(d.skipped for d in self.parts)

    def check_bad_fraction(self, max_fraction: float) -> None:
        for d in self.parts:
            d.check_bad_fraction(max_fraction)
