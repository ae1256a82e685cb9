"""Process-wide torch switches that Inductor's cache key holds, set only where they differ from the process's.

Even a no-op assignment changes the key: setting fp32 matmul precision or TF32 switches the newer ``fp32_precision``
setting from ``"none"`` to a value, and every graph would then miss what a fresh process compiled.
"""

from __future__ import annotations

import torch


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
