"""Keep a change to a model only where a training step measures faster with it: this model, these shapes, this device.

``keep_if_faster(apply, undo, time_step)`` times a step without the change (unless told that time), applies it, times
a step with it, and undoes it unless it is faster by more than ``MIN_GAIN``; the ``KeepDecision`` holds both times.
``accelerate(model, example=...)`` (``accel/timed_changes.py``) runs each of its changes through it, in order, each
against the state before it; a family's pipeline can do the same for one of its switches.

A step is ``TrainingStep``: the model called on an example batch, a loss, and the backward pass (no optimizer step, so
the weights do not move); it leaves the gradients, buffers (BatchNorm's running statistics) and random state as they
were. ``SteadyStepTimer`` times it as ``optimize`` times its candidates (``optimize.step_mark``, ``step_stats``): CUDA
events on a GPU, ``time.perf_counter`` on a CPU, the median after warm-up steps; its ``clock`` can be replaced (tests).
``accelerate`` caches the times as ``optimize`` caches its choices (``optimize.cache_key``, ``read_cache``,
``write_cache``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch
from torch import nn

from gallery_lib.accel.optimize import default_timing_steps, step_mark, step_stats

T = TypeVar("T")

# A change must make the step more than 2% faster to be kept. The same work timed twice on an H200 differs by 0.3%
# (medians of 35 steps: ViT-B's compiled blocks and accelerate(model), the same graphs there, 38.5 and 38.6 ms;
# DreamBooth's peer on two machines, 46.5 and 46.6 ms: benchmarks/RESULTS.md#your-model, #dreambooth), one step's
# p20-p80 spread is about 3%, and the gains the changes are for start at 6% (LayerNorm's kernel on ViT-B, eager) and
# reach 1.28x (Swin-S's window attention). A tie leaves the model as it was.
MIN_GAIN = 0.02


@dataclass(frozen=True)
class KeepDecision(Generic[T]):
    """Whether a change was kept, and the step times (ms) it was judged by."""

    kept: bool
    with_ms: float | None
    """The step's median with the change; ``None`` when the step failed with it (``error``)."""
    without_ms: float
    error: str | None = None
    cached: bool = False
    """The times came from the cache, not from steps timed now."""
    applied: T | None = field(default=None, compare=False, repr=False)
    """What ``apply`` returned (kept or undone)."""

    def verdict(self, where: str) -> str:
        """``kept: 35.9 ms with it, 41.2 ms without (where)``, or ``left out: ...``."""
        where = f"{where}; cached" if self.cached else where
        if self.error is not None:
            return f"left out: the step failed with it ({self.error}); {self.without_ms:.1f} ms without ({where})"
        return (f"{'kept' if self.kept else 'left out'}: {self.with_ms:.1f} ms with it, {self.without_ms:.1f} ms "
                f"without ({where})")

    def cache_entry(self) -> dict[str, Any]:
        return {"with_ms": self.with_ms, "without_ms": self.without_ms, "error": self.error,
                "measured": time.strftime("%Y-%m-%d %H:%M")}

    @classmethod
    def from_cache(cls, entry: dict[str, Any], min_gain: float = MIN_GAIN) -> KeepDecision:
        """The decision the cached times give under ``min_gain`` (the times are cached, not the verdict)."""
        with_ms, without_ms, error = entry["with_ms"], entry["without_ms"], entry.get("error")
        kept = error is None and faster(with_ms, without_ms, min_gain)
        return cls(kept, with_ms, without_ms, error, cached=True)


def faster(with_ms: float, without_ms: float, min_gain: float = MIN_GAIN) -> bool:
    """Whether ``with_ms`` beats ``without_ms`` by more than ``min_gain`` (a fraction of ``with_ms``)."""
    return without_ms > with_ms * (1 + min_gain)


def keep_if_faster(apply: Callable[[], T], undo: Callable[[T], Any], time_step: Callable[[], float], *,
                   without_ms: float | None = None, min_gain: float = MIN_GAIN) -> KeepDecision[T]:
    """Applies a change and keeps it only if a step is faster with it by more than ``min_gain``.

    Args:
        apply: makes the change; what it returns is passed to ``undo`` (and kept in the decision's ``applied``).
        undo: reverts the change, given what ``apply`` returned.
        time_step: the current state's step time in ms (``SteadyStepTimer`` over a ``TrainingStep``).
        without_ms: the step time before the change, where it is known (a chain of changes times each state once);
            timed before ``apply`` when not given.
        min_gain: the gain below which the change is undone (``MIN_GAIN``, the comment above it says why).

    A step that fails with the change (a kernel that does not compile, say) undoes it; the decision says why.

        decision = keep_if_faster(lambda: hook_swin_attention(model), lambda hook: hook.remove(),
                                  lambda: SteadyStepTimer()(step, device))
    """
    if without_ms is None:
        without_ms = time_step()
    applied = apply()
    try:
        with_ms = time_step()
    except Exception as exc:  # noqa: BLE001 - a change that breaks the step is left out, like a slow one
        undo(applied)
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
        return KeepDecision(False, None, without_ms, error, applied=applied)
    kept = faster(with_ms, without_ms, min_gain)
    if not kept:
        undo(applied)
    return KeepDecision(kept, with_ms, without_ms, applied=applied)


@dataclass(frozen=True)
class SteadyStepTimer:
    """Runs a step ``warmup_steps + timing_steps`` times and returns the median ms of the timed ones (``timing_steps``
    by default as ``optimize``'s: 10 on a GPU, 4 on a CPU).

    The warm-up covers compilation (the first step) and CUDA graph capture (the next ones), as ``optimize``'s trials
    do. On a GPU the steps are timed with CUDA events, without a sync between steps; elsewhere with
    ``time.perf_counter``. ``clock`` (seconds) replaces both: tests pass one the steps themselves advance.
    """

    warmup_steps: int = 3
    timing_steps: int | None = None
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 1 or (self.timing_steps is not None and self.timing_steps < 2):
            raise ValueError("SteadyStepTimer: warmup_steps must be >= 1 (the first step compiles) and timing_steps "
                             ">= 2 (a median and its spread)")

    def __call__(self, step: Callable[[], Any], device: torch.device) -> float:
        on_cuda = device.type == "cuda" and self.clock is None
        clock = self.clock or time.perf_counter
        marks = [step_mark(on_cuda, clock)]
        timing_steps = self.timing_steps or default_timing_steps(device.type == "cuda")
        for _ in range(self.warmup_steps + timing_steps):
            step()
            marks.append(step_mark(on_cuda, clock))
        return step_stats("step", marks, self.warmup_steps).steady_ms


class TrainingStep:
    """One training step of ``model`` on an example: ``loss_fn(model(*args, **kwargs)).backward()``.

    ``example`` is what the model is called with: a tensor, a tuple of positional arguments or a dict of keyword
    arguments. ``loss_fn`` turns the output into the scalar loss (default: the mean of a tensor output; the loss's own
    cost is small beside the model's). Gradients are dropped after each step (``zero_grad(set_to_none=True)``, as a
    loop does), and no optimizer steps. Where the model's 4-D weights are channels_last, 4-D inputs are fed in that
    layout too, as ``use_channels_last`` asks of a loop.
    """

    def __init__(self, model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> None:
        if isinstance(example, torch.Tensor):
            self.args, self.kwargs = (example,), {}
        elif isinstance(example, (tuple, list)):
            self.args, self.kwargs = tuple(example), {}
        elif isinstance(example, dict):
            self.args, self.kwargs = (), dict(example)
        else:
            raise TypeError(f"accelerate: example= is what the model is called with (a tensor, a tuple of positional "
                            f"arguments or a dict of keyword arguments), got {type(example).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"accelerate: loss_fn= turns the model's output into a scalar loss (a callable), got "
                            f"{type(loss_fn).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"accelerate: {type(model).__name__} has no parameter that requires grad, so it has no "
                             "training step to time; leave example= out")
        self.model, self.loss_fn, self.device = model, loss_fn, params[0].device
        tensors = [t for t in (*self.args, *self.kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise TypeError("accelerate: example= holds no tensor; pass the batch the model is called with")
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"accelerate: the example is on {t.device} but the model is on {self.device}; move "
                                 f"one to the other (model.to('{t.device}') or x.to('{self.device}')) so the steps are "
                                 "timed where training runs")
        self.batch = tensors[0].shape[0] if tensors[0].dim() else 1
        self._layout_weights = [p for p in model.parameters() if p.dim() == 4]
        self._checked = False

    @property
    def where(self) -> str:
        """What the times hold for, as a decision says it: ``this model, batch 64, cuda``."""
        return f"this model, batch {self.batch}, {self.device.type}"

    def __call__(self) -> None:
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are no longer read
        args = self.args
        if any(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
               for p in self._layout_weights):
            args = tuple(a.contiguous(memory_format=torch.channels_last)
                         if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)
        with torch.enable_grad():
            output = self.model(*args, **self.kwargs)
            loss = self._loss(output)
            loss.backward()
        self.model.zero_grad(set_to_none=True)

    def _loss(self, output: Any) -> torch.Tensor:
        if self.loss_fn is None:
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"accelerate: the model returned a {type(output).__name__}, not a tensor; pass "
                                "loss_fn= that turns it into the scalar loss, e.g. loss_fn=lambda out: "
                                "out.sample.square().mean()")
            return output.float().mean()
        loss = self.loss_fn(output)
        if not self._checked:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(f"accelerate: loss_fn returned {shape}; it must return the scalar loss a loop "
                                 "calls .backward() on")
            if not loss.requires_grad:
                raise ValueError("accelerate: loss_fn's loss does not depend on the model's output; compute it from "
                                 "the output it is given")
            self._checked = True
        return loss

    @contextlib.contextmanager
    def leaving_the_model_as_it_was(self) -> Iterator[None]:
        """Restores, on exit, what the timed steps change: the gradients, the buffers (BatchNorm's running
        statistics, by name: the changes keep ``state_dict`` keys) and the random state (dropout's draws)."""
        grads = {p: p.grad for p in self.model.parameters()}
        self.model.zero_grad(set_to_none=True)  # else the first backward adds into the gradients kept here
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                yield
        finally:
            with torch.no_grad():
                for name, saved in buffers.items():
                    self.model.get_buffer(name).copy_(saved)
            for p, grad in grads.items():
                p.grad = grad
