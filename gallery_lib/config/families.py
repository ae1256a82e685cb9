"""The family registry: every model family the gallery can train, one module each.

``FAMILIES[name]`` is a ``ModelFamily`` (see ``family.py``); ``MODELS[model]`` the ``ModelSpec`` of every model
of every family. A new family is one module that builds a ``ModelFamily`` and passes it to ``register_family``.
The registry is part of the base layer, since ``RunConfig`` checks its model and task settings against it; the
built-in family modules (``gallery_lib/models/<family>.py``, which import their tasks and accelerations) are
imported by name the first time the registry is read, as plugins are. A family registered from outside
``gallery_lib`` (a user's module, a test) is imported again in the training processes the launcher starts
(``family_env``), so it trains like a built-in one.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from gallery_lib.config.family import ModelFamily, ModelSpec
from gallery_lib.config.settings import ConfigError

_FAMILIES: dict[str, ModelFamily] = {}
_MODELS: dict[str, ModelSpec] = {}
_FAMILY_OF_MODEL: dict[str, str] = {}
_EXTERNAL: dict[str, tuple[str, str]] = {}  # family -> (module, sys.path root) for families outside gallery_lib
FAMILY_MODULES_ENV = "GALLERY_FAMILY_MODULES"
_BUILTIN = ("gallery_lib.models.swin", "gallery_lib.models.stable_diffusion", "gallery_lib.models.resnet",
            "gallery_lib.models.dreambooth")
_loaded = False


def __getattr__(name: str):
    """``FAMILIES`` and ``MODELS``, read-only views filled on first use."""
    if name in ("FAMILIES", "MODELS"):
        _load_families()
        return _FAMILIES if name == "FAMILIES" else _MODELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_families() -> None:
    """Imports the built-in family modules and those named by the launcher (each registers itself), once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN:
        importlib.import_module(module)
    for entry in filter(None, os.environ.get(FAMILY_MODULES_ENV, "").split(os.pathsep)):
        module, _, root = entry.partition("=")
        if root and root not in sys.path:
            sys.path.append(root)
        importlib.import_module(module)


def register_family(family: ModelFamily) -> ModelFamily:
    """Adds ``family`` and its models; a model name may belong to one family only."""
    module = sys._getframe(1).f_globals.get("__name__", "")
    if not module.startswith("gallery_lib."):
        # The built-in families first, so a name they hold is refused. Not while a built-in module registers
        # itself: importing the others then would import it again half-built (dreambooth imports stable_diffusion).
        _load_families()
    taken = [spec.name for spec in family.models if _FAMILY_OF_MODEL.get(spec.name, family.name) != family.name]
    if taken:
        raise ValueError(f"model name(s) {taken} already belong to another family")
    unregister_family(family.name)
    _FAMILIES[family.name] = family
    for spec in family.models:
        _MODELS[spec.name] = ModelSpec(**{**spec.__dict__, "family": family.name})
        _FAMILY_OF_MODEL[spec.name] = family.name
    if not module.startswith("gallery_lib."):
        _EXTERNAL[family.name] = (module, _import_root(module))
    return family


def unregister_family(name: str) -> None:
    family = _FAMILIES.pop(name, None)
    _EXTERNAL.pop(name, None)
    for spec in family.models if family else ():
        _MODELS.pop(spec.name, None)
        _FAMILY_OF_MODEL.pop(spec.name, None)


def family_of(model: str) -> ModelFamily:
    """The family of gallery model ``model``; ``ConfigError`` listing the models if it is unknown."""
    _load_families()
    if model not in _FAMILY_OF_MODEL:
        raise ConfigError(f"model={model!r} is not known: choose one of {', '.join(_MODELS)}.")
    return _FAMILIES[_FAMILY_OF_MODEL[model]]


def get_family(name: str) -> ModelFamily:
    _load_families()
    if name not in _FAMILIES:
        raise ConfigError(f"family={name!r} is not known: choose one of {', '.join(_FAMILIES)}.")
    return _FAMILIES[name]


def build_model(name: str, **kwargs):
    """Builds gallery model ``name`` with its family task's arguments (e.g. ``num_classes`` for classifiers)."""
    return family_of(name).build(name, **kwargs)


def import_family_module(path: str | os.PathLike) -> str:
    """Imports a family module from a file (``gallery --family-module examples/toy_family.py``): its folder joins
    ``sys.path`` and the module, imported by its name, registers its family; returns the module's name. The training
    processes import it again (``family_env``)."""
    file = Path(path).expanduser().resolve()
    if file.suffix != ".py" or not file.is_file():
        raise ConfigError(f"--family-module {path}: no such Python file; name the module that registers your family, "
                          "e.g. examples/toy_family.py.")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    _load_families()  # the built-in ones first: a model name they hold is refused, not shadowed
    before = set(_FAMILIES)
    importlib.import_module(file.stem)
    if not set(_FAMILIES) - before and not any(module == file.stem for module, _ in _EXTERNAL.values()):
        raise ConfigError(f"--family-module {path}: importing it registered no family; call "
                          "gallery_lib.models.register_family(ModelFamily(...)) at its top level.")
    return file.stem


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
