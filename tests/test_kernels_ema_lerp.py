"""The fused EMA kernel (``kernels/ema_lerp.py``) against ``torch.lerp`` on odd sizes and mixed dtypes.

The kernel runs on CPU tensors through ``TRITON_INTERPRET=1`` (logic, not speed); ``test_ema.py`` checks every
``ModelEma`` mode, the fused one on a GPU, against the per-tensor loop.
"""

import os
import subprocess
import sys

import pytest
import torch

from gallery_lib.accel.kernels.ema_lerp import foreach_lerp_


def test_fused_kernel_logic_under_triton_interpreter():
    """Runs the Triton kernel on CPU tensors through TRITON_INTERPRET=1 (logic only, not speed)."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from gallery_lib.accel.kernels.ema_lerp import fused_lerp_\n"
        "torch.manual_seed(0)\n"
        "sizes = [1, 5, 4096, 4097, 9000, 0, 3]\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    ema = [torch.randn(s).to(dt) for s in sizes]; model = [torch.randn(s).to(dt) for s in sizes]\n"
        "    ema.append(torch.randn(6, 4).t()); model.append(torch.randn(4, 6))  # non-contiguous: foreach rest\n"
        "    ref = [e.clone() for e in ema]\n"
        "    for w, programs in ((0.3, None), (0.9, 2), (1.0, 3)):\n"
        "        for r, m in zip(ref, model): r.lerp_(m.to(r.dtype), w)\n"
        "        fused_lerp_(ema, model, w, programs=programs)\n"
        "    for e, r in zip(ema, ref): torch.testing.assert_close(e, r, rtol=0, atol=0)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_reference_groups_mixed_dtypes():
    ema = [torch.zeros(3), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(2)]
    model = [torch.ones(3), torch.ones(5, dtype=torch.bfloat16), torch.full((2,), 4.0)]
    foreach_lerp_(ema, model, 0.25)
    assert [e.tolist() for e in ema] == [[0.25] * 3, [0.25] * 5, [1.0, 1.0]] and ema[1].dtype == torch.bfloat16
