"""A stop asked for while a run trains: Ctrl-C (SIGINT, which a terminal and a notebook's interrupt send to the whole
process group) or SIGTERM (a machine being taken back). The step under way finishes, its checkpoint is saved, and
the run stops with one line that says how to resume; a second signal stops it at once.

In a run of several processes torchrun passes the signal on to each (they run in sessions of their own), and they must
stop after the same step, since saving it takes all of them: ``AgreedStop`` asks the others, without a step waiting for
the answer.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist


STOP_ASKED = "again stops at once"
"""How the line a training process prints on a first signal ends (``StopRequest``): a launcher that saw it, and then
no saved step, knows a second signal stopped the process, though its own two Ctrl-C may have come as one."""


class Interrupted(Exception):
    """The run stopped on a signal after ``step`` of ``steps``, its state saved to ``saved_to``."""

    def __init__(self, why: str, step: int, steps: int, saved_to: Path | None) -> None:
        where = (f", its state saved in {saved_to}: run it again with resume=True (--resume, --set resume=true) to go "
                 "on") if saved_to else ""
        super().__init__(f"interrupted ({why}) after step {step} of {steps}{where}")
        self.step = step


class StopRequest:
    """Set by SIGINT or SIGTERM once ``install``ed; the loop reads ``requested`` after each step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.stops_after = "this step"
        """What the first signal's line says the run finishes before it stops."""
        self._previous: dict[int, object] = {}
        self._pid: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> None:
        """Catches the signals from now on (in the main thread only, where Python runs signal handlers)."""
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: it keeps loading the batches the step needs
            return
        self.signal = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"[gallery] {self.signal}: stopping after {self.stops_after} and saving it; {self.signal} {STOP_ASKED}",
              flush=True)
        self.uninstall()  # the next signal takes its usual effect


class AgreedStop:
    """Whether a run stops after the step that just ended, the same answer in each of its processes.

    One process: whether a stop was asked for. Several: whether any of them had been asked one step earlier. After
    each step a process adds what it was asked to a MAX all-reduce on a gloo group of their own, and reads the result
    of the one it started a step before, which has long finished: no step waits on the others' host, and every process
    reads the same answer after the same step. The stop comes a step later than in a run of one process.
    """

    def __init__(self, request: StopRequest, world_size: int) -> None:
        self.request = request
        self._group = _host_group() if world_size > 1 else None
        if self._group is not None:
            request.stops_after = "the next step"
        self._flag: torch.Tensor | None = None
        self._pending = None

    def after_step(self) -> bool:
        """Called by every process after each step: whether they all stop now."""
        if self._group is None:
            return self.request.requested
        agreed = self._read()
        self._flag = torch.tensor([int(self.request.requested)], dtype=torch.int32)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def close(self) -> None:
        """Waits for the last all-reduce (the run's last step started it), so none is left running at shutdown."""
        self._read()

    def _read(self) -> bool:
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._flag.item())


@functools.cache
def _host_group():
    """A gloo group beside the run's own (NCCL's, or gloo's that DDP's buckets use), created once per process by
    every process in the same order, as ``new_group`` requires."""
    return dist.new_group(backend="gloo")
