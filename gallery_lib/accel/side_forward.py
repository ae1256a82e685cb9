"""A forward pass run on the side of a training run, to look at the model, leaving the run as it would have been.

Two things look at the model that way before the first step: ``precompile`` records the blocks' calls, and
``attention`` records what PyTorch's SDPA dispatch picks. Both need one eager forward of the real batch, and neither may
change what the run then computes or how fast it gets there:

- RNG states (CPU and the current CUDA device) are restored, so dropout and noise draws are the run's own;
- the model's buffers are restored: a forward in training mode moves BatchNorm's running statistics;
- compiled code runs eagerly (``set_stance("force_eager")``): looking must not trigger compilation;
- cuDNN's autotuning is off: with ``cudnn.benchmark`` every new convolution shape is timed on its first call, seconds
  spent before the workers get their queue; the run's own first calls do that tuning, later and overlapped.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def side_forward(model: torch.nn.Module) -> Iterator[None]:
    """A forward of ``model`` inside it leaves the run as it was (above)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    cudnn = torch.backends.cudnn
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"), cudnn.flags(
                enabled=cudnn.enabled, benchmark=False, deterministic=cudnn.deterministic,
                allow_tf32=cudnn.allow_tf32):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
