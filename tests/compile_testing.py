"""Test helpers: how many compiled graphs a process loaded from, or missed in, Inductor's on-disk caches; a cache
folder of a test's own that outlives one ``with`` block (``fresh_cache`` makes a new one each time), optionally holding
the C++ kernels another cache built; the graphs ``torch.compile`` hands the compiler (``aot_graphs``); ``torch.compile``
without code generation where a test checks what is wired around the compiler (``compile_without_codegen``)."""
import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from gallery_lib.accel.compile.regional import compile_cache_stats
from gallery_lib.accel.compile.precompile import warm


@contextlib.contextmanager
def compile_cache_at(path: Path) -> Iterator[Path]:
    """Inductor's and Triton's caches in ``path`` (created if missing, kept after), for this process and the
    processes it starts; the in-memory caches are cleared on the way in and out."""
    from torch._inductor.utils import clear_caches

    path.mkdir(parents=True, exist_ok=True)
    saved = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(path), TRITON_CACHE_DIR=str(path / "triton"))
    clear_caches()
    try:
        yield path
    finally:
        clear_caches()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_without_codegen(monkeypatch) -> None:
    """Every ``torch.compile`` call of this test runs ``aot_eager``: Dynamo's capture and AOTAutograd's joint graph,
    no Inductor code. For tests of what the library wires around the compiler (accumulation, a recipe's optimizer and
    EMA), where a CPU's C++ kernels would cost minutes and check nothing of ours: Inductor's own numerics on the same
    models are held by the tests that compile for real (the accelerated UNet blocks in fp32, test_cpu_codegen.py's
    blocks in bf16 and fp32)."""
    from aot_eager_site.sitecustomize import aot_eager_compile

    monkeypatch.setattr(torch, "compile", aot_eager_compile(torch.compile))


# What makes a cache warm for graphs: Inductor's FX graph and AOTAutograd caches, Triton's, and the gallery's
# warm-start markers. Everything else in the folder is code keyed by its own source: C++ kernels and their builds.
_GRAPH_ENTRIES = ("fxgraph", "aotautograd", "triton", "locks", warm.marker_dir().name)


def copy_kernel_builds(source: Path, cache: Path) -> None:
    """Hard-links (copies across file systems) the C++ kernels that ``source``'s compiles built into ``cache``; no
    graph, no marker. A compile in ``cache`` then traces, lowers and caches every graph as in an empty folder, and
    skips the C++ compiler only for a kernel with the same source and flags. A file already in ``cache`` stays."""
    def link(src: str, dst: str) -> None:
        if os.path.exists(dst):
            return
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for entry in sorted(source.iterdir()) if source.is_dir() else []:
        if entry.is_dir() and entry.name not in _GRAPH_ENTRIES:
            shutil.copytree(entry, cache / entry.name, copy_function=link, dirs_exist_ok=True)


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) over AOTAutograd's cache and Inductor's FX graph cache. With AOTAutograd's cache enabled a hit
    there loads the graph without counting an FX graph cache hit, so a test must add the two."""
    stats = compile_cache_stats()
    hits = stats["aot_autograd_hits"] + stats["fx_graph_hits"]
    return hits, stats["aot_autograd_misses"] + stats["fx_graph_misses"]


def aot_graphs(call, *args) -> list[str]:
    """The forward and backward graphs (as code) that ``torch.compile`` hands the compiler for ``call(*args)``."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    codes = []

    def keep(gm, _inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(call, fullgraph=True, backend=lambda gm, inputs: aot_module_simplified(
            gm, inputs, fw_compiler=keep, bw_compiler=keep))(*args)
    out.float().square().mean().backward()
    return codes
