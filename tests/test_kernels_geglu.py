"""GEGLU gate kernel: Triton (interpreter on CPU) and fallback paths against torch, opcheck, compile, GPU."""

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import (assert_within_torch_error, gpu_matrix, make_path_fixture, reference_dtype,
                            run_file_in_interpreter)

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import geglu, set_triton_enabled
from gallery_lib.accel.kernels.geglu import geglu_bwd, geglu_fwd


def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


path = make_path_fixture("_geglu_fwd_kernel")


def reference(h):
    """diffusers ``GEGLU.forward`` after the projection: the first half is the value, the second the gate."""
    value, gate = h.chunk(2, dim=-1)
    return value * F.gelu(gate)


def run(fn, h, dy):
    h = h.detach().clone().requires_grad_()
    y = fn(h)
    y.backward(dy)
    return y, h.grad


# (shape of h, max_block): one row, an odd half-width, several column blocks per row, a leading batch of dims,
# several row tiles with a partial last one (300 rows in 64-row tiles of a masked 64-wide block for d=48), and
# exact column blocks that divide the width (d=96 in three 32-wide blocks, 130 rows in two tiles).
CASES = [((1, 2), 4096), ((5, 46), 4096), ((3, 7, 74), 4096), ((4, 74), 8), ((2, 3, 2 * 1031), 4096),
         ((300, 2 * 48), 4096), ((130, 2 * 96), 32)]


@pytest.mark.isa
@pytest.mark.parametrize("shape,max_block", CASES)
def test_forward_and_grad_match_torch(path, shape, max_block):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(shape, generator=gen) * 2
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    expected = run(reference, h, dy)
    with tu.set_max_block(max_block):
        got = run(geglu, h, dy)
    assert path == "fallback" or tu.launch_counts["_geglu_bwd_kernel"] > 0
    for name, g, e in zip(("out", "dh"), got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of both ops (reference path on CPU)."""
    h = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with set_triton_enabled(False):
        torch.library.opcheck(geglu_fwd, (h,))
        torch.library.opcheck(geglu_bwd, (torch.randn(3, 4, 5), h.detach()))


@pytest.mark.isa
def test_compiles_without_graph_break():
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    torch.compile(lambda h: geglu(h).square().sum(), backend="aot_eager", fullgraph=True)(h).backward()
    h2 = h.detach().clone().requires_grad_()
    reference(h2).square().sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-5)


def test_odd_width_raises():
    with pytest.raises(ValueError, match="even"):
        geglu(torch.randn(2, 7))


# SD-1.x FeedForward: tokens x (2 * 4 * width) for the 64x64 .. 8x8 transformer blocks, batch 8.
GPU_SHAPES = [(8 * 4096, 2 * 1280), (8 * 1024, 2 * 2560), (8 * 256, 2 * 5120), (8 * 64, 2 * 5120)]


@gpu_matrix
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_real_shapes(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(shape, device="cuda", generator=gen)
    dy = torch.randn(shape[0], shape[1] // 2, device="cuda", generator=gen)
    rd = reference_dtype(dtype)
    ref = run(reference, h.to(rd), dy.to(rd))
    ours = run(geglu, h.to(dtype), dy.to(dtype))
    theirs = run(reference, h.to(dtype), dy.to(dtype))
    assert_within_torch_error(("out", "dh"), ours, theirs, ref, dtype)


def test_column_block_divides_sd_widths():
    """SD's half-widths get unmasked column blocks; widths with no wide power-of-two divisor get a masked one."""
    from gallery_lib.accel.kernels.geglu import _column_block

    assert [_column_block(d) for d in (1280, 2560, 5120, 320)] == [256, 512, 1024, 64]
    assert _column_block(1031) == 1024 and _column_block(23) == 32 and _column_block(1) == 1
