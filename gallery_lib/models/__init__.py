"""Model registry: gallery model names mapped to builders, one file per model family.

``MODELS[name]`` is a ``ModelSpec``; ``build_model(name, num_classes=...)`` builds it with random
weights (or from a local pretrained file). Torch and timm are imported only when a model is built,
so the config layer stays cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gallery_lib.models import swin


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    """Output folder and notebook name of the family (e.g. ``swin_transformer``)."""
    builder: Callable[..., object]
    default_image_size: int
    tiny: bool
    """A CPU-sized configuration for smoke runs and tests."""
    description: str


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("swin_tiny_patch4_window7_224", "swin_transformer", swin.build_swin_tiny, 224, False,
                  "Swin-T (timm), 28M parameters, 4.5 GFLOP/image forward at 224 px"),
        ModelSpec("swin_micro", "swin_transformer", swin.build_swin_micro, 64, True,
                  "a 2-stage Swin with the same blocks (shifted windows, relative position bias) for CPU smoke runs"),
    )
}


def build_model(name: str, *, num_classes: int, image_size: int | None = None, pretrained_file: str | None = None):
    """Builds the named model with random weights, or loads ``pretrained_file`` (a local timm checkpoint)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}.")
    spec = MODELS[name]
    return spec.builder(num_classes=num_classes, image_size=image_size or spec.default_image_size,
                        pretrained_file=pretrained_file)
