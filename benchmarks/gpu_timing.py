"""Timing helpers of the GPU probes: CUDA events after warm-up, median with p20/p80 in ms.

``event_ms`` times each call of ``fn`` between two events; ``graph_ms`` captures ``calls`` calls of ``fn`` in one CUDA
graph and times its replays (per call), so launch overheads between small kernels do not count, as in a training step
that replays its graphs.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def _summary(times: list[float]) -> list[float]:
    q = statistics.quantiles(times, n=10)
    return [statistics.median(times), q[1], q[7]]


def event_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> list[float]:
    """[median, p20, p80] ms of one call of ``fn`` over ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return _summary(times)


def graph_ms(fn: Callable[[], object], calls: int = 1, replays: int = 20, warmup: int = 3) -> list[float]:
    """[median, p20, p80] ms of one call of ``fn``, captured ``calls`` times in a CUDA graph (after ``warmup`` eager
    calls on a side stream, as capture needs) and replayed ``replays`` times after ``warmup`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(warmup):
        graph.replay()
    return [t / calls for t in event_ms(graph.replay, replays, warmup=0)]
