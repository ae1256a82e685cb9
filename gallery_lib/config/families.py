"""The family registry: every model family the gallery can train, one module each.

``FAMILIES[name]`` is a ``ModelFamily`` (see ``family.py``); ``MODELS[model]`` the ``ModelSpec`` of every model
of every family. The registry is part of the base layer, since ``RunConfig`` checks its model and task settings
against it. Installed families are plugins: entry points of the ``gallery_families`` group, each a
``ModelFamily`` or a tuple of them, loaded the first time the registry is read (``pyproject.toml`` names the
gallery's own, ``gallery_lib/families/builtin.py``). A family defined outside an installed package (a user's
module, a test) calls ``register_family``; the training processes the launcher starts import its module again
(``family_env``), so it trains like a built-in one.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from gallery_lib.config.family import ModelFamily, ModelSpec
from gallery_lib.config.settings import ConfigError

_FAMILIES: dict[str, ModelFamily] = {}
_MODELS: dict[str, ModelSpec] = {}
_FAMILY_OF_MODEL: dict[str, str] = {}
_EXTERNAL: dict[str, tuple[str, str]] = {}  # family -> (module, sys.path root) for families outside gallery_lib
FAMILY_MODULES_ENV = "GALLERY_FAMILY_MODULES"
ENTRY_POINT_GROUP = "gallery_families"
_loaded = False


def __getattr__(name: str):
    """``FAMILIES`` and ``MODELS``, read-only views filled on first use."""
    if name in ("FAMILIES", "MODELS"):
        _load_families()
        return _FAMILIES if name == "FAMILIES" else _MODELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_families() -> None:
    """Registers the installed families (entry points) and imports the outside modules the launcher named, once."""
    global _loaded
    if _loaded:
        return
    installed = entry_points(group=ENTRY_POINT_GROUP)
    if not installed:
        raise ConfigError(f"no model family is installed (entry point group {ENTRY_POINT_GROUP!r}): install the "
                          "gallery with `pip install -e .` (ci/setup_env.sh does).")
    _loaded = True
    for entry in sorted(installed, key=lambda entry: not entry.module.startswith("gallery_lib.")):  # ours first
        loaded = entry.load()
        for family in loaded if isinstance(loaded, (tuple, list)) else (loaded,):
            _add(family)
    for entry in filter(None, os.environ.get(FAMILY_MODULES_ENV, "").split(os.pathsep)):
        module, _, root = entry.partition("=")
        if root and root not in sys.path:
            sys.path.append(root)
        importlib.import_module(module)


def register_family(family: ModelFamily) -> ModelFamily:
    """Adds ``family``, defined outside an installed package, and its models; a model name may belong to one family
    only. The training processes import the calling module again (``family_env``)."""
    _load_families()  # the installed families first, so a model name they hold is refused
    _add(family)
    module = sys._getframe(1).f_globals.get("__name__", "")  # the caller: what the training processes import
    _EXTERNAL[family.name] = (module, _import_root(module))
    return family


def _add(family: ModelFamily) -> None:
    taken = [spec.name for spec in family.models if _FAMILY_OF_MODEL.get(spec.name, family.name) != family.name]
    if taken:
        raise ValueError(f"model name(s) {taken} already belong to another family")
    unregister_family(family.name)
    _FAMILIES[family.name] = family
    for spec in family.models:
        _MODELS[spec.name] = ModelSpec(**{**spec.__dict__, "family": family.name})
        _FAMILY_OF_MODEL[spec.name] = family.name


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
    _load_families()  # the installed ones first: a model name they hold is refused, not shadowed
    before = set(_FAMILIES)
    importlib.import_module(file.stem)
    if not set(_FAMILIES) - before and not any(module == file.stem for module, _ in _EXTERNAL.values()):
        raise ConfigError(f"--family-module {path}: importing it registered no family; call "
                          "gallery_lib.families.register_family(ModelFamily(...)) at its top level.")
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
