"""A captioned mock dataset for text-to-image training: PNG files plus ``metadata.jsonl`` (the HF imagefolder layout).

``root/train/<name>.png`` and ``root/train/metadata.jsonl``, one JSON object per line with ``file_name`` (relative to
the folder of ``metadata.jsonl``) and ``text``: the layout diffusers' ``train_text_to_image.py --train_data_dir`` and
``datasets.load_dataset("imagefolder", data_dir=root)`` read. Each picture holds one or two plain shapes of named
colours on a background of another named colour, and its caption says exactly what is drawn, e.g.
"a red circle on a blue background" or "a small yellow triangle at the top left and a small white square at the
bottom on a black background". The vocabulary is small (``caption_vocabulary()``) and every word is visible in the
pixels, so a tiny diffusion model learns to follow it.

The output is a pure function of the parameters: every image has its own random stream seeded from
``(seed, index)``, so the same parameters give byte-identical files (for a given Pillow / zlib build).
``root/manifest.json`` records the parameters and the files written; a second call with the same parameters returns at
once, and a call with other parameters removes only the files listed in the manifest before writing the new set.

Run from the shell::

    python -m data_prep.captions --root data/captions --num-images 512 --image-size 512
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import pathlib

import numpy as np
from PIL import Image, ImageDraw

from data_prep.manifest import check_int, one_writer, reuse_or_clear, write_dataset

METADATA = "metadata.jsonl"
_GENERATOR = "data_prep.captions"
_VERSION = 1  # bump when the pictures or captions change, so old folders are regenerated
_SPLIT = "train"

# Named colours, far apart in RGB so that every pixel's nearest name is unambiguous.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (240, 220, 30),
    "white": (245, 245, 245), "black": (15, 15, 15), "orange": (245, 140, 20), "purple": (140, 40, 180),
}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
# Position words by (row, column) of a 3x3 grid. A large shape is always centred and gets no position word.
_POSITIONS = {
    (0, 0): "at the top left", (0, 1): "at the top", (0, 2): "at the top right",
    (1, 0): "on the left", (1, 1): "in the middle", (1, 2): "on the right",
    (2, 0): "at the bottom left", (2, 1): "at the bottom", (2, 2): "at the bottom right",
}
# Shape side as a fraction of the image side, by size word; two shapes are always small so they never overlap.
_SIDES = {"small": 0.24, "": 0.36, "large": 0.6}
_MARGIN = 0.06  # fraction of the image side kept free at the border
_NOISY_FRACTION = 0.5  # share of pictures with a mottled background; the rest are plain
_NOISE_AMPLITUDE = 12  # max background deviation (0-255 scale) of the mottle; nearest colour names stay unchanged
_TWO_SHAPES_FRACTION = 0.35


@one_writer
def make_caption_folder(
    root: str | os.PathLike,
    *,
    num_images: int = 64,
    image_size: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> pathlib.Path:
    """Write (or reuse) a captioned mock dataset under ``root`` and return ``root`` as a Path.

    Args:
        root: Output folder. Created if missing. It must not already hold a ``train/`` folder that this function did
            not write (no ``manifest.json``), so a real dataset is never mixed with mock images.
        num_images: Number of captioned images in ``root/train``.
        image_size: Side of the square images in pixels, at least 16.
        seed: Seed of the whole dataset; the same seed and parameters give byte-identical files.
        progress: Show a tqdm progress bar (rate-limited so papermill logs stay short).
    """
    params = {
        "num_images": check_int("num_images", num_images, 1),
        "image_size": check_int("image_size", image_size, 16),
        "seed": check_int("seed", seed, 0),
    }
    root = pathlib.Path(root)
    if reuse_or_clear(root, generator=_GENERATOR, version=_VERSION, params=params, splits=(_SPLIT,),
                      writer="make_caption_folder"):
        return root

    lines: list[str] = []  # metadata.jsonl, a line per image as it is drawn: written after the images

    def image(i: int, name: str) -> bytes:
        png, caption = _render(params, i)
        lines.append(json.dumps({"file_name": name, "text": caption}) + "\n")
        return png

    names = [f"{i:05d}.png" for i in range(params["num_images"])]
    files = [(f"{_SPLIT}/{name}", functools.partial(image, i, name)) for i, name in enumerate(names)]
    files.append((f"{_SPLIT}/{METADATA}", lambda: "".join(lines).encode()))
    return write_dataset(root, generator=_GENERATOR, version=_VERSION, params=params, files=files,
                         desc=f"captions -> {root}", progress=progress)


def caption_vocabulary() -> list[str]:
    """Every word a caption can use, sorted; captions are these words joined by single spaces."""
    words = {"a", "an", "and", "on", "background", *COLOURS, *SHAPES}
    for phrase in (*_POSITIONS.values(), *_SIDES):
        words.update(phrase.split())
    return sorted(words)


def _render(params: dict[str, int], index: int) -> tuple[bytes, str]:
    """PNG bytes and caption of image ``index``."""
    size = params["image_size"]
    rng = np.random.default_rng((params["seed"], index))
    names = list(COLOURS)
    background = names[rng.integers(len(names))]
    others = [c for c in names if c != background]
    if rng.random() < _TWO_SHAPES_FRACTION:
        cells = rng.choice(len(_POSITIONS), size=2, replace=False)
        objects = [("small", tuple(divmod(int(c), 3))) for c in cells]
    else:
        size_word = str(rng.choice(list(_SIDES)))
        # A large shape has too little room to move for a position word to be visible: it is always centred.
        cell = (1, 1) if size_word == "large" else tuple(divmod(int(rng.integers(len(_POSITIONS))), 3))
        objects = [(size_word, cell)]

    img = _background(rng, size, COLOURS[background])
    draw = ImageDraw.Draw(img)
    phrases = []
    for size_word, cell in objects:
        colour, shape = others[rng.integers(len(others))], SHAPES[rng.integers(len(SHAPES))]
        _draw_shape(draw, shape, _box(rng, size, _SIDES[size_word], cell), COLOURS[colour])
        words = [size_word, colour, shape, "" if size_word == "large" else _POSITIONS[cell]]
        phrases.append(_with_article(" ".join(w for w in words if w)))
    caption = " and ".join(phrases) + " on " + _with_article(f"{background} background")

    out = io.BytesIO()
    img.save(out, format="PNG", compress_level=1)  # level 1: 2-3x faster than the default on noisy backgrounds
    return out.getvalue(), caption


def _with_article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _background(rng: np.random.Generator, size: int, colour: tuple[int, int, int]) -> Image.Image:
    if rng.random() >= _NOISY_FRACTION:
        return Image.new("RGB", (size, size), colour)
    # Low-frequency mottle (coarse noise upsampled): visible texture that still compresses well in PNG.
    coarse = max(2, size // 16)
    noise = rng.integers(128 - _NOISE_AMPLITUDE, 129 + _NOISE_AMPLITUDE, size=(coarse, coarse, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(noise, "RGB").resize((size, size), Image.BILINEAR), dtype=np.int16) - 128
    return Image.fromarray(np.clip(np.array(colour, np.int16) + smooth, 0, 255).astype(np.uint8), "RGB")


def _box(rng: np.random.Generator, size: int, side_fraction: float, cell: tuple[int, int]):
    """Box of a shape anchored in grid ``cell``: the corner cells touch the margins, the middle ones are centred."""
    side = side_fraction * size * rng.uniform(0.9, 1.1)
    free = size * (1 - 2 * _MARGIN) - side
    jitter = 0.04 * size
    row, col = cell
    x0 = _MARGIN * size + free * col / 2 + rng.uniform(-jitter, jitter) * (col == 1)
    y0 = _MARGIN * size + free * row / 2 + rng.uniform(-jitter, jitter) * (row == 1)
    return x0, y0, x0 + side, y0 + side


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float],
                colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    cx, cy, w = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=colour)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=colour)
    else:  # cross
        t = w / 6
        draw.rectangle((cx - t, y0, cx + t, y1), fill=colour)
        draw.rectangle((x0, cy - t, x1, cy + t), fill=colour)






def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="output folder")
    parser.add_argument("--num-images", type=int, default=64, help="number of captioned images (default: 64)")
    parser.add_argument("--image-size", type=int, default=64, help="image side in pixels, >= 16 (default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        root = make_caption_folder(args.root, num_images=args.num_images, image_size=args.image_size, seed=args.seed,
                                   progress=not args.no_progress)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(root)


if __name__ == "__main__":
    main()
