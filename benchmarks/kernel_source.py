"""A kernel module of ``gallery_lib/accel/kernels`` read from another tree (e.g. a ``git archive`` of an earlier
commit), so that a probe can run or compile its kernels beside this tree's."""

from __future__ import annotations

import types


def kernels_of(root: str, module: str) -> types.ModuleType:
    """``gallery_lib/accel/kernels/<module>.py`` of the tree at ``root``, up to its ``torch.library`` ops (an op name
    is registered once per process): its kernels, launchers and plans. The source keeps its path, which Triton's
    ``jit`` needs to read the kernels' code."""
    path = f"{root}/gallery_lib/accel/kernels/{module}.py"
    with open(path) as f:
        source = f.read()
    loaded = types.ModuleType(f"{module}_at_{root}")
    exec(compile(source[:source.index("@library_op(")], path, "exec"), loaded.__dict__)
    return loaded
