"""``accelerate(model, example=...)``'s rule: each change kept only where a timed training step is faster with it.

The changes come in ``accelerate``'s order as ``(label, call)`` pairs (``on_any_model._planned_changes``); each is
applied, timed against the state the changes before it left, and undone unless faster by more than ``min_gain``
(the fair peer's own choices the other way round: kept unless slower by more). Once the model is compiled, the
changes kept before the compiler are timed again under it, and those left out before it are tried once more under
what is compiled at the end. The times go to a cache keyed by the model, its inputs and the device, so the next call
times nothing. ``keep_if_faster.py`` holds the timing and the one-change rule.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch import nn

from gallery_lib.accel.change import Change
from gallery_lib.accel.keep_if_faster import KeepDecision, TrainingStep, faster, keep_if_faster
from gallery_lib.accel.optimize import cache_key, read_cache, write_cache


PEER_CHOICES = ("channels_last", "compiled whole")
"""The changes the fair peer makes on a model they suit (the labels they start): kept unless a step is slower with
them by more than ``min_gain``. Judged like the gallery's own changes, a tie went the other way: ConvNeXt-T's
channels_last gained 1.6% eagerly on an H100, was left out, and the compiled model ended 0.95x the peer, which has it
(RESULTS.md#your-model)."""


def _bar(label: str, min_gain: float) -> float:
    """The gain a change must show to be kept: ``min_gain``, or for one of the peer's own choices ``-min_gain`` (it
    stays unless it loses by more)."""
    return -min_gain if label.startswith(PEER_CHOICES) else min_gain


LAYOUT_CHANGES = {"channels_last"}
"""Changes decided before the compiler only: channels_last undone under the compiled resnet34 stopped its timed steps
with an Inductor stride assertion on an H200 (RESULTS.md#your-model; why, not found: a plain compiled convnet
switched between layouts ran fine)."""


def not_measured(change: Change) -> Change:
    """``change`` as applied without an example: saying it was not measured on this model."""
    if not change.changed:
        return change
    return replace(change, what=f"{change.what}; not measured on this model (accelerate(model, example=...) keeps it "
                   "only where a step is faster)")


def kept_if_faster(model: nn.Module, steps: list[tuple[str, Callable[[], Change]]], step: TrainingStep,
                   timer: Callable[[Callable[[], Any], torch.device], float], min_gain: float,
                   cache_path: os.PathLike | None, progress: Callable[[str], Any] | None = None) -> Iterator[Change]:
    """Each change in ``steps`` kept only where a ``step`` is faster with it than in the state before it; the times
    come from ``cache_path`` where it has them, else from ``timer``, and go there. Once the model is compiled, each
    change kept before the compiler is timed again under it, and left out where it no longer pays: a kernel that
    beats eager code can lose to the compiler's (a larger Swin's window attention: RESULTS.md#your-model). That is
    done before the whole model compiled is judged against the blocks (``RETIMED_BEFORE``), and again at the end
    where what is compiled changed since. Then each change left out before the compiler (a layout and a change that
    broke the step aside) is tried once more under what is compiled: an eager step can judge a kernel by other
    costs than the compiled one (Swin-S's LayerNorm kernel on an H100, unsteady eagerly, paid once compiled:
    RESULTS.md#your-model). The changes come out once all are decided."""
    key = cache_key(model, step.args, step.kwargs)  # the model as it came, before any change
    cached = read_cache(cache_path) if cache_path else {}
    kept: list[str] = []
    current_ms: float | None = None  # the step time of the state so far, once timed
    decided: list[Change] = []
    before_compiling: list[tuple[int, str, Callable[[], Change], Change]] = []  # kept before the compiler
    left_out_before_compiling: list[tuple[int, str, Callable[[], Change]]] = []
    timed_again_under: list[str] = []  # the compiled changes those were last timed under

    def time_step(state: str) -> float:
        started = time.perf_counter()
        ms = timer(step, step.device)
        if progress is not None:  # compiling makes a timing take minutes on a large model: say each as it ends
            progress(f"{state}: {ms:.1f} ms a step, timed in {time.perf_counter() - started:.1f} s")
        return ms

    def time_again_once_compiled() -> None:
        nonlocal current_ms
        compiled = [label for label in kept if label.startswith("compiled")]
        if not compiled or compiled == timed_again_under:
            return
        timed_again_under[:] = compiled
        where = f"{step.where}, once compiled"
        for position in reversed(range(len(before_compiling))):
            index, label, call, change = before_compiling[position]
            entry_key = f"{key} | {label} once compiled, after {', '.join(kept)}"
            entry = _timed_before(cached, entry_key)
            if entry is not None:
                decision = KeepDecision.from_cache(entry, min_gain)
                if not decision.kept:
                    change.undo()
            else:
                if current_ms is None:
                    current_ms = _time_the_example(lambda: time_step(f"with {_said(label)}, once compiled"))
                change.undo()
                without_ms = _time_the_example(lambda: time_step(f"without {_said(label)}, once compiled"))
                decision = KeepDecision(faster(current_ms, without_ms, min_gain), current_ms, without_ms)
                if cache_path:
                    write_cache(cache_path, entry_key, decision.cache_entry())
                if decision.kept:  # put back: the change the caller gets is the one in place
                    change = call()
                    before_compiling[position] = (index, label, call, change)
            if not decision.kept:
                kept.remove(label)
                del before_compiling[position]
                current_ms = None if decision.cached else decision.without_ms
            decided[index] = _decided(change, decision, where, min_gain, cache_path)

    def try_again_once_compiled() -> None:
        compiled = [label for label in kept if label.startswith("compiled")]
        if not compiled:
            return
        where = f"{step.where}, once compiled"
        for index, label, call in left_out_before_compiling:
            entry_key = f"{key} | {label} left out before the compiler, tried once compiled, after {', '.join(kept)}"
            change, decision = judged(label, call, call(), entry_key, min_gain, "without", ", once compiled")
            if decision.kept:
                kept.append(label)
            decided[index] = _decided(change, replace(decision, applied=None), where, min_gain, cache_path)

    def judged(label: str, call: Callable[[], Change], change: Change, entry_key: str, bar: float, before: str,
               said_where: str = "") -> tuple[Change, KeepDecision]:
        """``change`` (just applied by ``call``) kept only where the step is faster with it than in the state so far
        (``current_ms``, timed first where it is not yet): the times from the cache where it has them, else timed and
        cached. Returns the change in place (applied again where the state before it had to be timed)."""
        nonlocal current_ms
        entry = _timed_before(cached, entry_key)
        if entry is not None:
            decision = KeepDecision.from_cache(entry, bar)
            if not decision.kept:
                change.undo()
            # a kept change's cached time is another run's: time this state again where a later change needs it
            current_ms = None if decision.kept else current_ms
            return change, decision
        if current_ms is None:  # the state before this change is not timed yet
            change.undo()
            current_ms = _time_the_example(lambda: time_step(f"{before} {_said(label)}{said_where}"))
            change = call()
        # applied (to see whether it changed anything): keep_if_faster times it, and undoes it if not faster
        decision = keep_if_faster(lambda applied=change: applied, lambda applied: applied.undo(),
                                  lambda: time_step(f"with {_said(label)}{said_where}"), without_ms=current_ms,
                                  min_gain=bar)
        if cache_path:
            write_cache(cache_path, entry_key, decision.cache_entry())
        if decision.kept:
            current_ms = decision.with_ms
        return change, decision

    with step.leaving_the_model_as_it_was():
        for label, call in steps:
            if label.startswith(RETIMED_BEFORE):
                time_again_once_compiled()
            entry_key = f"{key} | {label} after {', '.join(kept) or 'nothing'}"
            bar = _bar(label, min_gain)
            change = call()
            if not change.changed:
                decided.append(change)
                continue
            if change.undo is None:  # nothing to compare it with: applied as without an example
                decided.append(not_measured(change))
                continue
            change, decision = judged(label, call, change, entry_key, bar, "before")
            if not label.startswith("compiled") and label not in LAYOUT_CHANGES:
                if decision.kept:
                    before_compiling.append((len(decided), label, call, change))
                elif decision.error is None:
                    left_out_before_compiling.append((len(decided), label, call))
            if decision.kept:
                kept.append(label)
            decided.append(_decided(change, replace(decision, applied=None), step.where, bar, cache_path))
        time_again_once_compiled()
        try_again_once_compiled()
    yield from decided


RETIMED_BEFORE = ("compiled whole",)
"""The compiled changes tried only once the changes kept before the compiler are timed again under what is compiled
so far: on ConvNeXt-T (an H100) the whole model compiled lost to the blocks, 34.1 against 32.6 ms, with a LayerNorm
kernel in it that the blocks then left out, where the peer's whole model without it ran ahead
(RESULTS.md#your-model)."""


def _said(label: str) -> str:
    """A step's label as a progress line says it: ``fused kernels layer_norm``, ``compiled whole reduce-overhead``,
    ``compiled blocks`` (on a CPU, where the mode is ``None``)."""
    return label.removesuffix(" None")


def _timed_before(cached: dict[str, Any], entry_key: str) -> dict[str, Any] | None:
    """The cached times of ``entry_key``; ``None`` where there are none, or another version's: time it."""
    entry = cached.get(entry_key)
    return entry if isinstance(entry, dict) and "without_ms" in entry else None


def _time_the_example(time_step: Callable[[], float]) -> float:
    """Times the state the changes kept so far; a step failing there is the example's fault, and said so."""
    try:
        return time_step()
    except Exception as exc:
        if str(exc).startswith("accelerate:"):  # TrainingStep's own message
            raise
        message = (f"accelerate: a training step on the example failed ({type(exc).__name__}: {exc}). example= is "
                   "what the model is called with: a tensor, a tuple of positional arguments or a dict of keyword "
                   "arguments (of an (inputs, labels) batch pass the inputs, and use the labels in loss_fn)")
        try:
            said = type(exc)(message)
        except Exception:  # an exception type that takes other arguments
            said = RuntimeError(message)
        raise said from exc


def _decided(change: Change, decision: KeepDecision, where: str, min_gain: float,
             cache_path: os.PathLike | None) -> Change:
    """``change`` as the decision left it: kept, with both times after what it did; or left out, said with both times
    (what it would have done in the details). ``min_gain`` is the bar it was judged by (below zero for the peer's own
    choices)."""
    verdict = decision.verdict(where)
    details = [change.details] if change.details else []
    if decision.cached:
        details.append(f"  times cached in {cache_path}; delete the entry or pass cache=False to time again")
    peers_rule = f"the peer's own choice, left out only where it makes a step over {-100 * min_gain:g}% slower"
    if decision.kept:
        if min_gain < 0 and decision.with_ms > decision.without_ms:  # a tie, kept where the peer is
            verdict = f"{verdict}; {peers_rule}"
        return replace(change, what=f"{change.what}; {verdict}", details="\n".join(details), decision=decision)
    why = (f"kept only where it makes a step over {100 * min_gain:g}% faster; where it does: {change.why}"
           if min_gain >= 0 else f"{peers_rule}; where it pays: {change.why}")
    return replace(change, what=verdict, why=why, changed=False, handle=None, undo=None, decision=decision,
                   details="\n".join([f"  undone: {change.what}", *details]))
