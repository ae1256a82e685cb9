"""Step timing without per-step host syncs.

``StepTimer.mark()`` records a boundary: a CUDA event on the current stream on a GPU, a wall-clock
reading on a CPU. Step ``i`` lasts from boundary ``i`` to ``i + 1``, so everything the step waits
for (data, forward, backward, optimizer, communication) is counted. ``collect()`` synchronizes on
the newest event only when the loop asks for numbers (its logging steps).
"""

from __future__ import annotations

import math
import resource
import statistics
import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._collected = 0

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def gap(self) -> None:
        """What ran since the last mark belongs to no step: the next step starts at a new mark."""
        self._marks.append(_GAP)
        self.mark()

    def collect(self) -> list[float]:
        """Durations in ms of the steps completed since the last call (syncs on the last mark)."""
        if len(self._marks) < 2:
            return []
        pairs = [(a, b) for a, b in zip(self._marks[:-1], self._marks[1:]) if a is not _GAP and b is not _GAP]
        if self.cuda:
            self._marks[-1].synchronize()
            times = [a.elapsed_time(b) for a, b in pairs]
        else:
            times = [(b - a) * 1e3 for a, b in pairs]
        self._marks = self._marks[-1:]  # the newest boundary starts the next step
        return times


_GAP = object()
"""A mark's place between two steps whose gap belongs to neither (``StepTimer.gap``)."""


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors; on a CPU, the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_reserved_mb(device: torch.device) -> float | None:
    """Peak CUDA memory the caching allocator held (what must fit on the card); None on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new CUDA peak, so a run reports its own even after others in the same process (a batch-size
    search's trials); a CPU's peak resident set size cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def summarize_times(times_ms: list[float]) -> dict[str, float]:
    """Median and 20th/80th percentiles (``statistics.quantiles`` with inclusive method)."""
    if not times_ms:
        return {"median_step_time_ms": float("nan"), "p20_step_time_ms": float("nan"),
                "p80_step_time_ms": float("nan")}
    if len(times_ms) == 1:
        q20 = q80 = times_ms[0]
    else:
        deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
        q20, q80 = deciles[1], deciles[7]
    return {"median_step_time_ms": statistics.median(times_ms), "p20_step_time_ms": q20, "p80_step_time_ms": q80}


def seconds_to_steady(warmup_times_ms: list[float], median_ms: float, tolerance: float = 0.1) -> float:
    """Seconds of warm-up steps until the run is at steady speed: every step up to the last one slower than
    ``1 + tolerance`` times the timed steps' median counts (compilation, cache loads, CUDA-graph capture, autotuning),
    the steady steps after it do not. All of them when the median is unknown."""
    if math.isnan(median_ms):  # no timed step
        return sum(warmup_times_ms) / 1e3
    slow = [i for i, t in enumerate(warmup_times_ms) if t > (1 + tolerance) * median_ms]
    return sum(warmup_times_ms[:slow[-1] + 1]) / 1e3 if slow else 0.0
