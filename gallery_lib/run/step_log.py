"""The step log: per-step values kept on the device between logging steps, written in one host sync per interval.

Each step adds its loss (a device tensor), learning rate and skip flag (``record``); every ``log_every`` steps, at
the last step and before a checkpoint, ``flush`` reads them back with the interval's CUDA-event step times (the one
host sync), writes one ``metrics.jsonl`` record per step (rank 0) and prints one line. The step times and losses of
the whole run stay here for the summary. With several processes a step's loss is the mean of theirs (one all-reduce
per interval): the loss of the global batch, whatever the number of processes that share it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gallery_lib.accel.distributed import DistInfo, mean_over_ranks
from gallery_lib.run.metrics import MetricsWriter
from gallery_lib.run.timing import StepTimer, peak_memory_mb


class StepLog:
    def __init__(self, dist: DistInfo, writer: MetricsWriter | None, loader, *, steps: int, log_every: int,
                 global_batch_size: int, start: int, warmup_steps: int, log: Callable[[str], Any]) -> None:
        self.dist, self.writer, self.loader, self.log = dist, writer, loader, log
        self.steps, self.log_every, self.global_batch_size = steps, log_every, global_batch_size
        self.device = dist.device
        self.start, self.warmup_steps = start, warmup_steps
        self.step_times: list[float] = []
        """Milliseconds per step of this process's run, in order (warm-up steps first)."""
        self.losses: list[float] = []
        self._pending: list[tuple[torch.Tensor, float, bool | torch.Tensor]] = []
        self.restart_clock()

    def restart_clock(self) -> None:
        """The next step's time starts now (after a checkpoint save, which belongs to no step)."""
        self._timer = StepTimer(self.device)
        self._timer.mark()

    def between_steps(self, work: Callable[[], Any]) -> None:
        """Runs ``work`` after the step just recorded, in no step's time (the next step's clock starts after it)."""
        work()
        self._timer.gap()

    def record(self, loss: torch.Tensor, lr: float, skipped: bool | torch.Tensor) -> None:
        """Ends a step: keeps its values on the device and marks its end on the clock."""
        self._pending.append((loss.detach(), lr, skipped))
        self._timer.mark()

    def due(self, steps_done: int) -> bool:
        return steps_done % self.log_every == 0 or steps_done == self.steps

    def flush(self, steps_done: int) -> list[bool]:
        """Reads back and writes the pending steps (the last of which is step ``steps_done - 1``); returns their skip
        flags as bools."""
        times = self._timer.collect()  # the host sync of this logging interval
        losses, lrs, flags = zip(*self._pending)
        values = mean_over_ranks(torch.stack(losses).float(), self.dist).cpu().tolist()
        skips = [flag if isinstance(flag, bool) else bool(flag.item()) for flag in flags]
        peak = peak_memory_mb(self.device)
        batch = self.global_batch_size
        first = steps_done - len(values)
        for i, (loss, ms, lr, skipped) in enumerate(zip(values, times, lrs, skips)):
            record = {"type": "step", "step": first + i, "loss": loss, "lr": lr, "step_time_ms": ms,
                      "samples_per_s": batch * 1e3 / ms, "peak_mem_mb": peak,
                      "warmup": first + i - self.start < self.warmup_steps, "skipped_samples": self.loader.skipped,
                      "skipped_step": skipped}
            if self.writer:
                self.writer.write(record)
        self.step_times.extend(times)
        self.losses.extend(values)
        self._pending.clear()
        self.log(f"[gallery] step {steps_done}/{self.steps} | loss {values[-1]:.4f} | "
                 f"{batch * 1e3 / times[-1]:.1f} img/s | {times[-1]:.1f} ms/step | peak {peak / 1024:.2f} GiB"
                 f"{eta(times, self.steps - steps_done)}")
        return skips


def eta(interval_ms: list[float], steps_left: int) -> str:
    """`` | ETA m:ss`` for the steps left at this interval's median pace (warm-up intervals overestimate it: they
    hold the compilation); empty when nothing is left."""
    if steps_left <= 0 or not interval_ms:
        return ""
    seconds = round(sorted(interval_ms)[len(interval_ms) // 2] * steps_left / 1e3)
    hours, rest = divmod(seconds, 3600)
    return f" | ETA {hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f" | ETA {rest // 60}:{rest % 60:02d}"
