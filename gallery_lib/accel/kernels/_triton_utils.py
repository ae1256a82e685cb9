"""Shared plumbing of the fused kernels: the Triton guard, the path decision, launch helpers and block sizes.

Every op in this package has two paths: a Triton kernel and a PyTorch reference. `use_triton(tensor)` picks one:

* CUDA tensors run the compiled Triton kernel (wrapped with `torch.library.wrap_triton` so that `torch.compile`
  can see into it);
* CPU tensors run the same kernel source through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
  Triton was imported (Triton 3.x decorates its own ``tl.sum``/``tl.zeros`` helpers for the interpreter only at
  import) and is still set at call time. This is the CPU test path: it checks indexing and masking, not speed;
* everything else (no Triton, CPU without the interpreter, `set_triton_enabled(False)`) runs the PyTorch reference.

Each kernel is defined once with `kernel(fn)`, which keeps a `triton.jit` version (CUDA) and an interpreted version
(CPU) of the same source, so one process can serve both devices; helpers they call use `device_function`.

Launch cost matters as much as kernel speed at the small shapes of a training step (a 128x1000 loss, an 8x8 UNet
level): a launch of plain tensors calls the jit function directly (no ``wrap_triton`` wrapper objects), the
public ops run as a `torch.autograd.Function` in eager mode (`eager_mode`) and go through the ``torch.library``
dispatcher only while ``torch.compile`` traces them, and the SM count is cached per device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections import Counter
from typing import Any, Callable, Iterator

import torch

try:
    import triton
    import triton.language as tl  # noqa: F401  (re-exported for the kernel modules)

    has_triton = True
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch; macOS/Windows CPU builds lack it
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # kernel signatures still evaluate; the kernels never run
    has_triton = False

try:  # private module of Triton: only the CPU interpreter path depends on it
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover
    _InterpretedFunction = None

# triton_op (torch >= 2.6) lets torch.compile trace into the kernels; older torch gets an opaque custom_op.
_triton_op = getattr(torch.library, "triton_op", None)
_wrap_triton = getattr(torch.library, "wrap_triton", None) if _triton_op is not None else None

_TRITON_ENABLED = True
# Kernel launches per kernel name; tests read it to prove the Triton path (not the fallback) ran.
launch_counts: Counter[str] = Counter()

# Largest block along a reduced dimension; rows wider than this take the multi-block loop. Tests lower it to
# reach the multi-block path on small shapes.
MAX_BLOCK = 4096


def is_triton_enabled() -> bool:
    """Whether the Triton path may be used at all (see `set_triton_enabled`)."""
    return _TRITON_ENABLED


@contextlib.contextmanager
def set_triton_enabled(enabled: bool) -> Iterator[None]:
    """Context manager that turns the Triton path on or off (off: the PyTorch reference runs everywhere)."""
    global _TRITON_ENABLED
    previous, _TRITON_ENABLED = _TRITON_ENABLED, enabled
    try:
        yield
    finally:
        _TRITON_ENABLED = previous


@contextlib.contextmanager
def set_max_block(size: int) -> Iterator[None]:
    """Context manager lowering the largest reduction block (tests use it to exercise the multi-block loops)."""
    global MAX_BLOCK
    if size < 1 or size & (size - 1):
        raise ValueError(f"max block must be a positive power of two, got {size}")
    previous, MAX_BLOCK = MAX_BLOCK, size
    try:
        yield
    finally:
        MAX_BLOCK = previous


def interpreter_ready() -> bool:
    """True when CPU tensors can run the kernels: the interpreter is on now and was on when Triton was imported."""
    if not has_triton or _InterpretedFunction is None or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    import triton.language.standard as tl_standard

    return isinstance(tl_standard.sum, _InterpretedFunction)


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should handle ``tensor``; False selects the PyTorch reference."""
    if not (has_triton and _TRITON_ENABLED):
        return False
    if tensor.is_cuda:
        return True
    # Fake and functional tensors (opcheck, torch.compile tracing) cannot be interpreted: they take the reference,
    # which has the same output shapes.
    return interpreter_ready() and type(tensor) in (torch.Tensor, torch.nn.Parameter)


def eager_mode() -> bool:
    """True outside ``torch.compile`` tracing.

    The ops then run as `torch.autograd.Function` subclasses calling the launchers directly: the custom-op
    dispatcher and its generated autograd wrapper cost tens of microseconds per call, which is the whole run time of
    a small kernel. Under tracing they go through the ``torch.library`` ops so the compiler can see the kernels.
    """
    return not torch.compiler.is_compiling()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)


def streaming_eviction(t: torch.Tensor, forced: bool | None = None) -> str:
    """Eviction policy for a forward kernel's loads of ``t``, read once: ``"evict_first"`` when ``t`` fits in the L2
    cache of its GPU (or ``forced`` says so), else the default ``""``.

    It made forwards of inputs that fit in L2 faster and larger ones slower; backward kernels measured slower with it
    and do not use it (benchmarks/RESULTS.md#kernels).
    """
    if forced is None:  # a CUDA tensor's device always carries its index
        forced = t.is_cuda and t.numel() * t.element_size() <= _l2_bytes(t.device.index)
    return "evict_first" if forced else ""


def num_programs_target(t: torch.Tensor, per_sm: int = 4) -> int:
    """Programs that fill the GPU of ``t`` (``per_sm`` per SM); 16 on the interpreter, so small shapes split."""
    if not t.is_cuda:
        return 16
    return per_sm * sm_count(t.device)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (the current one when it carries no index), cached."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


class TritonKernel:
    """One kernel source with a compiled and an interpreted launcher; index it with a grid like a jit function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self._jit = triton.jit(fn) if has_triton else None
        self._interp = _InterpretedFunction(fn) if _InterpretedFunction is not None else None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            first = next(a for a in args if isinstance(a, torch.Tensor))
            launch_counts[self.name] += 1
            if not first.is_cuda:
                return self._interp[grid](*args, **kwargs)
            # Fake/functional tensors mean torch.compile is tracing the op: it must see the kernel through wrap_triton.
            # Plain tensors launch directly, as triton_op itself does outside tracing.
            if type(first) not in (torch.Tensor, torch.nn.Parameter) and _wrap_triton is not None:
                return _wrap_triton(self._jit)[grid](*args, **kwargs)
            return self._jit[grid](*args, **kwargs)

        return launch


def library_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Register a function as a torch.library op (``triton_op`` where available, else ``custom_op``)."""
    register = _triton_op if _triton_op is not None and has_triton else torch.library.custom_op
    return register(name, mutates_args=())


def kernel(fn: Callable[..., Any]) -> TritonKernel:
    """Decorator for kernel sources (used instead of ``@triton.jit``)."""
    return TritonKernel(fn)


def device_function(fn: Callable[..., Any]) -> Any:
    """Decorator for helpers that kernels call (index set-up and the like); Triton inlines them into the kernel.

    ``triton.jit`` already returns the interpreter's version when ``TRITON_INTERPRET=1`` is set at import, the only
    case in which CPU tensors run kernels (see `interpreter_ready`), so one object serves both devices.
    """
    return triton.jit(fn) if has_triton else fn


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots from its address: contiguous, or channels_last. The
    kernels over pointer tables read such tensors as flat memory."""
    return (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
            or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)))


def reduction_block(n: int, max_block: int | None = None) -> int:
    """Block size along a reduced dimension of length ``n``: the whole row when it fits, else the cap."""
    return min(next_power_of_2(n), max_block or MAX_BLOCK)


def num_warps_for(block_elems: int) -> int:
    """Warps for a program that touches ``block_elems`` elements per step: enough lanes for 8-16 B loads."""
    if block_elems >= 8192:
        return 16
    if block_elems >= 2048:
        return 8
    if block_elems >= 512:
        return 4
    return 2
