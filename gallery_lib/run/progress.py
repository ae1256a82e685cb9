"""A progress bar over a run's steps for the process that launched it (a notebook kernel or a terminal).

The training process prints one ``[gallery] step N/M | loss ... | ... img/s`` line per logging interval; the
launcher feeds rank 0's lines here, and a ``tqdm.auto`` bar moves to step N with the loss, the speed and tqdm's ETA.
In JupyterLab (and under papermill) ``tqdm.auto`` draws a widget, which adds one output to the cell however long the
run; in a terminal it redraws one line. Elsewhere (a pipe, a test) there is no bar: the step lines themselves, one
per ``log_every`` steps, are the progress.

When the run ends, a widget bar's plain-text copy (what a static viewer shows) is made to read the final state: the
step reached, the loss, the speed and the time taken (``data_prep/progress_bar.py``).
"""

from __future__ import annotations

import re
import sys
from typing import Any

from data_prep.progress_bar import close_bar, open_bar

_STEP_LINE = re.compile(r"^\[gallery\] step (\d+)/(\d+) \| loss (\S+) \| (\S+) img/s")


def wants_bar() -> bool:
    """A bar helps where it redraws in place: a Jupyter kernel or a terminal."""
    shell = sys.modules.get("IPython")
    if shell is not None and getattr(shell, "get_ipython", lambda: None)() is not None:
        return True
    return sys.stderr.isatty()


class StepProgress:
    """Feeds on the run's output lines; the bar appears with the first step line (its total and starting step, which
    is later than 0 for a resumed run, come from that line)."""

    def __init__(self, description: str, *, enabled: bool | None = None, **tqdm_kwargs: Any) -> None:
        self.description = description
        self.enabled = wants_bar() if enabled is None else enabled
        self.tqdm_kwargs = tqdm_kwargs
        self.bar = None
        self.display = None  # the widget bar's display handle, to show its final state in place

    def feed(self, line: str) -> None:
        match = _STEP_LINE.match(line) if self.enabled else None
        if match is None:
            return
        step, total = int(match[1]), int(match[2])
        if self.bar is None:
            self.bar, self.display = open_bar(total=total, desc=self.description, unit="step", dynamic_ncols=True,
                                              **self.tqdm_kwargs)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(f"loss {match[3]}, {match[4]} img/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            close_bar(self.bar, self.display)  # a widget's text copy now says where the run ended, not 0%
            self.display = None
