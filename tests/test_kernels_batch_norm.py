"""BatchNorm(+residual, +ReLU) kernel: Triton (interpreter on CPU) and fallback paths against torch, opcheck, compile,
the module's running statistics and eval mode, and GPU parity at ResNet-50's shapes."""

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import (assert_within_torch_error, gpu_matrix, make_path_fixture, reference_dtype,
                            run_file_in_interpreter)

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import batch_norm_act, set_triton_enabled
from gallery_lib.accel.kernels.batch_norm import _plan, batch_norm_act_bwd, batch_norm_act_fwd
from gallery_lib.accel.modules import FusedBatchNormAct


def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


def reference(x, weight, bias, eps, residual, relu):
    y = F.batch_norm(x, None, None, weight, bias, training=True, eps=eps)
    if residual is not None:
        y = y + residual
    return F.relu(y) if relu else y


path = make_path_fixture("_bn_stats_kernel")


def run(fn, x, weight, bias, residual, dy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
    y = fn(*leaves)
    y.backward(dy)
    return (y, *(t.grad if t is not None else None for t in leaves))


# (shape, channels_last, residual, relu, affine, max_block): odd channel counts (a masked channel tail), a single
# pixel per sample, 2-D input, and small max_block values that force several row tiles per split and several splits.
CASES = [
    ((3, 5, 7, 3), True, True, True, True, 4096),
    ((3, 5, 7, 3), True, False, True, True, 16),
    ((2, 70, 3, 5), True, True, False, True, 64),
    ((2, 70, 3, 5), True, False, False, False, 8),
    ((9, 13, 1, 1), True, True, True, True, 8),
    ((11, 6), False, False, True, True, 4),
    ((5, 130, 2, 3), True, True, True, True, 4096),
]


@pytest.mark.parametrize("shape,channels_last,residual,relu,affine,max_block", CASES)
def test_forward_and_grads_match_torch(path, shape, channels_last, residual, relu, affine, max_block):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    weight = torch.randn(c, generator=gen) if affine else None
    bias = torch.randn(c, generator=gen) if affine else None
    res = torch.randn(shape, generator=gen).to(memory_format=torch.channels_last if channels_last else
                                               torch.contiguous_format) if residual else None
    dy = torch.randn(shape, generator=gen)
    expected = run(lambda x, w, b, r: reference(x, w, b, 1e-5, r, relu), x, weight, bias, res, dy)
    with tu.set_max_block(max_block):
        got = run(lambda x, w, b, r: batch_norm_act(x, w, b, 1e-5, r, relu)[0], x, weight, bias, res, dy)
    if path == "triton":
        assert tu.launch_counts["_bn_bwd_apply_kernel"] == 1
    if channels_last:
        assert got[0].is_contiguous(memory_format=torch.channels_last)
        assert got[1].is_contiguous(memory_format=torch.channels_last)
    for name, g, e in zip(("out", "dx", "dweight", "dbias", "dresidual"), got, expected):
        if e is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_several_splits_and_tiles():
    """The plan the cases above rely on: several row tiles per split and several splits, merged."""
    x = torch.randn(4, 8, 6, 6).to(memory_format=torch.channels_last)
    with tu.set_max_block(16):
        plan = _plan(x)
    assert plan.split > 1 and plan.rows_per > plan.meta["BLOCK_M"]


def test_nchw_input_takes_the_reference():
    """NCHW input is not a row-major (M, C) matrix: the PyTorch reference serves it, with the same results."""
    gen = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(4, 6, 5, 5, generator=gen) for _ in range(3))
    w, b = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    tu.launch_counts.clear()
    got = run(lambda x, w, b, r: batch_norm_act(x, w, b, 1e-5, r, True)[0], x, w, b, r, dy)
    assert not tu.launch_counts
    expected = run(lambda x, w, b, r: reference(x, w, b, 1e-5, r, True), x, w, b, r, dy)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_block", [8, 4096])
def test_large_mean_is_stable(path, max_block):
    """Shifted statistics: a mean 1e4 times the spread must not cancel into a wrong variance."""
    x = (torch.randn(6, 4, 5, 5, generator=torch.Generator().manual_seed(1)) + 1e4).to(
        memory_format=torch.channels_last)
    with tu.set_max_block(max_block):
        got, stats = batch_norm_act(x)
    torch.testing.assert_close(got, F.batch_norm(x.double(), None, None, training=True).float(), atol=5e-3, rtol=0)
    torch.testing.assert_close(stats[2].double(), x.double().var(dim=(0, 2, 3), unbiased=False), rtol=1e-3, atol=0)


def test_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of both ops (reference path on CPU)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 3, 3, generator=gen, requires_grad=True).to(memory_format=torch.channels_last)
    w = torch.randn(6, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    r = torch.randn(3, 6, 3, 3, generator=gen, requires_grad=True)
    with set_triton_enabled(False):
        torch.library.opcheck(batch_norm_act_fwd, (x, r, w, b, 1e-5, True))
        torch.library.opcheck(batch_norm_act_fwd, (x, None, None, None, 1e-3, False))
        y, stats = batch_norm_act_fwd(x.detach(), r.detach(), w.detach(), b.detach(), 1e-5, True)
        torch.library.opcheck(batch_norm_act_bwd, (torch.randn_like(y), x.detach(), y, w.detach(), b.detach(), stats,
                                                   True, True))


def test_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 4, 4, generator=gen).to(memory_format=torch.channels_last).requires_grad_()
    r = torch.randn(3, 6, 4, 4, generator=gen, requires_grad=True)
    w = torch.randn(6, generator=gen, requires_grad=True)
    fn = torch.compile(lambda x, r, w: batch_norm_act(x, w, None, 1e-5, r, True)[0].square().sum(),
                       backend="aot_eager", fullgraph=True)
    fn(x, r, w).backward()
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, r, w))
    reference(x2, w2, None, 1e-5, r2, True).square().sum().backward()
    for got, expected in ((x.grad, x2.grad), (r.grad, r2.grad), (w.grad, w2.grad)):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(weight=torch.ones(5)), "weight"), (dict(residual=torch.ones(2, 6, 3)), "residual"),
    (dict(x=torch.randn(1, 6, 1, 1)), "more than one value"), (dict(x=torch.randn(6)), r"\(N, C"),
])
def test_bad_input_raises(bad, match):
    args = dict(x=torch.randn(2, 6, 3, 3), weight=None, residual=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        batch_norm_act(args["x"], args["weight"], None, 1e-5, args["residual"], True)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_module_tracks_running_stats_like_batchnorm(path, momentum):
    """Three training steps, then eval: running statistics, the batch counter and the eval output match
    ``nn.BatchNorm2d`` + add + ReLU, and the module shares the original's parameters and buffers."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(7, momentum=momentum)
    twin = torch.nn.BatchNorm2d(7, momentum=momentum)
    twin.load_state_dict(bn.state_dict())
    fused = FusedBatchNormAct.from_module(bn, relu=True)
    assert fused.weight is bn.weight and fused.running_var is bn.running_var
    assert list(fused.state_dict()) == list(bn.state_dict())
    for _ in range(3):
        x = (torch.randn(4, 7, 3, 5) * 3 + 1).to(memory_format=torch.channels_last)
        r = torch.randn(4, 7, 3, 5).to(memory_format=torch.channels_last)
        torch.testing.assert_close(fused(x, r), F.relu(twin(x) + r), atol=1e-5, rtol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, name), getattr(twin, name), atol=1e-6, rtol=1e-5)
    fused.eval(), twin.eval()
    torch.testing.assert_close(fused(x, r), F.relu(twin(x) + r), atol=1e-5, rtol=1e-5)


# ResNet-50's batch-norm shapes at batch 32 (the bench runs 256): the stem, each stage's widths, and the residual
# add + ReLU of a bottleneck's last norm.
RESNET_SHAPES = [((32, 64, 112, 112), False), ((32, 256, 56, 56), True), ((32, 128, 28, 28), False),
                 ((32, 1024, 14, 14), True), ((32, 2048, 7, 7), True), ((32, 512, 7, 7), False)]


@gpu_matrix
@pytest.mark.parametrize("shape,residual", RESNET_SHAPES)
def test_gpu_resnet_shapes(shape, residual, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cl = dict(memory_format=torch.channels_last)
    x = torch.randn(shape, device="cuda", generator=gen).to(**cl) * 2 + 0.5
    w = torch.randn(shape[1], device="cuda", generator=gen)
    b = torch.randn(shape[1], device="cuda", generator=gen)
    r = torch.randn(shape, device="cuda", generator=gen).to(**cl) if residual else None
    dy = torch.randn(shape, device="cuda", generator=gen).to(**cl)
    rd = reference_dtype(dtype)

    def cast(t, dt):
        return t.to(dt) if t is not None else None

    torch_bn = lambda x, w, b, r: reference(x, w, b, 1e-5, r, True)  # noqa: E731
    ref = run(torch_bn, x.to(rd), w.to(rd), b.to(rd), cast(r, rd), dy.to(rd))
    ours = run(lambda x, w, b, r: batch_norm_act(x, w, b, 1e-5, r, True)[0], x.to(dtype), w, b, cast(r, dtype),
               dy.to(dtype))
    theirs = run(torch_bn, x.to(dtype), w.to(dtype), b.to(dtype), cast(r, dtype), dy.to(dtype))
    names = ("out", "dx", "dweight", "dbias", "dresidual")[:5 if residual else 4]
    assert_within_torch_error(names, ours[:len(names)], theirs[:len(names)], ref[:len(names)], dtype)
