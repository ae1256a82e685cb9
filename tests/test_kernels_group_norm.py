"""GroupNorm(+SiLU) kernel: Triton (interpreter on CPU) and fallback paths against torch, opcheck, compile, GPU."""

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import (assert_within_torch_error, gpu_matrix, make_path_fixture, reference_dtype,
                            run_file_in_interpreter)

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import group_norm, set_triton_enabled
from gallery_lib.accel.kernels.group_norm import _plan, group_norm_bwd, group_norm_fwd


@pytest.mark.slow  # over 30 s on 2 cores: left out of the fast tier
def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


def reference(x, groups, weight, bias, eps, activation):
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y


path = make_path_fixture("_gn_fwd_kernel")


def run(fn, x, weight, bias, dy):
    x, weight, bias = (t.detach().clone().requires_grad_(t is not None) if t is not None else None
                       for t in (x, weight, bias))
    y = fn(x, weight, bias)
    y.backward(dy)
    return y, x.grad, weight.grad if weight is not None else None, bias.grad if bias is not None else None


# (shape, groups, channels_last, activation, affine, max_block): primes, one group per channel, a single sample,
# 3-D input and small max_block values that force the multi-block loops over channels and spatial positions.
CASES = [
    ((2, 6, 5, 5), 3, False, "silu", True, 4096),
    ((2, 6, 5, 5), 3, True, "silu", True, 4096),
    ((1, 14, 7, 3), 2, True, None, True, 16),
    ((3, 14, 7, 3), 2, False, "silu", True, 8),
    ((2, 7, 11), 7, False, "silu", True, 4),
    ((2, 13, 3, 5), 1, True, "silu", False, 8),
    ((4, 8, 1, 1), 4, False, None, True, 4096),
    # SD-like 10 channels per group: windows of 8 channels straddle groups, several splits (both layouts), and
    # the fused plan's windows of 3 groups (30 channels in 32 lanes) and of 6 (120 in 128, 16-byte aligned rows),
    # each with a partial last window.
    ((2, 40, 6, 6), 4, True, "silu", True, 16),
    ((2, 40, 6, 6), 4, False, "silu", False, 16),
    ((3, 40, 3, 3), 4, True, "silu", True, 4096),
    ((2, 160, 3, 3), 8, True, None, True, 4096),
    ((2, 24, 2, 2), 2, False, None, True, 8),
]


@pytest.mark.isa
@pytest.mark.parametrize("shape,groups,channels_last,activation,affine,max_block", CASES)
def test_forward_and_grads_match_torch(path, shape, groups, channels_last, activation, affine, max_block):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    weight = torch.randn(c, generator=gen) if affine else None
    bias = torch.randn(c, generator=gen) if affine else None
    dy = torch.randn(shape, generator=gen)
    expected = run(lambda x, w, b: reference(x, groups, w, b, 1e-5, activation), x, weight, bias, dy)
    with tu.set_max_block(max_block):
        got = run(lambda x, w, b: group_norm(x, groups, w, b, 1e-5, activation), x, weight, bias, dy)
    if path == "triton":  # the cases cover both plans: one fused launch, and statistics + normalize launches
        with tu.set_max_block(max_block):
            fused = _plan(x, groups, channels_last).fused
        assert tu.launch_counts["_gn_fwd_kernel"] == (1 if fused else 2)
        assert tu.launch_counts["_gn_bwd_kernel"] == (1 if fused else 2)
    if channels_last:
        assert got[0].is_contiguous(memory_format=torch.channels_last)
    for name, g, e in zip(("out", "dx", "dweight", "dbias"), got, expected):
        if e is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("max_block", [8, 4096])  # split and fused plans
def test_large_mean_is_stable(path, max_block):
    """Shifted statistics: a mean 1e4 times the spread must not cancel into a wrong variance."""
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1)) + 1e4
    with tu.set_max_block(max_block):
        got = group_norm(x, 2)
    torch.testing.assert_close(got, F.group_norm(x.double(), 2).float(), atol=5e-3, rtol=0)


@pytest.mark.slow  # over 10 s on 2 cores: left out of the fast tier
def test_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of both ops (reference path on CPU)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 3, generator=gen, requires_grad=True)
    w = torch.randn(6, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    with set_triton_enabled(False):
        torch.library.opcheck(group_norm_fwd, (x, w, b, 3, 1e-5, True))
        torch.library.opcheck(group_norm_fwd, (x.to(memory_format=torch.channels_last), None, None, 2, 1e-6, False))
        y, mean, rstd = group_norm_fwd(x.detach(), w.detach(), b.detach(), 3, 1e-5, True)
        torch.library.opcheck(group_norm_bwd, (torch.randn_like(y), x.detach(), w.detach(), b.detach(), mean, rstd,
                                               3, True))


@pytest.mark.isa
def test_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 4, 4, generator=gen, requires_grad=True)
    w = torch.randn(6, generator=gen, requires_grad=True)
    fn = torch.compile(lambda x, w: group_norm(x, 3, w, None, 1e-5, "silu").square().sum(),
                       backend="aot_eager", fullgraph=True)
    fn(x, w).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference(x2, 3, w2, None, 1e-5, "silu").square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(groups=4), "divisible"), (dict(activation="relu"), "activation"), (dict(weight=torch.ones(5)), "weight"),
])
def test_bad_input_raises(bad, match):
    args = dict(groups=3, activation=None, weight=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        group_norm(torch.randn(2, 6, 3, 3), args["groups"], args["weight"], None, 1e-5, args["activation"])


# SD-1.x UNet GroupNorm shapes: 32 groups, (channels, resolution) pairs seen from 64x64 down to 8x8.
SD_SHAPES = [(8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (64, 1280, 8, 8), (16, 960, 32, 32)]


@gpu_matrix
@pytest.mark.parametrize("shape", SD_SHAPES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_gpu_sd_shapes(shape, dtype, channels_last, activation):
    gen = torch.Generator(device="cuda").manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape, device="cuda", generator=gen).to(memory_format=fmt)
    w = torch.randn(shape[1], device="cuda", generator=gen)
    b = torch.randn(shape[1], device="cuda", generator=gen)
    dy = torch.randn(shape, device="cuda", generator=gen)
    torch_gn = lambda x, w, b: reference(x, 32, w, b, 1e-5, activation)  # noqa: E731
    rd = reference_dtype(dtype)
    ref = run(torch_gn, x.to(rd), w.to(rd), b.to(rd), dy.to(rd))
    ours = run(lambda x, w, b: group_norm(x, 32, w, b, 1e-5, activation), x.to(dtype), w, b, dy.to(dtype))
    theirs = run(torch_gn, x.to(dtype), w.to(dtype), b.to(dtype), dy.to(dtype))
    assert_within_torch_error(("out", "dx", "dweight", "dbias"), ours, theirs, ref, dtype)
