"""The one-line accelerator for a plain PyTorch loop: ``model = gallery_lib.optimize(model, example_step=step).target``.

It picks a torch.compile configuration by timing the real training step.

``optimize(model, example_step=step)`` tries each candidate configuration (eager, inductor, inductor
with CUDA graphs, max-autotune without CUDA graphs), runs the caller's own training step a few times
with it, keeps the fastest and logs the choice, each candidate's compile time and steady ms/step and
why. A candidate that fails to compile or run is skipped with a warning that carries the reason; eager
is the last resort. Compile time (the warm-up steps beyond their steady cost) is always reported apart
from the steady speed.

``regional=True`` compiles the model's repeated blocks in place instead (``accel/compile.py``).

The timed steps are real training steps (they update the weights); ``OptimizeResult.steps_run`` says
how many ran, so the training loop can count them.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from gallery_lib.accel.compile import regional_compile

_MIN_GAIN = 0.01  # a compiled candidate must beat eager by 1%, or eager is kept (fewer recompiles and surprises)


@dataclass(frozen=True)
class Candidate:
    """A way to run the model: ``options`` for ``torch.compile`` (``None``: eager), or a custom ``wrap``."""

    name: str
    options: dict[str, Any] | None = None
    wrap: Callable[[Any], Any] | None = None
    cuda_only: bool = False


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("eager"),
        Candidate("inductor", {"backend": "inductor"}),
        Candidate("inductor-cudagraphs", {"backend": "inductor", "mode": "reduce-overhead"}, cuda_only=True),
        Candidate("max-autotune-no-cudagraphs", {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
                  cuda_only=True),
        Candidate("aot_eager", {"backend": "aot_eager"}),  # tracing without code generation: a cheap debug check
    )
}
_AUTO_CUDA = ("eager", "inductor", "inductor-cudagraphs", "max-autotune-no-cudagraphs")
_AUTO_CPU = ("eager", "inductor")


@dataclass
class CandidateResult:
    """How one candidate did; times are ``None`` when it failed (see ``error``)."""

    name: str
    ok: bool
    warmup_time_s: float | None = None
    compile_time_s: float | None = None
    steady_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    error: str | None = None


@dataclass
class OptimizeResult:
    """What ``optimize`` chose. ``target`` is the model (or step function) to train with from now on."""

    target: Any
    choice: str
    reason: str
    compile_time_s: float | None
    steady_ms: float | None
    candidates: list[CandidateResult] = field(default_factory=list)
    steps_run: int = 0
    regional_modules: list[str] = field(default_factory=list)


def optimize(
    model_or_step_fn: nn.Module | Callable[[], Any],
    *,
    backend: str = "auto",
    example_step: Callable[[Any], Any] | None = None,
    candidates: Iterable[str | Candidate] | None = None,
    regional: bool = False,
    block_types: Iterable[type | str] | None = None,
    warmup_steps: int = 3,
    timing_steps: int = 5,
    log: Callable[[str], Any] = print,
) -> OptimizeResult:
    """Chooses how to run a model (or a whole training-step function) by timing the real step.

    Args:
        model_or_step_fn: an ``nn.Module``, or a zero-argument function that runs one training step.
        backend: ``"auto"`` (time the candidates, keep the fastest) or one candidate name from ``CANDIDATES``.
        example_step: for a module, ``example_step(model)`` runs one real training step (forward, backward,
            optimizer) with the model it is given; needed for ``auto``. Ignored for a step function.
        candidates: names or ``Candidate`` objects to try in ``auto`` (default: the four main ones on CUDA,
            eager and inductor on a CPU).
        regional: compile the repeated blocks in place (``regional_compile``) instead of the whole model.
        block_types: the blocks ``regional`` compiles (default: every registered family's).
        warmup_steps: steps run before timing (they include compilation, autotuning and CUDA-graph capture).
        timing_steps: steps timed for the steady ms/step (median).
        log: where the choice and the timings are written.
    """
    is_module = isinstance(model_or_step_fn, nn.Module)
    if not is_module and not callable(model_or_step_fn):
        raise TypeError(f"optimize: expected an nn.Module or a step function, got {type(model_or_step_fn).__name__}")
    if regional and not is_module:
        raise ValueError("optimize: regional=True needs the nn.Module (its blocks are compiled in place)")
    if backend != "auto" and backend not in CANDIDATES:
        raise ValueError(f"optimize: unknown backend {backend!r}; use 'auto' or one of {sorted(CANDIDATES)}")
    if backend == "auto" and is_module and example_step is None:
        raise ValueError("optimize(backend='auto') times the real training step: pass example_step=fn, where "
                         "fn(model) runs forward, backward and the optimizer step")
    if warmup_steps < 1 or timing_steps < 1:
        raise ValueError("optimize: warmup_steps and timing_steps must be >= 1 (the first step compiles)")

    on_cuda = _on_cuda(model_or_step_fn)
    if backend == "auto":
        names = list(candidates) if candidates is not None else list(_AUTO_CUDA if on_cuda else _AUTO_CPU)
        if candidates is None and not on_cuda:
            log("optimize: on a CPU only eager and inductor are tried (CUDA graphs and autotuning need a GPU)")
    else:
        names = [backend]
    cands = [c if isinstance(c, Candidate) else _candidate(c) for c in names]
    if not on_cuda:
        cands = [c for c in cands if not c.cuda_only]

    run = (lambda obj: example_step(obj)) if is_module else (lambda obj: obj())
    timed = example_step is not None or not is_module
    results: list[CandidateResult] = []
    built: dict[str, Any] = {}
    steps_run = 0
    for cand in cands:
        try:
            obj, regional_state = _build(cand, model_or_step_fn, regional, block_types)
        except Exception as e:  # noqa: BLE001 - any compile failure means: skip this candidate
            results.append(_failed(cand, e))
            continue
        if not timed:
            built[cand.name] = (obj, regional_state)
            results.append(CandidateResult(cand.name, ok=True))
            continue
        try:
            res, n = _time_candidate(cand, obj, run, warmup_steps, timing_steps, on_cuda)
        except Exception as e:  # noqa: BLE001
            steps_run += warmup_steps  # upper bound: a failing step may have updated the weights
            results.append(_failed(cand, e))
            _stash_regional(model_or_step_fn, regional_state)
            continue
        steps_run += n
        results.append(res)
        built[cand.name] = (obj, _stash_regional(model_or_step_fn, regional_state))
        log(f"optimize: {cand.name:<28} compile {res.compile_time_s:7.1f} s   steady {res.steady_ms:9.2f} ms/step "
            f"(p20 {res.p20_ms:.2f}, p80 {res.p80_ms:.2f})")

    choice, reason = _choose(results, timed)
    if choice is None:
        warnings.warn("optimize: every candidate failed; running eagerly", stacklevel=2)
        obj, regional_state, choice = model_or_step_fn, None, "eager"
        reason = "every candidate failed: " + "; ".join(f"{r.name}: {r.error}" for r in results)
    else:
        obj, regional_state = built[choice]
    if regional and regional_state:
        for name, compiled in regional_state.items():  # re-enable the winner's compiled blocks (no recompile)
            model_or_step_fn.get_submodule(name)._compiled_call_impl = compiled
    log(f"optimize: chose {choice}: {reason}")
    chosen = next((r for r in results if r.name == choice), None)
    return OptimizeResult(
        target=obj, choice=choice, reason=reason,
        compile_time_s=chosen.compile_time_s if chosen else None, steady_ms=chosen.steady_ms if chosen else None,
        candidates=results, steps_run=steps_run, regional_modules=sorted(regional_state or {}),
    )


def _candidate(name: str) -> Candidate:
    if name not in CANDIDATES:
        raise ValueError(f"optimize: unknown candidate {name!r}; known: {sorted(CANDIDATES)}")
    return CANDIDATES[name]


def _on_cuda(target: Any) -> bool:
    if isinstance(target, nn.Module):
        p = next(iter(target.parameters()), None)
        return p is not None and p.is_cuda
    return torch.cuda.is_available()


def _build(cand: Candidate, target: Any, regional: bool, block_types: Iterable | None) -> tuple[Any, dict | None]:
    if cand.wrap is not None:
        return cand.wrap(target), None
    if cand.options is None:
        return target, None
    if regional:
        names = regional_compile(target, block_types, **cand.options)
        return target, {n: None for n in names}
    return torch.compile(target, **cand.options), None


def _stash_regional(model: Any, state: dict | None) -> dict | None:
    """Remembers the compiled callables of a regional candidate and turns them off for the next candidate."""
    if not state:
        return state
    stash = {}
    for name in state:
        module = model.get_submodule(name)
        stash[name] = module._compiled_call_impl
        module._compiled_call_impl = None
    return stash


def _failed(cand: Candidate, e: Exception) -> CandidateResult:
    reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    warnings.warn(f"optimize: candidate {cand.name!r} failed ({reason}); skipping it", stacklevel=3)
    return CandidateResult(cand.name, ok=False, error=reason)


def _time_candidate(cand: Candidate, obj: Any, run: Callable, warmup_steps: int, timing_steps: int,
                    on_cuda: bool) -> tuple[CandidateResult, int]:
    uses_graphs = (cand.options or {}).get("mode") == "reduce-overhead"
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if uses_graphs else None
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(warmup_steps):
        if mark:
            mark()
        run(obj)
    sync()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(timing_steps):
        if mark:
            mark()
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(obj)
            end.record()
            times.append((start, end))
        else:
            t = time.perf_counter()
            run(obj)
            times.append(1000 * (time.perf_counter() - t))
    sync()
    ms = sorted(s.elapsed_time(e) for s, e in times) if on_cuda else sorted(times)
    steady = statistics.median(ms)
    q = statistics.quantiles(ms, n=5) if len(ms) > 1 else [ms[0]] * 4
    compile_s = max(0.0, warmup_s - warmup_steps * steady / 1000)
    return CandidateResult(cand.name, True, warmup_s, compile_s, steady, q[0], q[3]), warmup_steps + timing_steps


def _choose(results: list[CandidateResult], timed: bool) -> tuple[str | None, str]:
    ok = [r for r in results if r.ok]
    if not ok:
        return None, ""
    if not timed:
        return ok[0].name, "the requested backend (not timed: pass example_step to measure it)"
    best = min(ok, key=lambda r: r.steady_ms)
    eager = next((r for r in ok if r.name == "eager"), None)
    failed = [r.name for r in results if not r.ok]
    note = f"; failed: {', '.join(failed)}" if failed else ""
    if eager is None or best is eager:
        others = ", ".join(f"{r.name} {r.steady_ms:.2f}" for r in ok if r is not best)
        vs = f" (vs {others} ms)" if others else ""
        return best.name, f"fastest steady step {best.steady_ms:.2f} ms{vs}{note}"
    gain = eager.steady_ms / best.steady_ms - 1
    if gain < _MIN_GAIN:
        return "eager", (f"{best.name} is only {100 * gain:.1f}% faster than eager ({best.steady_ms:.2f} vs "
                         f"{eager.steady_ms:.2f} ms), below the {100 * _MIN_GAIN:.0f}% needed to keep a compiled "
                         f"model{note}")
    return best.name, (f"fastest steady step {best.steady_ms:.2f} ms, {eager.steady_ms / best.steady_ms:.2f}x eager "
                       f"({eager.steady_ms:.2f} ms), after {best.compile_time_s:.1f} s of compilation{note}")
