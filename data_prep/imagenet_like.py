"""An ImageNet-like mock dataset: real JPEG files in the timm / torchvision class-folder layout.

``root/train/<class>/<name>.JPEG`` and ``root/val/<class>/<name>.JPEG``, class folders ``n0000``, ``n0001``, ...
whose sorted order is the label order. Each class has a visual signature (a class colour and a class shape drawn at
a random position and size on a noisy background), so a small model's loss falls within a few dozen steps.

The output is a pure function of the parameters: every image has its own random stream seeded from
``(seed, split, class, index)``, so the same parameters give byte-identical files (for a given Pillow / libjpeg
build). ``root/manifest.json`` records the
parameters and the files written; a second call with the same parameters returns at once, and a call with other
parameters removes only the files listed in the manifest before writing the new set.

Run from the shell::

    python -m data_prep.imagenet_like --root data/imagenet_like --num-classes 10 --train-per-class 32
"""

from __future__ import annotations

import argparse
import functools
import colorsys
import io
import os
import pathlib

import numpy as np
from PIL import Image, ImageDraw

from data_prep.manifest import check_int, one_writer, reuse_or_clear, write_dataset

_GENERATOR = "data_prep.imagenet_like"
_VERSION = 1  # bump when the pictures change, so old folders are regenerated
_SPLITS = ("train", "val")
_SHAPES = ("ellipse", "rectangle", "triangle", "diamond", "cross", "ring")
_JPEG_QUALITY = 90


@one_writer
def make_imagenet_like(
    root: str | os.PathLike,
    *,
    num_classes: int = 10,
    train_per_class: int = 32,
    val_per_class: int = 8,
    image_size: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> pathlib.Path:
    """Write (or reuse) an ImageNet-like mock dataset under ``root`` and return ``root`` as a Path.

    Args:
        root: Output folder. Created if missing. It must not already hold a ``train/`` or ``val/`` folder that this
            function did not write (no ``manifest.json``), so a real dataset is never mixed with mock images.
        num_classes: Number of classes (folders ``n0000`` ...).
        train_per_class: Training images per class.
        val_per_class: Validation images per class.
        image_size: Side of the square images in pixels, at least 16.
        seed: Seed of the whole dataset; the same seed and parameters give byte-identical files.
        progress: Show a tqdm progress bar (rate-limited so papermill logs stay short).
    """
    params = {
        "num_classes": check_int("num_classes", num_classes, 1),
        "train_per_class": check_int("train_per_class", train_per_class, 1),
        "val_per_class": check_int("val_per_class", val_per_class, 1),
        "image_size": check_int("image_size", image_size, 16),
        "seed": check_int("seed", seed, 0),
    }
    root = pathlib.Path(root)
    if reuse_or_clear(root, generator=_GENERATOR, version=_VERSION, params=params, splits=_SPLITS,
                      writer="make_imagenet_like"):
        return root

    files = [(rel, functools.partial(_render_jpeg, params, *key)) for rel, key in _plan(params)]
    return write_dataset(root, generator=_GENERATOR, version=_VERSION, params=params, files=files,
                         desc=f"imagenet-like -> {root}", progress=progress)


def class_names(num_classes: int) -> list[str]:
    """Folder names of the classes; zero-padded so that sorted order equals label order."""
    width = max(4, len(str(num_classes - 1)))
    return [f"n{c:0{width}d}" for c in range(num_classes)]




def _plan(params: dict[str, int]) -> list[tuple[str, tuple[int, int, int]]]:
    """(relative path, (split index, class, image index)) of every file, in writing order."""
    counts = {"train": params["train_per_class"], "val": params["val_per_class"]}
    plan = []
    for split_idx, split in enumerate(_SPLITS):
        for c, name in enumerate(class_names(params["num_classes"])):
            for i in range(counts[split]):
                plan.append((f"{split}/{name}/{name}_{split}_{i:05d}.JPEG", (split_idx, c, i)))
    return plan


def _class_signature(c: int) -> tuple[str, tuple[int, int, int]]:
    """The shape and RGB colour of class ``c``: hues spread by the golden ratio, shapes cycling."""
    hue = (c * 0.6180339887) % 1.0
    saturation = 0.95 if (c // len(_SHAPES)) % 2 == 0 else 0.6
    value = 0.95 if (c // (2 * len(_SHAPES))) % 2 == 0 else 0.7
    rgb = colorsys.hsv_to_rgb(hue, saturation, value)
    return _SHAPES[c % len(_SHAPES)], tuple(int(round(255 * x)) for x in rgb)


def _render_jpeg(params: dict[str, int], split_idx: int, c: int, i: int) -> bytes:
    size = params["image_size"]
    rng = np.random.default_rng((params["seed"], split_idx, c, i))
    # Noisy background of a random, low-saturation base colour: it carries no class information.
    base = rng.integers(40, 200) + rng.integers(-20, 21, size=3)
    noise = rng.integers(-24, 25, size=(size, size, 3), dtype=np.int16)
    pixels = np.clip(base.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")

    shape, colour = _class_signature(c)
    colour = tuple(int(np.clip(v + rng.integers(-15, 16), 0, 255)) for v in colour)
    side = rng.uniform(0.3, 0.6) * size
    x0 = rng.uniform(0, size - side)
    y0 = rng.uniform(0, size - side)
    _draw_shape(ImageDraw.Draw(img), shape, (x0, y0, x0 + side, y0 + side), colour)

    out = io.BytesIO()
    img.save(out, format="JPEG", quality=_JPEG_QUALITY)
    return out.getvalue()


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float],
                colour: tuple[int, ...]) -> None:
    x0, y0, x1, y1 = box
    cx, cy, w = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0
    if shape == "ellipse":
        draw.ellipse(box, fill=colour)
    elif shape == "rectangle":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=colour)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=colour)
    elif shape == "cross":
        t = w / 6
        draw.rectangle((cx - t, y0, cx + t, y1), fill=colour)
        draw.rectangle((x0, cy - t, x1, cy + t), fill=colour)
    else:  # ring
        draw.ellipse(box, outline=colour, width=max(2, int(w / 7)))










def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="output folder")
    parser.add_argument("--num-classes", type=int, default=10, help="number of classes (default: 10)")
    parser.add_argument("--train-per-class", type=int, default=32, help="training images per class (default: 32)")
    parser.add_argument("--val-per-class", type=int, default=8, help="validation images per class (default: 8)")
    parser.add_argument("--image-size", type=int, default=64, help="image side in pixels, >= 16 (default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        root = make_imagenet_like(args.root, num_classes=args.num_classes, train_per_class=args.train_per_class,
                                  val_per_class=args.val_per_class, image_size=args.image_size, seed=args.seed,
                                  progress=not args.no_progress)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(root)


if __name__ == "__main__":
    main()
