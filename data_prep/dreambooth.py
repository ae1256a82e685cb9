"""Mock DreamBooth data: a few pictures of one subject, and many pictures of its class for prior preservation.

``root/instance/`` holds ``num_instance_images`` pictures of one drawn dog, the subject a DreamBooth run teaches
as "sks dog": always the same dog (an orange coat, one black ear, a white chest patch and a blue collar), seen
facing left or right, standing or sitting, large or small, anywhere in the picture, on backgrounds of different
colours. ``root/class/`` holds ``num_class_images`` pictures of other dogs drawn the same way (random coats and
ears, no collar), the "a photo of dog" images prior preservation trains on, so no run has to generate them.

These are diffusers' DreamBooth conventions: ``--instance_data_dir root/instance --instance_prompt "a photo of sks
dog" --class_data_dir root/class --class_prompt "a photo of dog" --num_class_images N``. Files are named
``00000.png`` ...; the output is a pure function of the parameters, and ``root/manifest.json`` records them (a second
call with the same parameters returns at once; see ``data_prep.manifest``).

Run from the shell::

    python -m data_prep.dreambooth --root data/dreambooth --num-class-images 100 --image-size 512
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import pathlib

import numpy as np
from PIL import Image, ImageDraw

from data_prep.manifest import check_int, one_writer, reuse_or_clear, write_dataset

INSTANCE, CLASS = "instance", "class"
INSTANCE_PROMPT, CLASS_PROMPT = "a photo of sks dog", "a photo of dog"
_GENERATOR = "data_prep.dreambooth"
_VERSION = 1

_SUBJECT = dict(coat=(214, 120, 40), ear=(20, 20, 20), patch=(245, 240, 230), collar=(30, 70, 210), tail_up=True)
_BACKGROUNDS = ((120, 180, 230), (110, 170, 90), (230, 210, 160), (200, 200, 205), (90, 90, 110), (240, 190, 200))
_COATS = ((60, 45, 35), (235, 225, 200), (150, 150, 150), (120, 70, 30), (30, 30, 30), (200, 170, 110))


@one_writer
def make_dreambooth_folders(
    root: str | os.PathLike,
    *,
    num_instance_images: int = 6,
    num_class_images: int = 100,
    image_size: int = 512,
    seed: int = 0,
    progress: bool = True,
) -> pathlib.Path:
    """Write (or reuse) ``root/instance`` and ``root/class`` and return ``root`` as a Path.

    Args:
        root: Output folder; it must not already hold ``instance/`` or ``class/`` images this function did not write.
        num_instance_images: Pictures of the subject (DreamBooth uses 3-8).
        num_class_images: Pictures of other dogs, for prior preservation (diffusers' default is 100).
        image_size: Side of the square images in pixels, at least 16.
        seed: The same seed and parameters give byte-identical files.
        progress: Show a tqdm progress bar.
    """
    params = {
        "num_instance_images": check_int("num_instance_images", num_instance_images, 1),
        "num_class_images": check_int("num_class_images", num_class_images, 1),
        "image_size": check_int("image_size", image_size, 16),
        "seed": check_int("seed", seed, 0),
    }
    root = pathlib.Path(root)
    if reuse_or_clear(root, generator=_GENERATOR, version=_VERSION, params=params, splits=(INSTANCE, CLASS),
                      writer="make_dreambooth_folders"):
        return root
    jobs = [(INSTANCE, i) for i in range(params["num_instance_images"])]
    jobs += [(CLASS, i) for i in range(params["num_class_images"])]
    files = [(f"{folder}/{i:05d}.png", functools.partial(_render, params, folder, i)) for folder, i in jobs]
    return write_dataset(root, generator=_GENERATOR, version=_VERSION, params=params, files=files,
                         desc=f"dreambooth -> {root}", progress=progress)


def _render(params: dict[str, int], folder: str, index: int) -> bytes:
    """PNG bytes of picture ``index`` of ``folder``: the subject, or a random dog of the class."""
    size = params["image_size"]
    rng = np.random.default_rng((params["seed"], folder == CLASS, index))
    if folder == INSTANCE:
        look = _SUBJECT
    else:
        coat = _COATS[rng.integers(len(_COATS))]
        look = dict(coat=coat, ear=tuple(int(c * 0.6) for c in coat), patch=coat, collar=None,
                    tail_up=bool(rng.random() < 0.5))
    top, bottom = (np.array(_BACKGROUNDS[k]) for k in rng.choice(len(_BACKGROUNDS), size=2, replace=False))
    ramp = np.linspace(0.0, 1.0, size)[:, None, None]
    img = Image.fromarray((top * (1 - ramp) + bottom * ramp).repeat(size, axis=1).astype(np.uint8), "RGB")
    scale = size * rng.uniform(0.4, 0.62)  # the dog's body length in pixels; the whole dog stays in the picture
    cx = rng.uniform(0.76 * scale, size - 0.76 * scale)
    cy = rng.uniform(0.47 * scale, size - 0.45 * scale)
    _draw_dog(ImageDraw.Draw(img), look, cx, cy, scale, facing=1 if rng.random() < 0.5 else -1,
              sitting=bool(rng.random() < 0.4))
    out = io.BytesIO()
    img.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def _draw_dog(draw: ImageDraw.ImageDraw, look: dict, cx: float, cy: float, s: float, *, facing: int,
              sitting: bool) -> None:
    """A side-view dog of body length ``s`` centred at ``(cx, cy)``, its head on the ``facing`` side (+1 right)."""
    def box(x, y, w, h):  # a box centred at (cx + x*s*facing, cy + y*s) of size (w*s, h*s)
        x = cx + x * s * facing
        y = cy + y * s
        return (x - w * s / 2, y - h * s / 2, x + w * s / 2, y + h * s / 2)

    coat = look["coat"]
    body_y, rear_y = (-0.05, 0.02) if sitting else (0.0, 0.0)
    draw.ellipse(box(-0.5, -0.25 if look["tail_up"] else 0.1, 0.08, 0.3), fill=coat)  # tail
    for x in ((-0.3, 0.3) if not sitting else (-0.25, 0.25)):  # legs: straight when standing, hind one folded
        if sitting and x < 0:
            draw.ellipse(box(x, 0.22, 0.3, 0.14), fill=coat)
        else:
            draw.rectangle(box(x, 0.25, 0.1, 0.35), fill=coat)
    draw.ellipse(box(0.0, body_y + rear_y, 0.85, 0.38), fill=coat)
    if look["patch"] != coat:
        draw.ellipse(box(0.28, body_y + 0.05, 0.2, 0.2), fill=look["patch"])
    head = (0.48, body_y - 0.28)
    draw.ellipse(box(head[0], head[1], 0.32, 0.3), fill=coat)
    draw.ellipse(box(head[0] + 0.17, head[1] + 0.05, 0.16, 0.12), fill=coat)  # muzzle
    draw.ellipse(box(head[0] + 0.25, head[1] + 0.03, 0.05, 0.05), fill=(10, 10, 10))  # nose
    draw.ellipse(box(head[0] + 0.06, head[1] - 0.04, 0.05, 0.05), fill=(10, 10, 10))  # eye
    draw.ellipse(box(head[0] - 0.08, head[1] - 0.02, 0.1, 0.26), fill=look["ear"])
    if look["collar"]:
        draw.rectangle(box(head[0] - 0.04, head[1] + 0.16, 0.22, 0.06), fill=look["collar"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="output folder")
    parser.add_argument("--num-instance-images", type=int, default=6, help="pictures of the subject (default: 6)")
    parser.add_argument("--num-class-images", type=int, default=100, help="pictures of the class (default: 100)")
    parser.add_argument("--image-size", type=int, default=512, help="image side in pixels, >= 16 (default: 512)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        root = make_dreambooth_folders(args.root, num_instance_images=args.num_instance_images,
                                       num_class_images=args.num_class_images, image_size=args.image_size,
                                       seed=args.seed, progress=not args.no_progress)
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(f"instance images in {root / INSTANCE}, class images in {root / CLASS}")


if __name__ == "__main__":
    main()
