"""Step timing without per-step host syncs.

``StepTimer.mark()`` records a boundary: a CUDA event on the current stream on a GPU, a wall-clock
reading on a CPU. Step ``i`` lasts from boundary ``i`` to ``i + 1``, so everything the step waits
for (data, forward, backward, optimizer, communication) is counted. ``collect()`` synchronizes on
the newest event only when the loop asks for numbers (its logging steps).
"""

from __future__ import annotations

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

    def collect(self) -> list[float]:
        """Durations in ms of the steps completed since the last call (syncs on the last mark)."""
        if len(self._marks) < 2:
            return []
        if self.cuda:
            self._marks[-1].synchronize()
            times = [a.elapsed_time(b) for a, b in zip(self._marks[:-1], self._marks[1:])]
        else:
            times = [(b - a) * 1e3 for a, b in zip(self._marks[:-1], self._marks[1:])]
        self._marks = self._marks[-1:]  # the newest boundary starts the next step
        return times


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
