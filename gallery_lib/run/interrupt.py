"""A stop asked for while a run trains: Ctrl-C (SIGINT, which a terminal and a notebook's interrupt send to the whole
process group) or SIGTERM (a machine being taken back). The step under way finishes, its checkpoint is saved, and
the run stops with one line that says how to resume; a second signal stops it at once.

One training process only: the processes of a larger run would have to agree on the step to stop after, so torchrun
stops them as it always has (their periodic checkpoints stay).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path


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
        print(f"[gallery] {self.signal}: stopping after this step and saving it; {self.signal} again stops at once",
              flush=True)
        self.uninstall()  # the next signal takes its usual effect
