"""A caption dataset in the HF imagefolder layout (``metadata.jsonl``) that survives bad files, for text-to-image runs.

``root/<split>/metadata.jsonl`` lists one JSON object per line, with the image path (relative to the folder of
``metadata.jsonl``) and its caption: the layout of diffusers' ``train_text_to_image.py --train_data_dir`` and of
``datasets.load_dataset("imagefolder")``, written by ``data_prep.make_caption_folder``. Config errors (no folder,
no metadata, a broken line, a missing column, nothing listed) fail at construction and name the line; a listed image
that is missing or cannot be decoded is a bad sample, logged, counted and replaced by the next index exactly as in
``RobustImageFolder`` (the machinery is shared: ``RobustImageDataset``).

``caption_image_transform`` is diffusers' training preprocessing up to the uint8 tensor; the device side converts to
float in [-1, 1].
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from typing import Any, Callable

from torchvision import transforms

from gallery_lib.data.image_folder import RobustImageDataset

METADATA = "metadata.jsonl"
_PREPARE_HINT = "run `gallery prepare --model sd_tiny` or point data_dir at an imagefolder with metadata.jsonl"


class CaptionFolder(RobustImageDataset):
    """Captioned images returning ``(transform(rgb_image), {"text": caption, "index": i})``.

    ``i`` is the index of the sample actually loaded: that of the next readable one when ``index`` is a bad file.
    A caption is a string (an empty one is the unconditional caption) or a non-empty list of strings, of which each
    load picks one with ``random.choice`` (seed ``random`` per sample for reproducible picks).

    Args:
        root: Dataset root. ``metadata.jsonl`` is looked up in ``root/<split>/``; when that folder does not exist, in
            ``root/`` itself (images sitting directly in the root).
        split: Split folder name, e.g. ``"train"``.
        transform: Applied to the RGB PIL image; ``None`` returns the PIL image itself.
        image_column: Metadata key holding the image path relative to the folder of ``metadata.jsonl``.
        caption_column: Metadata key holding the caption.
        max_consecutive_errors: Unreadable samples tolerated in a row before a RuntimeError.
    """

    _prepare_hint = _PREPARE_HINT
    _bad_files_note = f" (or their lines in {METADATA})"

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "train",
        transform: Callable | None = None,
        *,
        image_column: str = "file_name",
        caption_column: str = "text",
        max_consecutive_errors: int = 50,
    ) -> None:
        super().__init__(root, split, transform, max_consecutive_errors)
        self.image_column = image_column
        self.caption_column = caption_column
        self.folder = find_caption_folder(self.root, split)
        self.paths, self.captions = _read_metadata(self.folder / METADATA, image_column, caption_column)

    @property
    def _location(self) -> pathlib.Path:
        return self.folder

    def _image_path(self, i: int) -> pathlib.Path:
        return self.paths[i]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, dict[str, Any]]:
        i, img = self._load_image(index)
        caption = self.captions[i]
        if isinstance(caption, list):
            caption = random.choice(caption)
        return (self.transform(img) if self.transform is not None else img), {"text": caption, "index": i}


def caption_image_transform(resolution: int, *, center_crop: bool = True,
                            random_flip: bool = False) -> transforms.Compose:
    """diffusers ``train_text_to_image`` preprocessing up to float conversion: RGB PIL image -> uint8 CHW tensor.

    Resize of the short side to ``resolution`` (bilinear), centre or random square crop, optional horizontal flip.
    """
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ValueError(f"resolution must be a positive integer, got {resolution!r}")
    steps: list[Callable] = [
        transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(resolution) if center_crop else transforms.RandomCrop(resolution),
    ]
    if random_flip:
        steps.append(transforms.RandomHorizontalFlip())
    steps.append(transforms.PILToTensor())
    return transforms.Compose(steps)


def find_caption_folder(root: pathlib.Path, split: str) -> pathlib.Path:
    """The folder holding ``metadata.jsonl`` and the images: ``root/split`` or ``root``; FileNotFoundError saying
    what is missing otherwise."""
    if not root.is_dir():
        raise FileNotFoundError(f"Caption dataset root {root} does not exist: {_PREPARE_HINT}.")
    folder = root / split
    if folder.is_dir():
        if not (folder / METADATA).is_file():
            raise FileNotFoundError(
                f"{folder / METADATA} does not exist: the caption folder needs one JSON line per image, e.g. "
                f'{{"file_name": "0001.png", "text": "a red circle"}}; {_PREPARE_HINT}.')
        return folder
    if (root / METADATA).is_file():
        return root
    raise FileNotFoundError(f"Neither {folder / METADATA} nor {root / METADATA} exists (expected "
                            f"{root}/{split}/metadata.jsonl beside the images): {_PREPARE_HINT}.")


def _read_metadata(path: pathlib.Path, image_column: str,
                   caption_column: str) -> tuple[list[pathlib.Path], list[str | list[str]]]:
    """Image paths and captions listed in ``path``; any malformed line is an error naming its number."""
    paths: list[pathlib.Path] = []
    captions: list[str | list[str]] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where} is not valid JSON ({exc}): each line must be one JSON object such as "
                                 f'{{"{image_column}": "0001.png", "{caption_column}": "a red circle"}}.') from exc
            if not isinstance(row, dict):
                raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object with "
                                 f"{image_column!r} and {caption_column!r}.")
            missing = [c for c in (image_column, caption_column) if c not in row]
            if missing:
                raise ValueError(f"{where} lacks the column(s) {missing}; it has {sorted(row)}. Fix the file or pass "
                                 "image_column= / caption_column= naming the right keys.")
            file_name, caption = row[image_column], row[caption_column]
            if not isinstance(file_name, str) or not file_name or pathlib.PurePath(file_name).is_absolute():
                raise ValueError(f"{where}: {image_column!r} must be a non-empty path relative to {path.parent}, "
                                 f"got {file_name!r}.")
            if not _is_caption(caption):
                raise ValueError(f"{where}: {caption_column!r} must be a string or a non-empty list of strings, "
                                 f"got {caption!r}.")
            paths.append(path.parent / file_name)
            captions.append(caption)
    if not paths:
        raise ValueError(f"{path} lists no images: {_PREPARE_HINT}.")
    return paths, captions


def _is_caption(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, list) and len(value) > 0 and all(isinstance(v, str) for v in value)

