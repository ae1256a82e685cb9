"""The run's quiet filters drop exactly the known messages they name, and nothing with ``verbose``."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from gallery_lib.config.quiet import _DropNoCudaRuntime, quiet_known_noise

DIFFUSERS = ("Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'upsampling.py:156'. Dynamo "
             "ignores the cache wrapper and directly traces the wrapped function.")
OTHER = "Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'my_model.py:12'."


def _shown(verbose: bool) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:  # restores the filters afterwards
        warnings.simplefilter("always")
        quiet_known_noise(verbose)
        for message in (DIFFUSERS, OTHER, "something else"):
            warnings.warn(message, UserWarning)
    return [str(w.message) for w in caught]


def test_only_the_diffusers_lru_cache_warning_is_dropped():
    assert _shown(verbose=False) == [OTHER, "something else"]
    assert _shown(verbose=True) == [DIFFUSERS, OTHER, "something else"]


def _remove_no_cuda_filters(logger: logging.Logger) -> None:
    for f in [f for f in logger.filters if isinstance(f, _DropNoCudaRuntime)]:
        logger.removeFilter(f)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-runtime message is only dropped without a GPU")
def test_no_cuda_runtime_log_is_dropped_on_a_cpu_machine(caplog):
    logger = logging.getLogger("torch.utils.cpp_extension")
    quiet_known_noise()
    quiet_known_noise()  # once is enough: no second filter
    try:
        assert sum(isinstance(f, _DropNoCudaRuntime) for f in logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
            logger.warning("Error checking compiler version")
        assert [r.getMessage() for r in caplog.records] == ["Error checking compiler version"]
    finally:
        _remove_no_cuda_filters(logger)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-runtime message is only dropped without a GPU")
@pytest.mark.parametrize("caller", ["compile_blocks", "StepLadder"])
def test_what_compiles_in_a_notebook_kernel_is_as_quiet_as_a_run(caller):
    """``compile_blocks`` (and ``accelerate`` through it) and ``StepLadder``'s rungs compile in the user's own
    process: the message printed a red stderr box into the SD, DreamBooth and your_model notebooks."""
    from gallery_lib import StepLadder, compile_blocks

    logger = logging.getLogger("torch.utils.cpp_extension")
    _remove_no_cuda_filters(logger)
    try:
        if caller == "compile_blocks":
            compile_blocks(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)]), [torch.nn.Linear])
        else:
            StepLadder(batch_size=2, warmup=1, device="cpu")
        assert any(isinstance(f, _DropNoCudaRuntime) for f in logger.filters)
    finally:
        _remove_no_cuda_filters(logger)
