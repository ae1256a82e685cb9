"""An ImageNet-style class-folder dataset that survives bad files and odd image modes.

``root/<split>/<class>/<image>``: class folders in sorted order are the labels (the timm / torchvision convention).
Each sample is fully decoded inside a guarded block (PIL decodes lazily, so a truncated JPEG only fails at
``load()``), EXIF-rotated, and brought to 8-bit RGB. A file that cannot be read is logged, counted and replaced by
the next index, the way timm's ``ImageDataset`` does it; too many failures in a row stop the run with an error,
and so does ``check_bad_fraction`` once too large a share of all loads has failed.

The skip and load counts live in shared memory, so the main process sees those of all DataLoader workers.
``RobustImageDataset`` holds that machinery for every dataset of image files (the caption folder uses it too).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
from typing import IO, Callable

import numpy as np
import torch.utils.data
from PIL import Image, ImageOps

_logger = logging.getLogger(__name__)

# Extensions of the formats PIL can open (registered_extensions() also lists save-only ones such as .pdf).
IMAGE_EXTENSIONS = frozenset(ext.lower() for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)
_RECENT_SKIPS = 64  # how many skipped sample indices are kept for `skipped_paths`
MIN_LOADS_FOR_FRACTION = 50  # loads before check_bad_fraction judges: one bad file among the first few is no trend
_PREPARE_HINT = "run `gallery prepare --model ...` or pass --data-dir to an ImageNet-style folder"


class RobustImageDataset(torch.utils.data.Dataset):
    """Base of the image datasets that skip unreadable files: the skip / load counters and the replacement rule.

    A subclass lists its samples, says where sample ``i`` lives (``_image_path``) and where the dataset is
    (``_location``, for messages), and calls ``_load_image(index)`` in its ``__getitem__``: that returns the index
    actually loaded and its RGB image, replacing a bad file by the next index.

    Args:
        root: Dataset folder.
        split: Split folder under ``root`` (``train``, ``val``).
        transform: Applied to each loaded image (``None``: the PIL image).
        max_consecutive_errors: Unreadable samples tolerated in a row before a RuntimeError.
    """

    _prepare_hint = _PREPARE_HINT  # how to get a good dataset, quoted in the errors
    _bad_files_note = ""  # appended to "remove the bad files" in the errors

    def __init__(self, root: str | os.PathLike, split: str, transform: Callable | None,
                 max_consecutive_errors: int = 50) -> None:
        self.root = pathlib.Path(root)
        self.split = split
        self.transform = transform
        if max_consecutive_errors < 1:
            raise ValueError(f"max_consecutive_errors must be >= 1, got {max_consecutive_errors}")
        self.max_consecutive_errors = max_consecutive_errors
        # Shared memory, inherited by forked DataLoader workers or pickled into spawned / forkserver ones. Built from
        # the spawn context because a fork-context lock refuses to be pickled into a spawned worker.
        ctx = multiprocessing.get_context("spawn")
        self._skipped = ctx.Value("q", 0)
        self._loads = ctx.Value("q", 0)
        self._recent = ctx.Array("q", _RECENT_SKIPS, lock=False)

    def _image_path(self, i: int) -> pathlib.Path:
        raise NotImplementedError

    @property
    def _location(self) -> pathlib.Path:
        raise NotImplementedError

    @property
    def skipped(self) -> int:
        """Failed sample loads so far, summed over this process and all worker processes."""
        return self._skipped.value

    @property
    def loads(self) -> int:
        """Sample loads attempted so far (successful or skipped), over this process and all worker processes."""
        return self._loads.value

    def check_bad_fraction(self, max_fraction: float, min_loads: int = MIN_LOADS_FOR_FRACTION) -> None:
        """Raises a RuntimeError when more than ``max_fraction`` of the loads so far failed (after ``min_loads``)."""
        loads, skipped = self.loads, self.skipped
        if loads >= min_loads and skipped > max_fraction * loads:
            recent = "\n  ".join(str(p) for p in self.skipped_paths[-5:])
            raise RuntimeError(
                f"{skipped} of {loads} image loads from {self._location} failed ({skipped / loads:.1%}), more "
                f"than max_bad_fraction={max_fraction:g}; the last bad files:\n  {recent}\nEvery skipped file is "
                f"logged with its reason. Remove or re-encode the bad files{self._bad_files_note}, re-create the "
                f"dataset ({self._prepare_hint}), or raise max_bad_fraction if this share of bad files is expected.")

    @property
    def skipped_paths(self) -> list[pathlib.Path]:
        """Paths of the most recent skipped loads (at most 64, oldest first); the log has all of them."""
        with self._skipped.get_lock():
            n = self._skipped.value
            recent = [self._recent[k % _RECENT_SKIPS] for k in range(max(0, n - _RECENT_SKIPS), n)]
        return [self._image_path(i) for i in recent]

    def _load_image(self, index: int, load: Callable = None) -> tuple[int, Image.Image]:
        """``(i, load(path))`` of the first readable sample from ``index`` on (wrapping around); counts every try.
        ``load`` defaults to ``load_rgb`` (the RGB image); the device decoder's workers read bytes instead."""
        load = load or load_rgb
        n = len(self)
        failures: list[str] = []
        for attempt in range(min(self.max_consecutive_errors, n)):
            i = (index + attempt) % n
            path = self._image_path(i)
            with self._loads.get_lock():
                self._loads.value += 1
            try:
                return i, load(path)
            except Exception as exc:  # any decode error means "bad file", whatever the codec raises
                _logger.warning("Skipped sample %d (%s): %s", i, path, exc)
                self._count_skip(i)
                failures.append(f"{path}: {exc}")
        raise RuntimeError(
            f"{len(failures)} consecutive samples of {self._location} could not be read, the last ones:\n  "
            + "\n  ".join(failures[-5:])
            + f"\nThe dataset looks broken: re-create it ({self._prepare_hint}), or remove the bad files"
            + f"{self._bad_files_note}.")

    def _count_skip(self, i: int) -> None:
        with self._skipped.get_lock():
            self._recent[self._skipped.value % _RECENT_SKIPS] = i
            self._skipped.value += 1


class RobustImageFolder(RobustImageDataset):
    """Class-folder image dataset returning ``(transform(rgb_image), label)``.

    Args:
        root: Dataset root holding one folder per split.
        split: Split folder name, e.g. ``"train"`` or ``"val"``.
        transform: Applied to the RGB PIL image; ``None`` returns the PIL image itself.
        max_consecutive_errors: Unreadable samples tolerated in a row before a RuntimeError.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "train",
        transform: Callable | None = None,
        max_consecutive_errors: int = 50,
    ) -> None:
        super().__init__(root, split, transform, max_consecutive_errors)
        self.classes, self.samples = _scan(self.root, split)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def _location(self) -> pathlib.Path:
        return self.root / self.split

    def _image_path(self, i: int) -> pathlib.Path:
        return self.samples[i][0]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        i, img = self._load_image(index)
        return (self.transform(img) if self.transform is not None else img), self.samples[i][1]


def load_rgb(path: str | os.PathLike | IO[bytes]) -> Image.Image:
    """Decode an image file (a path, or a binary file object) completely and return it as upright 8-bit RGB.

    Transparency is composited on white; 16-bit and 32-bit integer greyscale is scaled to 8 bit (PIL's own
    conversion clips it, which turns most 16-bit images white).
    """
    with Image.open(path) as img:
        img.load()  # decode now, inside the caller's try: a truncated file raises here, not in the transform
        img = ImageOps.exif_transpose(img)
        return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        values = np.asarray(img, dtype=np.float64)
        # 16-bit data (the common case, PNG / TIFF) maps 65535 to 255; 'I' holding larger values is squashed
        # by its own maximum so nothing saturates.
        top = max(65535.0, float(values.max()))
        img = Image.fromarray(np.round(np.clip(values, 0, None) * (255.0 / top)).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _scan(root: pathlib.Path, split: str) -> tuple[list[str], list[tuple[pathlib.Path, int]]]:
    folder = root / split
    if not root.is_dir():
        raise FileNotFoundError(f"Dataset root {root} does not exist: {_PREPARE_HINT}.")
    if not folder.is_dir():
        raise FileNotFoundError(f"Split folder {folder} does not exist (expected {root}/{split}/<class>/<image>): "
                                f"{_PREPARE_HINT}.")
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    samples = []
    for label, name in enumerate(classes):
        found = sorted(_images_under(folder / name))
        if not found:
            _logger.warning("Class folder %s holds no images; its label %d will never be drawn", folder / name, label)
        samples.extend((path, label) for path in found)
    if not samples:
        raise FileNotFoundError(
            f"No images found in {folder} (expected {folder}/<class>/<image>, extensions PIL reads, e.g. .JPEG, "
            f".png): {_PREPARE_HINT}.")
    return classes, samples


def _images_under(folder: pathlib.Path):
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS:
                yield pathlib.Path(dirpath) / name
