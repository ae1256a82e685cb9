"""``Change``: what one acceleration did to a model, as the calls of ``accel/on_any_model.py`` return it and
``accelerate(model, example=...)`` decides it (``accel/timed_changes.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gallery_lib.accel.keep_if_faster import KeepDecision


@dataclass(frozen=True)
class Change:
    """What one acceleration did to a model."""

    name: str
    """The acceleration (``channels_last``, ``fused kernels``, ...)."""
    what: str
    """What changed on this model, counted (``swapped 4: geglu=4``); says so when nothing did."""
    why: str
    """The one-line reason it makes a step faster."""
    measured: str
    """Where the measurement behind it is (a ``benchmarks/RESULTS.md`` section)."""
    changed: bool = True
    """False when the model had nothing this acceleration acts on."""
    details: str = ""
    """More lines for a run's log (the modules a kernel swap left alone, and why)."""
    handle: Any = field(default=None, compare=False, repr=False)
    """What inspects the change, where there is one: the attention hook (its selector says which backend each
    attention shape ran), the kernel swap's ``PatchReport``."""
    undo: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    """Reverts the change (``None`` where it cannot be undone, or changed nothing)."""
    decision: KeepDecision | None = field(default=None, compare=False)
    """How ``accelerate(model, example=...)`` decided: the step times with and without the change (``None`` when it
    was not measured on this model)."""

    @property
    def note(self) -> str:
        """What a run's log keeps: the name, what changed, and the details."""
        return f"{self.name}: {self.what}" + (f"\n{self.details}" if self.details else "")

    def __str__(self) -> str:
        return f"{self.name}: {self.what}. Why: {self.why} ({self.measured})"
