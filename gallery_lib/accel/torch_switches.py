"""Process-wide torch switches that Inductor's cache key holds, set only where they differ from the process's.

Even a no-op assignment changes the key: setting fp32 matmul precision or TF32 switches the newer ``fp32_precision``
setting from ``"none"`` to a value, and every graph would then miss what a fresh process compiled.
"""

from __future__ import annotations

import os

import torch

WORKER_CAP_ENV = "GALLERY_WORKER_GPU_MEMORY_GIB"
"""What each precompile worker may reserve, in GiB: the training process sets it for the workers it starts."""


def set_deterministic_algorithms(enabled: bool) -> None:
    """Deterministic algorithms on (warning where an op has none) or off, as a fresh process has them."""
    if torch.are_deterministic_algorithms_enabled() != enabled:
        torch.use_deterministic_algorithms(enabled, warn_only=enabled)


def set_float32_matmul_precision(precision: str) -> None:
    if torch.get_float32_matmul_precision() != precision:
        torch.set_float32_matmul_precision(precision)


def set_tf32(matmul: bool, cudnn: bool) -> None:
    """TF32 for CUDA's fp32 matmuls and cuDNN's convolutions."""
    if torch.backends.cuda.matmul.allow_tf32 != matmul:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    if torch.backends.cudnn.allow_tf32 != cudnn:
        torch.backends.cudnn.allow_tf32 = cudnn


def cap_gpu_memory(gib: float | None, device: torch.device) -> None:
    """Caps what this process's CUDA allocator may reserve on ``device`` at ``gib`` (no cap: ``None``, or a CPU)."""
    if gib is None or device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index  # the allocator wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)


def cap_worker_gpu_memory(device: torch.device) -> None:
    """A precompile worker's cap, from ``WORKER_CAP_ENV`` where its training process set one."""
    text = os.environ.get(WORKER_CAP_ENV)
    cap_gpu_memory(float(text) if text else None, device)
