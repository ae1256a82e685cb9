"""Python's garbage collector around the timed steps.

A full collection walks every object the process holds, and compiling leaves hundreds of thousands of them (the
graphs, their guards and generated code): in DreamBooth's warm-up on a CPU each took 210 ms (median; 359 at most) with
650k objects tracked (benchmarks/results/gc_pauses_cpu/). One of them in the timed steps would be one slow step, the
suspect for SD-1.5's `accelerated` logging its 10th step at 191 ms against a median of 81 on an H100
(benchmarks/RESULTS.md#memory-plan). So at the end of the warm-up the loop collects once and freezes what is left
(``gc.freeze``, as inference servers do once their CUDA graphs are captured): later collections walk only what the
steps allocate. The pause falls between two steps, in neither's time (``StepLog.between_steps``); the collections in
the timed steps are counted for the summary, and the objects are handed back to the collector when the loop ends
(``gc.unfreeze``), so a process that trains again frees what they hold.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class TimedStepsCollector:
    """Freezes what the warm-up left (``freeze``), then counts the collector's pauses until ``close``."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        """Collections in the timed steps, by generation (2: full)."""
        self.pause_ms = 0.0
        self.frozen = 0
        """Objects frozen at the end of the warm-up."""
        self._started: float | None = None
        self._watching = False

    def freeze(self) -> None:
        """Collects the warm-up's garbage, freezes what survives and starts counting (once)."""
        if not self._watching:
            gc.collect()
            gc.freeze()
            self.frozen = gc.get_freeze_count()
            gc.callbacks.append(self._count)
            self._watching = True

    def close(self) -> None:
        """Stops counting and gives the frozen objects back to the collector (once frozen; again, nothing)."""
        if self._watching:
            gc.callbacks.remove(self._count)
            gc.unfreeze()
            self._watching = False

    def summary(self) -> dict[str, Any]:
        """For the run's summary: the full collections in the timed steps and every collection's pause, in ms."""
        return {"gc_full_collections": self.collections[2], "gc_pause_ms": round(self.pause_ms, 1),
                "gc_frozen_objects": self.frozen}

    def _count(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.collections[info["generation"]] += 1
            self.pause_ms += (time.perf_counter() - self._started) * 1e3
            self._started = None
