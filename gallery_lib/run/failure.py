"""Why a run stopped, in one line a person reads: written by the training process, read by the launcher and reports.

A run that stops with an error leaves ``failure.json`` in its folder: the kind of failure (``nonfinite``,
``out_of_memory``, ``error``), a short reason ("loss not finite from step 1"), the first step it concerns and the log
to read. ``launch`` raises ``RunFailed`` carrying it, and the notebooks, reports and the ladder show it as one line:
``accelerated: stopped, loss not finite from step 1, see output/.../logs/rank0.log``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from gallery_lib.config.settings import ConfigError
from gallery_lib.run.interrupt import Interrupted
from gallery_lib.run.memory_plan import DoesNotFit, OutOfMemory

FAILURE_FILE = "failure.json"
STOPPED_PREFIX = "[gallery] stopped, "
"""How the training process's last console line starts when it stopped on an error it recorded: the launcher
echoes nothing from there on (torchrun's own report of the failed process follows it)."""
RESTARTED_PREFIX = "[gallery] torchrun restart "
"""How the first line of workers that torchrun restarted (``max_restarts``) starts: the launcher echoes again."""


@dataclass(frozen=True)
class RunFailure:
    kind: str
    """``nonfinite``, ``out_of_memory``, ``does_not_fit`` (refused before it started, or every setting the memory plan
    probed ran out of memory before its timed steps), ``interrupted`` (Ctrl-C or SIGTERM, the state saved), ``killed``,
    ``in_use`` (another launch was training in the run's folder) or ``error``."""
    reason: str
    """A clause short enough for one line: ``loss not finite from step 1``, ``out of memory``, the error's last line."""
    log: str | None = None
    """The log that tells more (rank 0's, or the failing rank's)."""
    first_step: int | None = None
    """The step the failure concerns (the first non-finite loss), numbered as ``metrics.jsonl`` numbers them."""

    def line(self, name: str) -> str:
        """``<name>: stopped, <reason>, see <log>``; a run refused before it started, too large for the GPU, is no
        stopped run: ``<name>: does not fit in 16.0 GiB: ...``."""
        if self.kind == "does_not_fit":
            return f"{name}: {self.reason.rstrip(' .')}"
        return f"{name}: stopped, {self.reason.rstrip(' .')}" + (f", see {self.log}" if self.log else "")

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / FAILURE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")
        return path


def read_failure(run_dir: str | Path) -> RunFailure | None:
    """The failure the run in ``run_dir`` recorded, or ``None`` (it finished, still runs, or was never started)."""
    path = Path(run_dir) / FAILURE_FILE
    if not path.is_file():
        return None
    try:
        return RunFailure(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError):  # a file cut short by a crash still says the run failed
        return RunFailure("error", f"failed ({FAILURE_FILE} unreadable)")


def clear_failure(run_dir: str | Path) -> None:
    """Forgets an earlier attempt's failure when the run starts again."""
    (Path(run_dir) / FAILURE_FILE).unlink(missing_ok=True)


def failure_from_exception(exc: BaseException, log: str | Path | None) -> RunFailure:
    """The failure an exception raised in the training process stands for."""
    first_step = getattr(exc, "first_step", None)
    if first_step is not None:  # NonfiniteLossError
        return RunFailure("nonfinite", f"loss not finite from step {first_step}", _str(log), first_step)
    if isinstance(exc, Interrupted):  # stopped on a signal, its state saved: how to go on, in one line
        return RunFailure("interrupted", str(exc), _str(log), exc.step)
    if isinstance(exc, DoesNotFit):  # every setting the plan probed ran out of memory: too large, not broken
        return RunFailure("does_not_fit", " ".join(str(exc).split()))
    if isinstance(exc, OutOfMemory):  # the step, the memory in use and the setting to try: kept whole
        return RunFailure("out_of_memory", str(exc), _str(log), exc.step)
    if isinstance(exc, ConfigError) or getattr(exc, "for_the_user", False):  # says its fix: kept whole, one line
        return RunFailure("error", f"{type(exc).__name__}: {' '.join(str(exc).split())}", _str(log))
    return failure_from_text(f"{type(exc).__name__}: {exc}", log)


def failure_from_text(text: str, log: str | Path | None, exit_code: int | None = None) -> RunFailure:
    """The failure a process's last output stands for, when it left no ``failure.json`` (it was killed, say)."""
    if "out of memory" in text.lower() or "OutOfMemoryError" in text:
        return RunFailure("out_of_memory", "out of memory", _str(log))
    if exit_code == -9:  # what the kernel's out-of-memory killer sends: no Python error, no line in the log
        return RunFailure("killed", "killed by signal 9 (SIGKILL), most often by the system's out-of-memory killer "
                                    "when the machine's memory runs out", _str(log))
    if exit_code is not None and exit_code < 0:
        return RunFailure("killed", f"killed by signal {-exit_code}", _str(log))
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    reason = errors[-1] if errors else (text.strip().splitlines() or [f"exit code {exit_code}"])[-1]  # whole
    return RunFailure("error", reason, _str(log))


def _str(path: str | Path | None) -> str | None:
    return None if path is None else str(path)


class RunsFailed(RuntimeError):
    """Runs stopped: raised once everything that ran has been shown (the last cell of a notebook), so that a gallery
    with a stopped run is not green. Jupyter shows its lines, one per run, and no traceback."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines

    def _render_traceback_(self) -> list[str]:  # IPython's hook for an exception's own rendering
        return [f"{type(self).__name__}: {line}" for line in self.lines]
