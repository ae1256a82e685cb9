"""Shared pieces of the kernel tests: the interpreter child, the Triton/fallback ``path`` fixture, the GPU rule.

Triton's interpreter must be switched on (``TRITON_INTERPRET=1``) before ``import triton``, so each kernel
test file re-runs its Triton-path cases in a child process that starts with the variable set; in the parent
those cases skip, and the child must pass them all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import set_triton_enabled

INTERPRETER_ONLY = "Triton-path case: runs in the TRITON_INTERPRET=1 child of test_interpreter_subprocess"


def run_file_in_interpreter(test_file: str) -> None:
    """Runs ``test_file``'s Triton-path cases in a fresh interpreter process; fails on any failure or skip."""
    if tu.interpreter_ready():
        pytest.skip("this process already runs the Triton-path cases directly")
    assert tu.has_triton, "triton is not installed: the kernels cannot be tested"
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-k", "triton", "-p", "no:cacheprovider"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-6000:]


def make_path_fixture(kernel_name: str):
    """A fixture running each test on the Triton kernel (interpreted on CPU) and on the fallback, proving which ran."""

    @pytest.fixture(params=["triton", "fallback"])
    def path(request, monkeypatch):
        if request.param == "triton":
            if not tu.interpreter_ready():
                pytest.skip(INTERPRETER_ONLY)
            tu.launch_counts.clear()
            yield "triton"
            assert tu.launch_counts[kernel_name] > 0
        else:
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            with set_triton_enabled(False):
                tu.launch_counts.clear()
                yield "fallback"
                assert not tu.launch_counts

    return path


# The GPU matrix of every kernel test; ids make ``-k fp32`` select one dtype.
GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gpu_matrix(test):
    """Marks a GPU parity test (``gpu`` marker: conftest skips it without CUDA) and parametrizes its ``dtype``."""
    return pytest.mark.gpu(pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp32", "bf16", "fp16"])(test))


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the reference a GPU test measures errors against: fp64 for fp32 runs, fp32 for bf16/fp16."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def assert_within_torch_error(names, ours, theirs, reference, dtype, atol: float | None = 1e-6) -> None:
    """The GPU parity rule: each of our outputs/grads is within 2x PyTorch's own error in ``dtype``, + ``atol``.

    ``ours`` and ``theirs`` (PyTorch's op run in ``dtype``) are both compared with ``reference``, computed in
    `reference_dtype` (fp64 for fp32: fp32 kernels round differently from PyTorch's, so a fixed tolerance either
    fails real shapes or hides bugs; PyTorch's own error sets the scale). NaN never passes. ``atol=None`` allows two
    ulps of ``dtype`` at the reference's largest magnitude instead: the CPU tests' fp32 rule, which stays tight for
    values far below 1 (PyTorch's own CPU error depends on which vectorized exp the processor runs).
    """
    for name, o, t, e in zip(names, ours, theirs, reference):
        assert not o.isnan().any(), name
        err, torch_err = (o.double() - e.double()).abs().max(), (t.double() - e.double()).abs().max()
        slack = atol if atol is not None else 2 * torch.finfo(dtype).eps * e.double().abs().max().item()
        assert err <= 2 * torch_err + slack, f"{name}: ours {err:.3g} vs torch {dtype} {torch_err:.3g}"
