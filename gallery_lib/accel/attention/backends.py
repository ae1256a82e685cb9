"""Attention backends: a registry with constraints and per-shape selection (``attention(q, k, v, bias)``).

No single kernel wins everywhere (benchmarks/RESULTS.md#attention), so ``auto`` picks per shape, dtype and
GPU from a small micro-benchmark of every eligible backend, cached in memory and optionally in a JSON file
(``GALLERY_ATTN_CACHE`` or ``BackendSelector(cache_path=...)``). On a CPU the rule is ``math``.

Backends: ``flash_attn4`` (FA4, the ``flash-attn-4`` package's ``flash_attn.cute``) and ``flash_attn4_padded`` (the
same with the head dim zero-padded to a multiple of 32, where FA4's dq was right on an H200), ``flash_attn3`` (FA3,
``flash_attn_interface``) and ``flash_attn`` (FA2 package) when importable, and PyTorch SDPA's ``cudnn``, ``flash``,
``efficient`` and ``math`` kernels through ``sdpa_kernel``. Each declares its constraints (device, dtypes, head dims,
additive bias, GPU capability); ``auto`` never picks one that violates them. Before timing a kernel from outside
PyTorch for a shape, ``auto`` checks its output and gradients there against exact math (``gate.py``) and leaves out,
with the reason, one that is less accurate than PyTorch's own op allows; a backend that raises is left out too.

Tensors use SDPA's layout ``(batch, heads, tokens, head_dim)``; ``bias`` is added to the attention
scores (a boolean mask means "keep").
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gallery_lib.accel.attention.gate import GateProbe, GateReport

try:
    import flash_attn  # FA2

    # FA4 alone installs flash_attn/cute without flash_attn/__init__.py: then flash_attn imports as an empty namespace
    has_flash_attn = hasattr(flash_attn, "flash_attn_func")
except ImportError:
    has_flash_attn = False
try:
    import flash_attn_interface  # FA3 (Hopper)

    has_flash_attn3 = True
except ImportError:
    has_flash_attn3 = False
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch < 2.3
    SDPBackend = sdpa_kernel = None


def _import_flash_attn4() -> Callable[..., Any] | None:
    """FA4's ``flash_attn_func`` (``flash-attn-4``'s ``flash_attn.cute``), or ``None`` where it does not import.

    FA4 runs on the CUTLASS DSL, whose wheel puts its packages (``cutlass``) on ``sys.path`` through a ``.pth`` file
    in site-packages. Installed with ``pip install --target`` (as on the GPU machine) that file is never read, so where
    ``cutlass`` is what is missing, its folder is found beside the installed ``nvidia_cutlass_dsl`` and added.
    """
    try:
        from flash_attn.cute import flash_attn_func
        return flash_attn_func
    except ImportError as e:
        if (getattr(e, "name", None) or "").split(".")[0] != "cutlass":
            return None
    except Exception:  # noqa: BLE001 - an optional kernel: one that cannot load (no CUDA driver, say) is not there
        return None
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    folders = [os.path.join(path, "dsl_packages") for path in (spec.submodule_search_locations or [])] if spec else []
    folders = [f for f in folders if os.path.isdir(os.path.join(f, "cutlass")) and f not in sys.path]
    if not folders:
        return None
    sys.path[:0] = folders  # first, as the .pth file puts it
    try:
        from flash_attn.cute import flash_attn_func
        return flash_attn_func
    except Exception:  # noqa: BLE001 - as above
        return None


_flash_attn4_func = _import_flash_attn4()
has_flash_attn4 = _flash_attn4_func is not None

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class AttentionBackend:
    """One attention kernel and what it accepts."""

    name: str
    run: Callable[..., torch.Tensor]  # run(q, k, v, bias, scale) in (B, H, L, D) layout
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = _HALF
    max_head_dim: int | None = 256
    head_dim_multiple: int = 8
    supports_bias: bool = False
    min_capability: tuple[int, int] | None = (8, 0)
    max_capability: tuple[int, int] | None = None
    installed: bool = True
    checked: bool = False
    """A kernel from outside PyTorch: ``auto`` checks its output and gradients against exact math at each shape before
    timing it (``gate.py``). PyTorch's own kernels are not: their error is the allowance's measure."""

    def why_not(self, q_shape: Sequence[int], dtype: torch.dtype, device_type: str, has_bias: bool,
                capability: tuple[int, int] | None = None) -> str | None:
        """The first constraint the call violates, as a sentence; ``None`` if the backend applies."""
        head_dim = q_shape[-1]
        if not self.installed:
            return f"{self.name} is not installed"
        if device_type not in self.devices:
            return f"{self.name} runs on {'/'.join(self.devices)}, not {device_type}"
        if dtype not in self.dtypes:
            return f"{self.name} takes {', '.join(str(d).replace('torch.', '') for d in self.dtypes)}, not {dtype}"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"{self.name} takes head dims up to {self.max_head_dim}, not {head_dim}"
        if head_dim % self.head_dim_multiple:
            return f"{self.name} needs a head dim that is a multiple of {self.head_dim_multiple}, not {head_dim}"
        if has_bias and not self.supports_bias:
            return f"{self.name} does not accept an additive bias or mask"
        if device_type == "cuda" and capability is not None:
            if self.min_capability and capability < self.min_capability:
                return f"{self.name} needs compute capability >= {self.min_capability}, not {capability}"
            if self.max_capability and capability > self.max_capability:
                return f"{self.name} needs compute capability <= {self.max_capability}, not {capability}"
        return None


def _sdpa_runner(kind: str) -> Callable[..., torch.Tensor]:
    def run(q, k, v, bias, scale):
        with sdpa_kernel([getattr(SDPBackend, kind)]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return run


def _run_flash_attn(q, k, v, bias, scale):
    out = flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    return out.transpose(1, 2)


def _run_flash_attn3(q, k, v, bias, scale):
    out = flash_attn_interface.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               softmax_scale=scale)
    out = out[0] if isinstance(out, tuple) else out  # some FA3 releases also return the log-sum-exp
    return out.transpose(1, 2)


def _run_flash_attn4(q, k, v, bias, scale):
    out = _flash_attn4_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    out = out[0] if isinstance(out, tuple) else out  # FA4 releases return (out, log-sum-exp)
    return out.transpose(1, 2)


def pad_head_dim(run: Callable[..., torch.Tensor], multiple: int = 32) -> Callable[..., torch.Tensor]:
    """``run`` on q, k and v zero-padded along the head dim to a multiple of ``multiple``, its output sliced back.

    The zeros add nothing to any q.k product, so the scores are the same with the softmax scale kept at 1/sqrt(the
    original head dim), and v's zero columns give output columns that are dropped. Gradients flow through the pad
    and the slice, so dq, dk and dv come back at the original head dim. A head dim already a multiple runs as is.
    """
    if multiple < 1:
        raise ValueError(f"pad_head_dim: multiple must be a positive number of elements, not {multiple}")

    def padded(size: int) -> int:
        return -(-size // multiple) * multiple

    def run_padded(q, k, v, bias, scale):
        head_dim, v_dim = q.shape[-1], v.shape[-1]
        if padded(head_dim) == head_dim and padded(v_dim) == v_dim:
            return run(q, k, v, bias, scale)
        scale = head_dim**-0.5 if scale is None else scale
        q, k = (F.pad(t, (0, padded(head_dim) - head_dim)) for t in (q, k))
        v = F.pad(v, (0, padded(v_dim) - v_dim))
        return run(q, k, v, bias, scale)[..., :v_dim]

    return run_padded


def _has_sdpa(kind: str) -> bool:
    return SDPBackend is not None and hasattr(SDPBackend, kind)


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        # On an H200 FA4's dq was wrong at head dims 40 and 80 and right at 32 and 64: the gate refuses it where it
        # is wrong, and the padded runner gives FA4 a multiple of 32
        AttentionBackend("flash_attn4", _run_flash_attn4, min_capability=(9, 0), installed=has_flash_attn4,
                         checked=True),
        AttentionBackend("flash_attn4_padded", pad_head_dim(_run_flash_attn4), head_dim_multiple=1,
                         min_capability=(9, 0), installed=has_flash_attn4, checked=True),
        AttentionBackend("flash_attn3", _run_flash_attn3, min_capability=(9, 0), max_capability=(9, 9),
                         installed=has_flash_attn3, checked=True),
        AttentionBackend("flash_attn", _run_flash_attn, installed=has_flash_attn, checked=True),
        AttentionBackend("cudnn", _sdpa_runner("CUDNN_ATTENTION"), installed=_has_sdpa("CUDNN_ATTENTION")),
        AttentionBackend("flash", _sdpa_runner("FLASH_ATTENTION"), installed=_has_sdpa("FLASH_ATTENTION")),
        AttentionBackend("efficient", _sdpa_runner("EFFICIENT_ATTENTION"), dtypes=(torch.float32, *_HALF),
                         max_head_dim=None, supports_bias=True, min_capability=(5, 0),
                         installed=_has_sdpa("EFFICIENT_ATTENTION")),
        AttentionBackend("math", _sdpa_runner("MATH"), devices=("cpu", "cuda"), dtypes=_FLOATS, max_head_dim=None,
                         head_dim_multiple=1, supports_bias=True, min_capability=None, installed=_has_sdpa("MATH")),
    )
}


# --------------------------------------------------------------------- selection
# (name, capability) per CUDA device index, read once. Traced code must not call CUDA's device queries (each is a
# graph break, and with the recompiles behind them they halved a compiled Swin step), so the hooks fill this before
# compilation and the selector only looks it up.
_DEVICE_INFO: dict[int, tuple[str, tuple[int, int]]] = {}


def _device_info(device: torch.device) -> tuple[str, tuple[int, int]]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_INFO:
        _DEVICE_INFO[index] = (torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    return _DEVICE_INFO[index]


def _remember_devices(model: nn.Module) -> None:
    """Reads the device info of the GPUs holding ``model`` now, outside any compilation (see ``_DEVICE_INFO``)."""
    for device in {p.device for p in model.parameters() if p.is_cuda}:
        _device_info(device)


def benchmark_backend(backend: AttentionBackend, q_shape: Sequence[int], kv_shape: Sequence[int],
                      dtype: torch.dtype, device: torch.device, has_bias: bool, reps: int = 10) -> float:
    """Median forward+backward milliseconds of ``backend`` on random inputs of these shapes."""
    device = torch.device(device)
    with torch.inference_mode(False), torch.enable_grad():
        q = torch.randn(*q_shape, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(*kv_shape, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(*kv_shape, device=device, dtype=dtype, requires_grad=True)
        bias = torch.randn(q_shape[0], q_shape[1], q_shape[2], kv_shape[2], device=device, dtype=dtype) \
            if has_bias else None
        grad = torch.randn_like(q)

        def step():
            torch.autograd.grad(backend.run(q, k, v, bias, None), (q, k, v), grad)

        for _ in range(3):
            step()
        if device.type != "cuda":
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


class BackendSelector:
    """Picks the fastest eligible backend per (shapes, dtype, GPU, bias), kernels from outside PyTorch only where they
    pass the correctness gate there, and remembers the choice with the gate's findings.

    Args:
        cache_path: JSON file to read choices from and write new ones to (``None``: memory only).
        timer: ``timer(backend, q_shape, kv_shape, dtype, device, has_bias) -> ms``; default
            ``benchmark_backend``. Tests inject a fake one.
        device_info: ``device_info(device) -> (name, (major, minor))``; default asks CUDA.
        gate: ``gate(q_shape, kv_shape, dtype, device, has_bias)`` -> an object with ``check(backend) -> GateReport``
            and ``summary() -> dict``; default ``GateProbe``. Tests that fake a GPU inject one that runs nothing.
    """

    def __init__(self, cache_path: str | os.PathLike | None = None, timer: Callable[..., float] | None = None,
                 device_info: Callable[[torch.device], tuple[str, tuple[int, int]]] | None = None,
                 gate: Callable[..., Any] | None = None):
        self.cache_path = cache_path
        self.timer = timer or benchmark_backend
        self.device_info = device_info or _device_info
        self.gate = gate or GateProbe
        self.cache: dict[str, dict[str, Any]] = {}
        self.chosen: dict[str, str] = {}
        """What ``select`` answered, per call key, and how it decided (measured, rule): for the run log."""
        if cache_path and os.path.exists(cache_path):
            with open(cache_path, encoding="utf-8") as f:
                self.cache = json.load(f)

    def sharing_measurements(self) -> BackendSelector:
        """A selector that reads and adds to this one's measurements (cache, file, timer) but keeps its own record of
        choices: a hook's ``chosen`` then says what its own model ran, whatever else the process did."""
        view = copy.copy(self)
        view.chosen = {}
        return view

    def eligible(self, q_shape, dtype, device, has_bias) -> dict[str, str | None]:
        """Every backend with ``None`` (eligible) or the reason it cannot run this call."""
        device = torch.device(device)
        capability = self.device_info(device)[1] if device.type == "cuda" else None
        return {n: b.why_not(q_shape, dtype, device.type, has_bias, capability) for n, b in BACKENDS.items()}

    def select(self, q_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, has_bias: bool,
               kv_shape: Sequence[int] | None = None) -> str:
        device = torch.device(device)
        kv_shape = tuple(kv_shape or q_shape)
        key = call_key(q_shape, kv_shape, dtype, self.device_info(device)[0] if device.type == "cuda" else "CPU",
                       has_bias)
        if device.type != "cuda" and _only_math_on(device.type):
            self.chosen[key] = "math (the CPU rule)"
            return "math"
        entry = self.cache.get(key)
        # an entry without the gate's findings (a cache file older than the gate) is chosen again where it can be;
        # while compiling it still beats the rule, which knows nothing of this GPU
        if entry is not None and ("gate" in entry or _cannot_benchmark()):
            self.chosen[key] = _measured(entry)
            return entry["backend"]
        eligible = [BACKENDS[n] for n, why in self.eligible(q_shape, dtype, device, has_bias).items() if why is None]
        if _cannot_benchmark():  # inside torch.compile tracing or CUDA-graph capture: rule, not cached
            rule = rule_choice(eligible, self.device_info(device)[1]) if device.type == "cuda" else "math"
            self.chosen[key] = f"{rule} (rule: chosen while compiling, where nothing can be timed)"
            return rule
        self.cache[key] = entry = self._measure(eligible, tuple(q_shape), kv_shape, dtype, device, has_bias)
        self.chosen[key] = _measured(entry)
        self._save()
        return entry["backend"]

    def _measure(self, eligible: list[AttentionBackend], q_shape: tuple[int, ...], kv_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, has_bias: bool) -> dict[str, Any]:
        """The cache entry for one kind of call: the gate's check of every eligible backend, then the timings of
        those it passed. A backend that raises in either is simply not a candidate; with none left, ``math``."""
        timings, failed, refused, errors = {}, {}, {}, {}
        probe = None
        if any(backend.checked for backend in eligible):
            try:
                probe = self.gate(q_shape, kv_shape, dtype, device, has_bias)
            except Exception as e:  # noqa: BLE001 - out of memory, say: the kernels it would check are left out
                failed["correctness gate"] = _error_text(e)
                eligible = [backend for backend in eligible if not backend.checked]
        for backend in eligible:
            try:
                if backend.checked:
                    report: GateReport = probe.check(backend)
                    errors[backend.name] = report.errors
                    if not report.passed:
                        refused[backend.name] = report.refusal()
                        continue
                ms = float(self.timer(backend, q_shape, kv_shape, dtype, device, has_bias))
            except Exception as e:  # noqa: BLE001 - a kernel that refuses this shape is simply not a candidate
                failed[backend.name] = _error_text(e)
                continue
            if math.isfinite(ms):
                timings[backend.name] = ms
        best = min(timings, key=timings.get) if timings else "math"
        gate = {"probe": probe.summary() if probe is not None else None, "errors": errors}
        return {"backend": best, "timings_ms": timings, "failed": failed, "refused": refused, "gate": gate}

    def _save(self) -> None:
        if not self.cache_path:
            return
        tmp = f"{self.cache_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.cache, f, indent=1, sort_keys=True)
        os.replace(tmp, self.cache_path)


def _measured(entry: dict[str, Any]) -> str:
    """How ``chosen`` and the run log say a measured choice, with the backends the gate refused and why."""
    refused = "".join(f"; refused {name}: {why}" for name, why in entry.get("refused", {}).items())
    return f"{entry['backend']} (measured{refused})"


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:200]}"


def _only_math_on(device_type: str) -> bool:
    """Whether ``math`` is the only installed backend for this device (plain attribute reads, which Dynamo traces)."""
    return all(b.name == "math" or not b.installed or device_type not in b.devices for b in BACKENDS.values())


def call_key(q_shape: Sequence[int], kv_shape: Sequence[int], dtype: torch.dtype, device_name: str,
             has_bias: bool) -> str:
    """How selections and run logs name one kind of attention call."""
    return f"{tuple(q_shape)}|{tuple(kv_shape)}|{str(dtype).replace('torch.', '')}|{device_name}|bias={bool(has_bias)}"


def rule_choice(eligible: Sequence[AttentionBackend], capability: tuple[int, int]) -> str:
    """The backend ``auto`` takes where it cannot time candidates (inside ``torch.compile`` tracing or CUDA-graph
    capture, with no cached measurement): the measured winners as a rule (benchmarks/RESULTS.md#attention): on
    Hopper cuDNN without a bias; with a bias only ``efficient`` and ``math`` apply, and ``efficient`` is faster."""
    order = ("cudnn", "flash", "efficient") if capability >= (9, 0) else ("flash", "efficient")
    names = {b.name for b in eligible}
    return next((name for name in order if name in names), "math")


def _cannot_benchmark() -> bool:
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    return compiling or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_selector = BackendSelector(cache_path=os.environ.get("GALLERY_ATTN_CACHE"))


def default_selector() -> BackendSelector:
    return _selector


def select_backend(q_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, has_bias: bool, *,
                   kv_shape: Sequence[int] | None = None, selector: BackendSelector | None = None) -> str:
    """The backend ``auto`` uses for this call: ``math`` on a CPU, the measured fastest eligible one on CUDA."""
    return (selector or _selector).select(q_shape, dtype, device, has_bias, kv_shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
              backend: str = "auto", scale: float | None = None,
              selector: BackendSelector | None = None) -> torch.Tensor:
    """Attention of ``(B, H, L, D)`` tensors through the chosen backend; ``bias`` is added to the scores."""
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill_(~bias, float("-inf"))
    elif bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    if backend == "auto":
        backend = select_backend(q.shape, q.dtype, q.device, bias is not None, kv_shape=k.shape, selector=selector)
    elif backend not in BACKENDS:
        raise ValueError(f"attention: unknown backend {backend!r}; use 'auto' or one of {list(BACKENDS)}")
    else:
        capability = _device_info(q.device)[1] if q.is_cuda else None
        why = BACKENDS[backend].why_not(q.shape, q.dtype, q.device.type, bias is not None, capability)
        if why:
            raise ValueError(f"attention: backend {backend!r} cannot run this call: {why}; use backend='auto'")
    return BACKENDS[backend].run(q, k, v, bias, scale)


def describe(selector: BackendSelector | None = None) -> str:
    """A few lines for a notebook: which backends exist here, their constraints, and what ``auto`` chose."""
    selector = selector or _selector
    lines = ["attention backends:"]
    for b in BACKENDS.values():
        state = "available" if b.installed else "not installed"
        heads = f"head dim <= {b.max_head_dim}" if b.max_head_dim else "any head dim"
        lines.append(f"  {b.name:<18} {state:<14} {'/'.join(b.devices)}; "
                     f"{', '.join(str(d).replace('torch.', '') for d in b.dtypes)}; {heads}; "
                     f"{'bias ok' if b.supports_bias else 'no bias'}")
    if selector.cache:
        lines.append("auto chose:")
        for key, entry in selector.cache.items():
            times = ", ".join(f"{n} {ms:.3f}" for n, ms in sorted(entry["timings_ms"].items(), key=lambda x: x[1]))
            lines.append(f"  {key}: {entry['backend']}  (ms: {times})")
            lines.extend(f"    {name} refused at {key}: {why}" for name, why in entry.get("refused", {}).items())
    else:
        lines.append("auto: nothing chosen yet (CPU calls use math)")
    return "\n".join(lines)
