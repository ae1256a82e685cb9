"""Regional compilation: each repeated block of a model compiled in place, and what the compile caches did.

``regional_compile(model, block_types)`` compiles each repeated block (the model family's ``block_types``, e.g.
diffusers ``Transformer2DModel`` / ``ResnetBlock2D``, timm ``SwinTransformerBlock``) in place with
``module.compile()``: blocks of one class and shape share one compiled graph, which cuts compile time against
compiling the whole model. ``compile_cache_stats`` reads whether a run compiled its graphs or loaded them, and
``cache_bypass_reasons`` why a graph could not be cached at all (then every run compiles it again).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable

import torch
from torch import nn

from gallery_lib.accel.compile.cpu_codegen import use_safe_cpu_codegen
from gallery_lib.config import families

_RECOMPILE_LIMIT = 64  # one code object serves every block of a class; the default limit (8) is below SD's shapes


def registered_block_types() -> tuple[str, ...]:
    """The repeated-block class names of every registered model family (what ``block_names`` looks for by default)."""
    return tuple(dict.fromkeys(t for family in families.FAMILIES.values() for t in family.block_types))


def _matches(module: nn.Module, block_types: tuple) -> bool:
    names = {cls.__name__ for cls in type(module).__mro__}
    return any(t in names if isinstance(t, str) else isinstance(module, t) for t in block_types)


def block_names(model: nn.Module, block_types: Iterable[type | str] | None = None) -> list[str]:
    """Qualified names of the blocks ``regional_compile`` compiles: outermost matches of ``block_types`` (default:
    ``registered_block_types()``), in module order. Classes match by type, names by the name of the module's class or
    of a class it derives from (a block sharded by FSDP2 is an ``FSDP<Block>`` subclass of it), so that neither
    diffusers nor timm has to be importable; a Transformer2DModel is compiled whole, its inner blocks not again."""
    types = tuple(block_types) if block_types is not None else registered_block_types()
    names: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if _matches(child, types):
                names.append(full)
            else:
                visit(full, child)

    visit("", model)
    if not names:
        raise ValueError(f"regional_compile: no block of types {types} in {type(model).__name__}; "
                         "pass block_types=(YourBlockClass,) naming the repeated block of this model")
    return names


def regional_compile(model: nn.Module, block_types: Iterable[type | str] | None = None, **compile_kwargs: Any
                     ) -> list[str]:
    """Compiles each repeated block of ``model`` in place (``module.compile(**compile_kwargs)``).

    Args:
        model: the model; its ``state_dict`` and parameters are untouched.
        block_types: classes or class names to compile (default: every registered family's); the outermost match
            wins.
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ...). ``dynamic`` defaults
            to ``False``: every block shape gets its own static graph, as the gallery's runs compile them.
            ``dynamic=None`` lets Dynamo turn a block's changing sizes symbolic after its first recompile, which is
            slower at run time and, on a CPU, to compile (tiny Swin's third block graph: a minute of symbolic shape
            reasoning).

    Returns:
        The qualified names of the compiled modules.
    """
    names = block_names(model, block_types)
    if any(p.device.type == "cpu" for p in model.parameters()):
        use_safe_cpu_codegen()
    compile_kwargs = with_block_defaults(compile_kwargs)
    for name in names:
        model.get_submodule(name).compile(**compile_kwargs)
    raise_recompile_limit()
    return names


def mode_options(mode: str | None) -> dict[str, Any]:
    """Inductor's options for a ``torch.compile`` mode (none for ``None`` or ``"default"``), to extend with others:
    ``torch.compile`` takes a mode or options, not both."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode)) if mode and mode != "default" else {}


def with_block_defaults(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compile_kwargs`` with ``regional_compile``'s defaults filled in (``dynamic=False``): what it compiles with."""
    return {**compile_kwargs, "dynamic": compile_kwargs.get("dynamic", False)}


def undo_regional_compile(model: nn.Module, names: Iterable[str]) -> None:
    """Reverts ``regional_compile`` for the given module names (they run eagerly again)."""
    for name in names:
        model.get_submodule(name)._compiled_call_impl = None


def raise_recompile_limit() -> None:
    """Lets one code object hold a graph per distinct block (the default limit, 8, is below SD's block shapes)."""
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, key) < _RECOMPILE_LIMIT:
        setattr(cfg, key, _RECOMPILE_LIMIT)


def compile_cache_stats() -> dict[str, int]:
    """This process's compilations so far, from Dynamo's counters: the graphs Dynamo traced, and the hits and misses
    of AOTAutograd's cache and Inductor's FX graph cache. A run whose blocks were precompiled misses nothing. The two
    caches are kept apart: whether an AOTAutograd hit also counts FX graph hits differs between torch versions."""
    from torch._dynamo.utils import counters

    return {"graphs_traced": counters["stats"]["unique_graphs"],
            "aot_autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_autograd_misses": counters["aot_autograd"]["autograd_cache_miss"],
            "aot_autograd_bypasses": counters["aot_autograd"]["autograd_cache_bypass"],
            "fx_graph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_graph_misses": counters["inductor"]["fxgraph_cache_miss"],
            "fx_graph_bypasses": counters["inductor"]["fxgraph_cache_bypass"]}


# The two caches say why they were bypassed only in an INFO log line of these loggers.
_BYPASS_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")


class _BypassReasons(logging.Filter):
    """Counts the caches' "Bypassing ..." log lines by message; lets through only what the logger showed before it
    was lowered to INFO to hear them."""

    def __init__(self, shown_from: int):
        super().__init__()
        self.shown_from = shown_from
        self.reasons: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and str(record.msg).startswith("Bypassing"):
            self.reasons[record.getMessage()] += 1
        return record.levelno >= self.shown_from


def watch_cache_bypasses() -> None:
    """From now on, this process counts why the compile caches were bypassed (``cache_bypass_reasons``); once."""
    for name in _BYPASS_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BypassReasons) for f in logger.filters):
            logger.addFilter(_BypassReasons(logger.getEffectiveLevel()))
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))


def cache_bypass_reasons() -> Counter[str]:
    """Each message with which a compile cache was bypassed since ``watch_cache_bypasses``, and how often."""
    reasons: Counter[str] = Counter()
    for name in _BYPASS_LOGGERS:
        for f in logging.getLogger(name).filters:
            if isinstance(f, _BypassReasons):
                reasons.update(f.reasons)
    return reasons


def compile_phase_seconds() -> dict[str, float]:
    """Seconds this process spent so far in each phase PyTorch's compiler times (``dynamo_timed``: Dynamo's tracing,
    AOTAutograd, Inductor, loading from the caches, CUDA graph recording, ...). Phases nest: an outer one includes
    the inner ones."""
    from torch._dynamo.utils import compilation_time_metrics

    return {phase: sum(seconds) for phase, seconds in compilation_time_metrics.items()}


def phase_seconds_since(start: dict[str, float], top: int = 12) -> dict[str, float]:
    """The ``top`` longest phases since ``start`` (an earlier ``compile_phase_seconds``), longest first; a phase
    torch._dynamo.reset cleared in between counts from zero."""
    spent = {}
    for phase, s in compile_phase_seconds().items():
        before = start.get(phase, 0.0)
        spent[phase] = s - before if s >= before else s
    longest = sorted((item for item in spent.items() if item[1] > 0), key=lambda item: -item[1])[:top]
    return {phase: round(s, 3) for phase, s in longest}


def describe_compile_cache(stats: dict[str, int]) -> str:
    def bypassed(key: str) -> str:
        return f", {stats[key]} bypassed" if stats.get(key) else ""

    return (f"Dynamo traced {stats['graphs_traced']} graphs; AOTAutograd cache {stats['aot_autograd_hits']} hits, "
            f"{stats['aot_autograd_misses']} misses{bypassed('aot_autograd_bypasses')}; FX graph cache "
            f"{stats['fx_graph_hits']} hits, {stats['fx_graph_misses']} misses{bypassed('fx_graph_bypasses')}")
