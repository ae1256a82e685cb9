"""Model FLOPs utilisation (MFU): training FLOPs per sample, and the GPU's measured matmul rate to divide by.

``train_flops_per_sample`` counts one forward and backward pass of a fresh copy of the trained model built on the
``meta`` device (no memory, no compute) with ``torch.utils.flop_counter.FlopCounterMode``, so it costs a second of
Python even for the 860M-parameter UNet. Only matmuls, convolutions and attention are counted (FlopCounterMode's
rules), which is the usual MFU convention.

MFU is reported against ``measured_matmul_tflops``: the rate of a large bf16 matmul timed on this very GPU (as the
issue's reference numbers are), not the datasheet peak, which no real kernel reaches.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

_logger = logging.getLogger(__name__)


def train_flops_per_sample(build_on_meta: Callable[[], torch.nn.Module],
                           loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> float | None:
    """FLOPs of forward + backward for one sample: ``loss_of(model)`` must run the model on a batch of one."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.device("meta"):
            model = build_on_meta()
            counter = FlopCounterMode(display=False)
            with counter:
                loss_of(model).backward()
        return float(counter.get_total_flops())
    except Exception as exc:  # counting is a report nicety: a model the meta device cannot run just has no MFU
        _logger.warning("could not count the training FLOPs on the meta device (%s); MFU is not reported", exc)
        return None


def measured_matmul_tflops(device: torch.device, size: int = 8192, iters: int = 20) -> float | None:
    """Median TFLOP/s of a ``size``-cubed bfloat16 matmul on a CUDA ``device`` (``None`` on a CPU)."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median_ms = sorted(times)[len(times) // 2]
    return 2 * size**3 / (median_ms * 1e-3) / 1e12
