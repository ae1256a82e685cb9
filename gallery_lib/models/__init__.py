"""Model registry: gallery model names mapped to builders, one file per model family.

``MODELS[name]`` is a ``ModelSpec``; ``build_model(name, num_classes=...)`` builds a classifier with random
weights (or from a local pretrained file), ``build_stable_diffusion(name, ...)`` the parts of a text-to-image model.
Torch, timm and diffusers are imported only when a model is built, so the config layer stays cheap to import.
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
    task: str = "classification"
    """``classification`` (images -> class scores) or ``text_to_image`` (a latent diffusion model)."""
    block_modules: tuple[str, ...] = ()
    """Modules that define the model's repeated blocks: precompile workers import them while the run sets up."""


def _stable_diffusion(variant: str) -> Callable[..., object]:
    def build(**kwargs):
        from gallery_lib.models.stable_diffusion import build_stable_diffusion

        return build_stable_diffusion(variant, **kwargs)
    return build


_SD_BLOCK_MODULES = ("diffusers.models.unets.unet_2d_blocks", "gallery_lib.patch")
_SWIN_BLOCK_MODULES = ("gallery_lib.models.swin",)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("swin_tiny_patch4_window7_224", "swin_transformer", swin.build_swin_tiny, 224, False,
                  "Swin-T (timm), 28M parameters, 4.5 GFLOP/image forward at 224 px",
                  block_modules=_SWIN_BLOCK_MODULES),
        ModelSpec("swin_micro", "swin_transformer", swin.build_swin_micro, 64, True,
                  "a 2-stage Swin with the same blocks (shifted windows, relative position bias) for CPU smoke runs",
                  block_modules=_SWIN_BLOCK_MODULES),
        ModelSpec("sd15", "stable_diffusion", _stable_diffusion("sd15"), 512, False,
                  "Stable Diffusion 1.5: UNet (860M parameters, trained), VAE and CLIP ViT-L/14 text encoder (frozen)",
                  task="text_to_image", block_modules=_SD_BLOCK_MODULES),
        ModelSpec("sd_tiny", "stable_diffusion", _stable_diffusion("sd_tiny"), 32, True,
                  "the same three diffusers/transformers classes at CPU-smoke size", task="text_to_image",
                  block_modules=_SD_BLOCK_MODULES),
    )
}


def build_model(name: str, *, num_classes: int, image_size: int | None = None, pretrained_file: str | None = None):
    """Builds the named model with random weights, or loads ``pretrained_file`` (a local timm checkpoint)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}.")
    spec = MODELS[name]
    if spec.task != "classification":
        raise ValueError(f"{name} is a {spec.task} model: build it with build_stable_diffusion.")
    return spec.builder(num_classes=num_classes, image_size=image_size or spec.default_image_size,
                        pretrained_file=pretrained_file)


def build_stable_diffusion(name: str, **kwargs):
    """The parts (UNet, VAE, text encoder, tokenizer, noise scheduler) of text-to-image model ``name``."""
    spec = MODELS.get(name)
    if spec is None or spec.task != "text_to_image":
        choices = [n for n, s in MODELS.items() if s.task == "text_to_image"]
        raise KeyError(f"{name!r} is not a text-to-image model: choose one of {', '.join(choices)}.")
    return spec.builder(**kwargs)
