"""Mock-data generators for the gallery: small, deterministic, learnable stand-ins for the real datasets.

Each generator writes files in the layout the real dataset uses, so the training code cannot tell them apart.
Names are loaded on first use, so ``python -m data_prep.<module>`` runs without a double import.
"""

from typing import Any

__all__ = ["make_caption_folder", "make_imagenet_like"]


def __getattr__(name: str) -> Any:
    if name == "make_imagenet_like":
        from data_prep.imagenet_like import make_imagenet_like

        return make_imagenet_like
    if name == "make_caption_folder":
        from data_prep.captions import make_caption_folder

        return make_caption_folder
    raise AttributeError(f"module 'data_prep' has no attribute {name!r}")
