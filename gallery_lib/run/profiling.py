"""Where a training step's time goes: ``profile_steps`` steps under ``torch.profiler``, kernel time summed by kind.

With ``profile_steps=N`` the loop runs its last N steps under the profiler and writes
``<run_dir>/profile.json``: each device kernel's time per step (CUDA kernels, replayed CUDA graphs included; on a CPU,
the CPU ops), summed by kind (convolution, matmul, attention, Inductor's fusions, optimizer, copies...), with the
costliest kernels by name and the ops that launched the most time (``aten::convolution_backward``, or a compiled
graph's call for the kernels its CUDA graph replays), and prints the by-kind table. The profiled steps run slower
than the others, so the speed figures leave them out and come from the steps before them. They come last because
the profiler can keep slowing the steps after it: with CUDA graphs PyTorch may leave CUPTI running when the profiler
stops (``TEARDOWN_CUPTI=0``, a workaround for CUDA-graph crashes), and on one H200 the steps after five profiled
DreamBooth steps ran 45-50 ms instead of 37 (benchmarks/RESULTS.md#dreambooth).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

# First match wins: kernel names as cuDNN, cuBLAS, PyTorch's attention kernels and Inductor name them on Hopper, and
# the gallery's own Triton kernels (``accel/kernels``: ``_gn_fwd_kernel``, ``_window_attn_bwd_kernel``...).
KINDS = [
    ("attention", r"fmha|flash|attention|sdpa|_attn"),
    ("GEGLU, cross-entropy kernels", r"^_(geglu|ce)_"),
    ("Triton: normalization fusions", r"^triton_.*(norm|welford)"),  # Inductor names fusions after their ops,
    ("Triton: other fusions", r"^triton_"),                          # "convolution" too: these come first
    ("convolution", r"conv|implicit|dgrad|wgrad|fprop|cudnn"),
    ("matmul", r"gemm|nvjet|cutlass|cublas|sm90_|s16816|wgmma|^aten::(mm|addmm|bmm)"),
    ("optimizer and EMA", r"adam|sgd|multi_tensor|foreach|ema"),
    ("normalization", r"norm|welford|^_(gn|ln)_"),
    ("copies and casts", r"copy|memcpy|memset|cast|elementwise_kernel|vectorized|^aten::to"),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def outermost_op(event):
    """The outermost ATen op around a profiler event (``aten::contiguous`` for the copy kernel its ``aten::clone``
    launched), or ``None`` (the kernels a CUDA graph replays hang off the compiled graph's call instead)."""
    outer = None
    while event is not None:
        if event.name.startswith("aten::"):
            outer = event
        event = event.cpu_parent
    return outer


_NOT_AN_OP = re.compile(r"cuda[A-Z]|cu[A-Z]|Lazy Function Loading|Activity Buffer Request|Buffer Flush")


def _launcher_rank(event) -> tuple[bool, bool]:
    """Among CPU events sharing a kernel's correlation id: inside an ATen op first, then anything but a CUDA runtime
    call or one of CUPTI's own records (so a compiled graph's call wins for the kernels its CUDA graph replays)."""
    return outermost_op(event) is not None, not _NOT_AN_OP.match(event.name)


def _timed_events(events, device_type: str):
    """``(name, microseconds, launching event)`` of each kernel (``device_type`` ``cuda``) or op (``cpu``), the one
    pass both of ``kernel_table``'s views read. GPU-side user annotations (``Optimizer.step#AdamW.step``) are ranges,
    not kernels."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    if device_type != "cuda":
        for event in events:
            if event.device_type == cpu:
                yield event.name, event.self_cpu_time_total, event
        return
    # The kernels torch's parser attached to the ops that launched them (read there, as events of torch 2.11 carry
    # no link); CPU events that share an op's id got the same kernels, and the op wins.
    by_id = defaultdict(list)
    for event in events:
        if event.device_type == cpu and event.kernels:
            by_id[event.id].append(event)
    ranges = {event.name for event in events if event.device_type == cuda and event.is_user_annotation}
    linked: dict[str, float] = defaultdict(float)
    for same_id in by_id.values():
        launcher = max(same_id, key=_launcher_rank)
        for kernel in launcher.kernels:
            if kernel.name not in ranges:
                linked[kernel.name] += kernel.duration
                yield kernel.name, kernel.duration, launcher
    timed: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type == cuda and not event.is_user_annotation:
            timed[event.name] += event.self_device_time_total
    for name, microseconds in timed.items():  # kernels no op is linked to count too, under none
        if microseconds - linked[name] > 1.0:
            yield name, microseconds - linked[name], None


def _launcher_label(launcher) -> str:
    op = outermost_op(launcher)
    return op.name if op is not None else launcher.name if launcher is not None else "(no launching op)"


def _largest_per_kind(per_launcher: dict[tuple[str, str], float], per_kind: int) -> list[dict]:
    shown: dict[str, int] = defaultdict(int)
    table = []
    for (kind, op), ms in sorted(per_launcher.items(), key=lambda kv: -kv[1]):
        shown[kind] += 1
        if shown[kind] <= per_kind:
            table.append({"kind": kind, "op": op, "ms": ms})
    return table


def kernel_table(prof: torch.profiler.profile, steps: int, device_type: str, top: int = 25,
                 per_kind: int = 8) -> dict:
    """Per-step time of each kernel (``device_type`` ``cuda``) or op (``cpu``) from a finished profiler, by kind, and
    by (kind, the outermost op that launched it), the ``per_kind`` largest of each kind: which calls the copies come
    from, say. Each kernel counts once in each view."""
    per_kernel: dict[str, float] = defaultdict(float)
    per_launcher: dict[tuple[str, str], float] = defaultdict(float)
    for name, microseconds, launcher in _timed_events(prof.events(), device_type):
        per_kernel[name] += microseconds / 1000 / steps
        per_launcher[kind_of(name), _launcher_label(launcher)] += microseconds / 1000 / steps
    by_kind: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        by_kind[kind_of(name)] += ms
    return {"profiled_steps": steps, "device": device_type, "kernel_ms_per_step": sum(by_kind.values()),
            "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [{"kernel": name[:160], "kind": kind_of(name), "ms": ms}
                               for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]],
            "top_launchers_ms": _largest_per_kind(per_launcher, per_kind)}


class StepProfiler:
    """Profiles the steps ``first <= step < first + count`` of the loop and, when they are done, keeps the table
    (``table``) and writes it to ``run_dir``'s ``profile.json`` with its kinds logged (``run_dir`` ``None``: kept
    only)."""

    def __init__(self, count: int, first: int, device: torch.device, run_dir: str | Path | None,
                 log: Callable[..., None] = print) -> None:
        self.count, self.first, self.device = count, first, device
        self.path = None if run_dir is None else Path(run_dir) / "profile.json"
        self.log = log
        self.table: dict | None = None
        self._prof: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        if self.count and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.first + self.count - 1:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        self.table = table = kernel_table(self._prof, self.count, self.device.type)
        self._prof = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(table, indent=1))
        total = table["kernel_ms_per_step"]
        self.log(f"[gallery] profile of steps {self.first}-{step}: {total:.1f} ms of {self.device.type} kernels a "
                 f"step, in {self.path}")
        for kind, ms in table["by_kind_ms"].items():
            self.log(f"[gallery]   {kind:30s} {ms:8.2f} ms  {100 * ms / max(total, 1e-9):5.1f}%")
        launchers = [f"{row['op']} {row['ms']:.2f} ms" for row in table["top_launchers_ms"]
                     if row["kind"] == "copies and casts"][:5]
        if launchers:
            self.log(f"[gallery]   copies and casts launched by: {', '.join(launchers)}")
