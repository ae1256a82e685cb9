"""The project's scripts (``benchmarks/``, ``ci/``) loaded as modules, for the tests of their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """``REPO/relative`` (e.g. ``benchmarks/bench_kernels.py``) run as a module named after its file, registered in
    ``sys.modules`` so that its dataclasses resolve their string annotations."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
