"""Test helpers: how many compiled graphs a process loaded from, or missed in, Inductor's on-disk caches; a cache
folder of a test's own that outlives one ``with`` block (``fresh_cache`` makes a new one each time)."""
import contextlib
import os
from pathlib import Path
from typing import Iterator

from gallery_lib.accel.compile import compile_cache_stats


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


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) over AOTAutograd's cache and Inductor's FX graph cache. With AOTAutograd's cache enabled a hit
    there loads the graph without counting an FX graph cache hit, so a test must add the two."""
    stats = compile_cache_stats()
    hits = stats["aot_autograd_hits"] + stats["fx_graph_hits"]
    return hits, stats["aot_autograd_misses"] + stats["fx_graph_misses"]
