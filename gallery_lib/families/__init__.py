"""The model families: one module each (``swin``, ``resnet``, ``stable_diffusion``, ``dreambooth``), which declares
its models, task, profiles and recipe switches as a ``ModelFamily``; ``builtin`` lists them for the registry.

A floor above the parts (a family puts together models, tasks, data and accelerations) and below the run. The
registry itself lives in the base layer (``gallery_lib.config.families``), since ``RunConfig`` checks against it;
its calls are importable from here, as a family module outside the library uses them (``examples/toy_family.py``).
"""

from __future__ import annotations

from gallery_lib.config import families as _registry
from gallery_lib.config.families import (FAMILY_MODULES_ENV, build_model, family_env, family_of, get_family,
                                         import_family_module, register_family, unregister_family)

__all__ = ["FAMILIES", "FAMILY_MODULES_ENV", "MODELS", "build_model", "family_env", "family_of", "get_family",
           "import_family_module", "register_family", "unregister_family"]


def __getattr__(name: str):
    """``FAMILIES`` and ``MODELS``: the registry's views, filled on first use."""
    if name in ("FAMILIES", "MODELS"):
        return getattr(_registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
