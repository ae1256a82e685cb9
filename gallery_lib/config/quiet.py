"""Known library messages that tell a gallery user nothing they can act on, dropped by their exact origin.

Each filter names one message of one library (never a blanket ``ignore``); ``verbose=True`` keeps them all:

- Dynamo's warning that diffusers' up/downsamplers call an ``lru_cache``-wrapped version check (Dynamo traces the
  function instead, which is correct; the warning prints code excerpts into every compiled SD run);
- ``torch.utils.cpp_extension``'s "No CUDA runtime is found" on a machine without a GPU, logged the first time
  Inductor builds a CPU kernel with a CUDA build of torch installed.
"""

from __future__ import annotations

import logging
import warnings

import torch

_DIFFUSERS_LRU_CACHE = r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function at '(up|down)sampling\.py"
_NO_CUDA_RUNTIME = "No CUDA runtime is found"


class _DropNoCudaRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_CUDA_RUNTIME)


def quiet_known_noise(verbose: bool = False) -> None:
    """Installs the filters in this process; nothing when ``verbose``. The training processes call it first, and so
    does what compiles in a notebook's own kernel (``compile_blocks``, ``StepLadder``, ``optimize``)."""
    if verbose:
        return
    warnings.filterwarnings("ignore", message=_DIFFUSERS_LRU_CACHE, category=UserWarning)
    if not torch.cuda.is_available():
        logger = logging.getLogger("torch.utils.cpp_extension")
        if not any(isinstance(f, _DropNoCudaRuntime) for f in logger.filters):
            logger.addFilter(_DropNoCudaRuntime())
