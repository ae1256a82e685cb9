"""Test helper: how many compiled graphs a process loaded from, or missed in, Inductor's on-disk caches."""
from torch._dynamo.utils import counters


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) over AOTAutograd's cache and Inductor's FX graph cache. With AOTAutograd's cache enabled a hit
    there loads the graph without counting an FX graph cache hit, so a test must add the two."""
    hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    misses = counters["aot_autograd"]["autograd_cache_miss"] + counters["inductor"]["fxgraph_cache_miss"]
    return hits, misses


def describe_counters() -> dict:
    return {"aot_autograd": dict(counters["aot_autograd"]), "inductor": dict(counters["inductor"])}
