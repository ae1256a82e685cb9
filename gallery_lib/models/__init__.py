"""The family registry: every model family the gallery can train, one module each.

``FAMILIES[name]`` is a ``ModelFamily`` (see ``family.py``); ``MODELS[model]`` the ``ModelSpec`` of every model
of every family. A new family is one module that builds a ``ModelFamily`` and calls ``register_family``; the
built-in ones are registered below. A family registered from outside ``gallery_lib`` (a user's module, a test) is
imported again in the training processes the launcher starts (``family_env``), so it trains like a built-in one.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from gallery_lib.models.family import ModelFamily, ModelSpec
from gallery_lib.settings import ConfigError

FAMILIES: dict[str, ModelFamily] = {}
MODELS: dict[str, ModelSpec] = {}
_FAMILY_OF_MODEL: dict[str, str] = {}
_EXTERNAL: dict[str, tuple[str, str]] = {}  # family -> (module, sys.path root) for families outside gallery_lib
FAMILY_MODULES_ENV = "GALLERY_FAMILY_MODULES"


def register_family(family: ModelFamily) -> ModelFamily:
    """Adds ``family`` and its models; a model name may belong to one family only."""
    taken = [spec.name for spec in family.models if _FAMILY_OF_MODEL.get(spec.name, family.name) != family.name]
    if taken:
        raise ValueError(f"model name(s) {taken} already belong to another family")
    unregister_family(family.name)
    FAMILIES[family.name] = family
    for spec in family.models:
        MODELS[spec.name] = ModelSpec(**{**spec.__dict__, "family": family.name})
        _FAMILY_OF_MODEL[spec.name] = family.name
    module = sys._getframe(1).f_globals.get("__name__", "")
    if not module.startswith("gallery_lib."):
        _EXTERNAL[family.name] = (module, _import_root(module))
    return family


def unregister_family(name: str) -> None:
    family = FAMILIES.pop(name, None)
    _EXTERNAL.pop(name, None)
    for spec in family.models if family else ():
        MODELS.pop(spec.name, None)
        _FAMILY_OF_MODEL.pop(spec.name, None)


def family_of(model: str) -> ModelFamily:
    """The family of gallery model ``model``; ``ConfigError`` listing the models if it is unknown."""
    if model not in _FAMILY_OF_MODEL:
        raise ConfigError(f"model={model!r} is not known: choose one of {', '.join(MODELS)}.")
    return FAMILIES[_FAMILY_OF_MODEL[model]]


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ConfigError(f"family={name!r} is not known: choose one of {', '.join(FAMILIES)}.")
    return FAMILIES[name]


def build_model(name: str, **kwargs):
    """Builds gallery model ``name`` with its family task's arguments (e.g. ``num_classes`` for classifiers)."""
    family_of(name)  # a clear error for an unknown name
    return MODELS[name].build(**kwargs)


def family_env(family: ModelFamily) -> dict[str, str]:
    """Environment that makes a training subprocess register ``family`` too, when it lives outside gallery_lib."""
    if family.name not in _EXTERNAL:
        return {}
    module, root = _EXTERNAL[family.name]
    if module == "__main__" or not root:
        raise ConfigError(f"family {family.name!r} was registered from {module or 'an unnamed module'} (a notebook "
                          "cell or a script), which the training processes cannot import: define it in a module "
                          "file and import that module.")
    return {FAMILY_MODULES_ENV: os.pathsep.join(f"{module}={root}" for module, root in _EXTERNAL.values())}


def _import_root(module: str) -> str:
    """The ``sys.path`` entry ``module`` was imported from ('' when it has no file)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if not file:
        return ""
    path = Path(file).resolve().with_suffix("")
    for _ in module.split("."):
        path = path.parent
    return str(path)


def _register_external_families() -> None:
    for entry in filter(None, os.environ.get(FAMILY_MODULES_ENV, "").split(os.pathsep)):
        module, _, root = entry.partition("=")
        if root and root not in sys.path:
            sys.path.append(root)
        importlib.import_module(module)


from gallery_lib.models import stable_diffusion, swin  # noqa: E402  (each registers its family)

register_family(swin.FAMILY)
register_family(stable_diffusion.FAMILY)
_register_external_families()
