"""The one-line accelerator for a plain PyTorch training loop: ``model = gallery_lib.optimize(model)``.

``optimize`` returns the same module (its parameters, ``state_dict`` keys and attributes unchanged) with a chooser
installed in front of its forward, the way ``nn.Module.compile`` installs a compiled one. The chooser spends the
model's first training steps on candidates: eager, eager with channels_last input (models with 2-D convolutions;
the faster layout is kept for the compiled candidates), Inductor, and Inductor with CUDA graphs (max-autotune
without CUDA graphs when asked for: its autotuning takes minutes). Each runs a few warm-up steps (compilation,
autotuning, graph capture) and a few timed ones; a step is timed from one training forward to the next, so it is
the loop's whole step (backward, optimizer, data).
The chooser then keeps the fastest, logs each candidate's compile time and steady ms per step and why it chose,
and caches the choice per model, input shape, autocast state, GPU and torch version
(``~/.cache/gallery_lib/optimize.json``; ``$GALLERY_CACHE_DIR/optimize.json`` where that is set), so the next run
starts with it at once. ``accelerate(model, example=...)`` (``accel/timed_changes.py``) times its changes with the
same step marks and caches its decisions the same way, in ``accelerate.json`` beside ``optimize.json``.

The trial steps are real training steps (every candidate computes the same function), so nothing is thrown away.
A candidate that fails to compile or run is logged with its error and that step runs eagerly. Parameters keep their
layout whatever the candidate (convolutions follow the input's layout), so an optimizer's state stays valid.
Forward calls outside training (``eval()`` or ``no_grad``) run eagerly until the choice is made.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from gallery_lib.accel.compile.cpu_codegen import use_safe_cpu_codegen
from gallery_lib.config.quiet import quiet_known_noise

_MIN_GAIN = 0.01  # a compiled candidate must beat eager by 1%, or eager is kept (fewer recompiles and surprises)


def default_timing_steps(on_cuda: bool) -> int:
    """Steps timed per candidate: 10 on a GPU; 4 on a CPU, where they only pick what to keep (no speedup is quoted
    there) and each step of the smoke gallery's models takes up to a second (benchmarks/RESULTS.md#cpu-gallery)."""
    return 10 if on_cuda else 4


@dataclass(frozen=True)
class Candidate:
    """A way to run the model: ``options`` for ``torch.compile`` (``None``: eager), and the input layout."""

    name: str
    options: dict[str, Any] | None = None
    channels_last: bool = False
    cuda_only: bool = False

    def with_layout(self, channels_last: bool) -> Candidate:
        if channels_last == self.channels_last:
            return self
        return Candidate(self.name + ("+channels_last" if channels_last else ""), self.options, channels_last,
                         self.cuda_only)


CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("eager"),
    Candidate("inductor", {"backend": "inductor"}),
    Candidate("inductor-cudagraphs", {"backend": "inductor", "mode": "reduce-overhead"}, cuda_only=True),
    Candidate("max-autotune-no-cudagraphs", {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
              cuda_only=True),
    Candidate("aot_eager", {"backend": "aot_eager"}),  # tracing without code generation: a cheap check
)}
# Tried by default. max-autotune-no-cudagraphs is offered but not tried unasked: it compiled ResNet-50's training
# step for over 4 minutes on an H100 (benchmarks/RESULTS.md#resnet50).
COMPILED = ("inductor", "inductor-cudagraphs")


@dataclass
class CandidateResult:
    """How one candidate did; times are ``None`` when it failed (see ``error``)."""

    name: str
    ok: bool = True
    compile_time_s: float | None = None
    steady_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    error: str | None = None


@dataclass
class OptimizeReport:
    """What ``optimize`` tried and chose (``model.gallery_optimize`` once it has decided)."""

    choice: str | None = None
    reason: str = ""
    cached: bool = False
    key: str = ""
    candidates: list[CandidateResult] = field(default_factory=list)
    trial_steps: int = 0


def optimize(model: nn.Module, *, backend: str = "auto", candidates: Iterable[str | Candidate] | None = None,
             warmup_steps: int = 3, timing_steps: int | None = None, cache: bool | str | os.PathLike = True,
             log: Callable[[str], Any] = print) -> nn.Module:
    """Returns ``model``, which picks its fastest way to run over its first training steps (module docstring).

    Args:
        model: the module a training loop calls (forward, then backward and the optimizer step outside).
        backend: ``"auto"`` (try the candidates) or a name from ``CANDIDATES`` to use at once.
        candidates: names or ``Candidate`` objects to try (default: ``COMPILED`` on a GPU, inductor on a CPU, after
            eager in both layouts for a model with 2-D convolutions).
        warmup_steps: steps each candidate runs before it is timed (its compilation happens in the first).
        timing_steps: steps timed per candidate (median, p20 and p80 are logged); default 10 on a GPU, 4 on a CPU.
        cache: ``True`` for the default cache file, a path for another, ``False`` to always measure.
        log: where the trials and the choice are written.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize(model) takes the nn.Module your loop calls, got {type(model).__name__}")
    if backend != "auto" and backend not in CANDIDATES:
        raise ValueError(f"optimize: unknown backend {backend!r}; use 'auto' or one of {sorted(CANDIDATES)}")
    if warmup_steps < 1 or (timing_steps is not None and timing_steps < 2):
        raise ValueError("optimize: warmup_steps must be >= 1 (the first step compiles) and timing_steps >= 2")
    if model._compiled_call_impl is not None:
        raise ValueError("optimize: this model is already compiled (model.compile() or optimize()); pass the "
                         "plain module")
    names = list(candidates) if candidates is not None else None
    plan = [_candidate(c) for c in names] if names is not None else None
    quiet_known_noise()  # it compiles in this process: the same quiet as a gallery run
    chooser = _Chooser(model, backend, plan, warmup_steps, timing_steps, cache_file(cache), log)
    model._compiled_call_impl = chooser
    return model


def default_cache_file(name: str = "optimize.json") -> Path:
    """``$GALLERY_CACHE_DIR/name`` where that is set, else ``name`` in the user's cache (``~/.cache/gallery_lib``)."""
    if os.environ.get("GALLERY_CACHE_DIR"):
        return Path(os.environ["GALLERY_CACHE_DIR"]) / name
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gallery_lib" / name


def cache_file(cache: bool | str | os.PathLike, name: str = "optimize.json") -> Path | None:
    """The file a ``cache`` argument names: ``True`` the default one, a path that one, ``False`` none."""
    if cache is True:
        return default_cache_file(name)
    return Path(cache) if cache else None


def _candidate(c: str | Candidate) -> Candidate:
    if isinstance(c, Candidate):
        return c
    if c not in CANDIDATES:
        raise ValueError(f"optimize: unknown candidate {c!r}; known: {sorted(CANDIDATES)}")
    return CANDIDATES[c]


@dataclass
class _Trial:
    candidate: Candidate
    marks: list = field(default_factory=list)  # per training call: (wall seconds, CUDA event or None)
    result: CandidateResult | None = None


class _Chooser:
    """Installed as the model's ``_compiled_call_impl``: runs each call with the current candidate and moves
    through the trials at training calls."""

    def __init__(self, model: nn.Module, backend: str, plan: list[Candidate] | None, warmup_steps: int,
                 timing_steps: int | None, cache_file: Path | None, log: Callable[[str], Any]) -> None:
        self.model = model
        self.backend = backend
        self.plan = plan
        self._on_cuda = any(p.is_cuda for p in model.parameters())
        self.warmup_steps = warmup_steps
        self.timing_steps = timing_steps or default_timing_steps(self._on_cuda)
        self.cache_file = cache_file
        self.log = log
        self.report = OptimizeReport()
        self.trials: list[_Trial] = []
        self.chosen: Candidate | None = None
        self._compiled: dict[str, Callable] = {}
        self._has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
        self._compiled_plan: list[Candidate] = []

    # ----- the call ------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.model.training and torch.is_grad_enabled()
        if self.chosen is not None or not training:
            return self._run(self.chosen or CANDIDATES["eager"], args, kwargs, training)
        if not self.trials:
            self._start(args, kwargs)
            if self.chosen is not None:
                return self._run(self.chosen, args, kwargs, training)
        mark, trial = self._mark(), self.trials[-1]
        trial.marks.append(mark)
        if len(trial.marks) > self.warmup_steps + self.timing_steps:  # this call ends the trial's last timed step
            self._next_trial()
            if self.chosen is not None:
                return self._run(self.chosen, args, kwargs, training)
            trial = self.trials[-1]
            trial.marks.append(mark)  # and starts the next trial's first step
        self.report.trial_steps += 1
        try:
            return self._run(trial.candidate, args, kwargs, training)
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is skipped, the step runs eagerly
            trial.result = _failed(trial.candidate, exc)
            self.log(f"optimize: {trial.candidate.name} failed ({trial.result.error}); this step runs eagerly")
            self._next_trial()
            return self._run(CANDIDATES["eager"], args, kwargs, training)

    def _mark(self) -> tuple[float, Any]:
        return step_mark(self._on_cuda)

    def _run(self, cand: Candidate, args: tuple, kwargs: dict, training: bool) -> Any:
        if cand.channels_last:
            args = tuple(a.contiguous(memory_format=torch.channels_last)
                         if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)
        fn = self._callable(cand)
        if training and (cand.options or {}).get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten
        return fn(*args, **kwargs)

    def _callable(self, cand: Candidate) -> Callable:
        if cand.options is None:
            return self.model._call_impl
        key = json.dumps(cand.options, sort_keys=True)
        if key not in self._compiled:
            if not self._on_cuda:
                use_safe_cpu_codegen()
            self._compiled[key] = torch.compile(self.model._call_impl, **cand.options)
        return self._compiled[key]

    # ----- the plan ------------------------------------------------------------------------------------------
    def _start(self, args: tuple, kwargs: dict) -> None:
        self.report.key = cache_key(self.model, args, kwargs)
        if self.backend != "auto":
            self._choose(CANDIDATES[self.backend], f"asked for (backend={self.backend!r})")
            return
        cached = read_cache(self.cache_file).get(self.report.key) if self.cache_file else None
        if cached and cached.get("choice_name") in CANDIDATES:
            self.report.cached = True
            self._choose(CANDIDATES[cached["choice_name"]].with_layout(cached["channels_last"]),
                         f"cached in {self.cache_file} ({cached['reason']}); delete the entry or pass "
                         "cache=False to measure again")
            return
        if self.plan is None:
            compiled = [CANDIDATES[n] for n in COMPILED if self._on_cuda or not CANDIDATES[n].cuda_only]
            layouts = [CANDIDATES["eager"], CANDIDATES["eager"].with_layout(True)] if self._has_conv else \
                [CANDIDATES["eager"]]
            self.plan = layouts
            self._compiled_plan = compiled
        else:
            self.plan = [c for c in self.plan if self._on_cuda or not c.cuda_only]
            self._compiled_plan = []
        if not self.plan:
            self._choose(CANDIDATES["eager"], "no candidate runs on this device")
            return
        self.trials.append(_Trial(self.plan.pop(0)))

    def _next_trial(self) -> None:
        """Closes the current trial and starts the next one, or decides."""
        trial = self.trials[-1]
        if trial.result is None:
            trial.result = self._measure(trial)
            r = trial.result
            self.log(f"optimize: {r.name:<40} compile {r.compile_time_s:6.1f} s   steady {r.steady_ms:8.2f} ms/step "
                     f"(p20 {r.p20_ms:.2f}, p80 {r.p80_ms:.2f})")
        if not self.plan and self._compiled_plan:  # the layouts are measured: compile in the faster one
            channels_last = self._faster_layout()
            self.plan = [c.with_layout(channels_last) for c in self._compiled_plan]
            self._compiled_plan = []
        if self.plan:
            self.trials.append(_Trial(self.plan.pop(0)))
            return
        self._decide()

    def _faster_layout(self) -> bool:
        layouts = [t.result for t in self.trials if t.candidate.options is None and t.result.ok]
        return bool(layouts) and min(layouts, key=lambda r: r.steady_ms).name.endswith("+channels_last")

    def _measure(self, trial: _Trial) -> CandidateResult:
        return step_stats(trial.candidate.name, trial.marks, self.warmup_steps)

    def _decide(self) -> None:
        results = [t.result for t in self.trials]
        self.report.candidates = results
        ok = [r for r in results if r.ok]
        by_name = {t.candidate.name: t.candidate for t in self.trials}
        if not ok:
            self._choose(CANDIDATES["eager"], "every candidate failed: " +
                         "; ".join(f"{r.name}: {r.error}" for r in results))
            return
        best = min(ok, key=lambda r: r.steady_ms)
        eager = min((r for r in ok if by_name[r.name].options is None), key=lambda r: r.steady_ms, default=None)
        failed = [r.name for r in results if not r.ok]
        note = f"; failed: {', '.join(failed)}" if failed else ""
        if eager is not None and best is not eager and eager.steady_ms / best.steady_ms - 1 < _MIN_GAIN:
            best, reason = eager, (f"the fastest compiled candidate is less than {100 * _MIN_GAIN:.0f}% faster than "
                                   f"{eager.name} ({eager.steady_ms:.2f} ms/step){note}")
        elif eager is not None and best is not eager:
            # on a CPU a few timed steps pick the candidate to keep; their ratio is no speedup to quote
            over = f"{eager.steady_ms / best.steady_ms:.2f}x " if self._on_cuda else "vs "
            reason = (f"fastest steady step {best.steady_ms:.2f} ms, {over}{eager.name} ({eager.steady_ms:.2f} ms), "
                      f"after {best.compile_time_s:.1f} s of compilation{note}")
        else:
            others = ", ".join(f"{r.name} {r.steady_ms:.2f}" for r in ok if r is not best)
            reason = f"fastest steady step {best.steady_ms:.2f} ms" + (f" (vs {others} ms)" if others else "") + note
        self._choose(by_name[best.name], reason)
        if self.cache_file is not None:
            base = next(n for n in CANDIDATES if by_name[best.name].options == CANDIDATES[n].options)
            write_cache(self.cache_file, self.report.key, {
                "choice_name": base, "channels_last": by_name[best.name].channels_last, "reason": reason,
                "steady_ms": best.steady_ms, "measured": time.strftime("%Y-%m-%d %H:%M"),
                "candidates": [asdict(r) for r in results]})

    def _choose(self, cand: Candidate, reason: str) -> None:
        self.chosen = cand
        self.report.choice, self.report.reason = cand.name, reason
        self.model.gallery_optimize = self.report
        self.log(f"optimize: chose {cand.name}: {reason}")


def _failed(cand: Candidate, exc: Exception) -> CandidateResult:
    text = str(exc).strip()
    return CandidateResult(cand.name, ok=False, error=f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
                           [:300])


def step_mark(on_cuda: bool, clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """A step boundary: ``clock()``'s seconds, and on a GPU a CUDA event recorded on the current stream (no sync)."""
    event = None
    if on_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    return clock(), event


def step_stats(name: str, marks: list[tuple[float, Any]], warmup_steps: int) -> CandidateResult:
    """The steps between ``marks`` (``step_mark``'s, one more than the steps) after ``warmup_steps``: median, p20 and
    p80 in ms (from the CUDA events where the marks have them) and the warm-up's seconds beyond its steady steps."""
    on_cuda = marks[-1][1] is not None
    if on_cuda:
        marks[-1][1].synchronize()
    timed = marks[warmup_steps:]
    if on_cuda:
        ms = sorted(a[1].elapsed_time(b[1]) for a, b in zip(timed, timed[1:]))
    else:
        ms = sorted(1000 * (b[0] - a[0]) for a, b in zip(timed, timed[1:]))
    steady = statistics.median(ms)
    q = statistics.quantiles(ms, n=5, method="inclusive")
    warmup_s = marks[warmup_steps][0] - marks[0][0]
    return CandidateResult(name, True, max(0.0, warmup_s - warmup_steps * steady / 1000), steady, q[0], q[3])


def cache_key(model: nn.Module, args: tuple, kwargs: dict) -> str:
    """Model class, size and structure, the inputs' shapes and dtypes, the autocast state, the device and torch's
    version."""
    def sig(x: Any) -> str:
        return f"{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else "-"

    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    autocast = (f"autocast {str(torch.get_autocast_dtype(device.type)).removeprefix('torch.')}"
                if torch.is_autocast_enabled(device.type) else "no autocast")
    inputs = ",".join([sig(a) for a in args] + [f"{k}={sig(v)}" for k, v in sorted(kwargs.items())])
    size = sum(p.numel() for p in params)
    return (f"{type(model).__module__}.{type(model).__qualname__} ({size} parameters, structure "
            f"{_structure_digest(model)}) | {inputs} | {autocast} | {device_name} | torch {torch.__version__}")


def _structure_digest(model: nn.Module) -> str:
    """A short hash of the module tree: each module's name and class, each parameter's and buffer's shape and dtype
    (two models of one class and size, a Swin with other windows say, get other keys)."""
    parts = [f"{name}:{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}"
              for name, t in (*model.named_parameters(), *model.named_buffers())]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def read_cache(path: Path) -> dict[str, Any]:
    """The entries of the JSON file at ``path``; none where there is no file, or one that is not a cache's."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or one another version wrote: measure
    return entries if isinstance(entries, dict) else {}


def write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Adds ``entry`` under ``key`` to the JSON file at ``path`` (atomically; a failure is said, not raised)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_cache(path)
        entries[key] = entry
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)  # atomic: a concurrent run reads the old file or the new one
    except OSError as exc:
        print(f"gallery_lib: could not write the measurement to {path} ({exc}); the next run will measure again")
