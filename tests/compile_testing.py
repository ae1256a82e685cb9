"""Test helper: how many compiled graphs a process loaded from, or missed in, Inductor's on-disk caches."""
from gallery_lib.accel.compile import compile_cache_stats


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) over AOTAutograd's cache and Inductor's FX graph cache. With AOTAutograd's cache enabled a hit
    there loads the graph without counting an FX graph cache hit, so a test must add the two."""
    stats = compile_cache_stats()
    hits = stats["aot_autograd_hits"] + stats["fx_graph_hits"]
    return hits, stats["aot_autograd_misses"] + stats["fx_graph_misses"]
