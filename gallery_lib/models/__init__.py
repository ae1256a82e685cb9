"""The models: each family's module (``swin``, ``resnet``, ``stable_diffusion``, ``dreambooth``: its model builders
and its ``ModelFamily``) and the model parts that tasks share (``sd_parts``, ``flops``, ``offline_tokenizer``).

The registry the family modules register into lives in the base layer (``gallery_lib.config.families``); its calls
are importable from here too, as a family module outside the library uses them (``examples/toy_family.py``).
"""

from __future__ import annotations

from gallery_lib.config import families as _registry
from gallery_lib.config.families import (FAMILY_MODULES_ENV, build_model, family_env, family_of, get_family,
                                         register_family, unregister_family)

__all__ = ["FAMILIES", "FAMILY_MODULES_ENV", "MODELS", "build_model", "family_env", "family_of", "get_family",
           "register_family", "unregister_family"]


def __getattr__(name: str):
    """``FAMILIES`` and ``MODELS``: the registry's views, filled on first use."""
    if name in ("FAMILIES", "MODELS"):
        return getattr(_registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
