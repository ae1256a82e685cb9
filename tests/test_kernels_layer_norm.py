"""LayerNorm kernel: Triton (interpreter on CPU) and fallback paths against torch, opcheck, compile, GPU."""

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import (assert_within_torch_error, gpu_matrix, make_path_fixture, reference_dtype,
                            run_file_in_interpreter)

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import layer_norm, set_triton_enabled
from gallery_lib.accel.kernels.layer_norm import layer_norm_bwd, layer_norm_fwd


def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


path = make_path_fixture("_ln_fwd_kernel")


def run(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    y.backward(dy)
    return [y] + [t.grad if t is not None else None for t in leaves]


# (shape, affine, max_block): a single row, prime widths, many rows per program (strided backward loop),
# and small max_block values that force the multi-block (Welford + read-modify-write partials) path.
CASES = [
    ((1, 37), True, 4096),
    ((3, 7, 13), True, 4096),
    ((70, 5), True, 4096),
    ((2, 96), False, 4096),
    ((1, 37), True, 8),
    ((9, 41), True, 16),
    ((5, 3, 23), False, 4),
]


@pytest.mark.isa
@pytest.mark.parametrize("shape,affine,max_block", CASES)
def test_forward_and_grads_match_torch(path, shape, affine, max_block):
    gen = torch.Generator().manual_seed(0)
    d = shape[-1]
    x = torch.randn(shape, generator=gen) * 3 + 2
    w = torch.randn(d, generator=gen) if affine else None
    b = torch.randn(d, generator=gen) if affine else None
    dy = torch.randn(shape, generator=gen)
    expected = run(lambda x, w, b: F.layer_norm(x, (d,), w, b, 1e-5), (x, w, b), dy)
    with tu.set_max_block(max_block):
        got = run(lambda x, w, b: layer_norm(x, w, b, 1e-5), (x, w, b), dy)
    assert path == "fallback" or tu.launch_counts["_ln_bwd_kernel"] > 0
    for name, g, e in zip(("out", "dx", "dweight", "dbias"), got, expected):
        if e is None:
            assert g is None, name
            continue
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of both ops (reference path on CPU)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 10, generator=gen, requires_grad=True)
    w = torch.randn(10, generator=gen, requires_grad=True)
    b = torch.randn(10, generator=gen, requires_grad=True)
    with set_triton_enabled(False):
        torch.library.opcheck(layer_norm_fwd, (x, w, b, 1e-5))
        torch.library.opcheck(layer_norm_fwd, (x, None, None, 1e-6))
        y, mean, rstd = layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1e-5)
        torch.library.opcheck(layer_norm_bwd, (torch.randn_like(y), x.detach(), w.detach(), mean, rstd))


@pytest.mark.isa
def test_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, generator=gen, requires_grad=True)
    fn = torch.compile(lambda x, w: layer_norm(x, w, None).square().sum(), backend="aot_eager", fullgraph=True)
    fn(x, w).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.layer_norm(x2, (8,), w2, None).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=1e-5)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="weight"):
        layer_norm(torch.randn(2, 8), torch.ones(7))


# Swin-T widths (96..768, 56x56 down to 7x7 tokens, batch 128) and SD transformer widths (320..1280).
GPU_SHAPES = [(128 * 56 * 56, 96), (128 * 28 * 28, 192), (128 * 14 * 14, 384), (128 * 7 * 7, 768),
              (8 * 4096, 320), (8 * 1024, 640), (8 * 256, 1280), (1000, 5000)]


@gpu_matrix
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_real_shapes(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    d = shape[-1]
    x = torch.randn(shape, device="cuda", generator=gen)
    w = torch.randn(d, device="cuda", generator=gen)
    b = torch.randn(d, device="cuda", generator=gen)
    dy = torch.randn(shape, device="cuda", generator=gen)
    torch_ln = lambda x, w, b: F.layer_norm(x, (d,), w, b)  # noqa: E731
    rd = reference_dtype(dtype)
    ref = run(torch_ln, (x.to(rd), w.to(rd), b.to(rd)), dy.to(rd))
    ours = run(lambda x, w, b: layer_norm(x, w, b), (x.to(dtype), w, b), dy.to(dtype))
    theirs = run(torch_ln, (x.to(dtype), w.to(dtype), b.to(dtype)), dy.to(dtype))
    assert_within_torch_error(("out", "dx", "dweight", "dbias"), ours, theirs, ref, dtype)


def test_streaming_eviction_rule():
    """Forward loads are marked evict-first only on a GPU where the input fits in L2, unless a knob forces it."""
    x = torch.randn(4, 8)
    assert tu.streaming_eviction(x) == ""  # no GPU, no hint
    assert tu.streaming_eviction(x, True) == "evict_first" and tu.streaming_eviction(x, False) == ""


@pytest.mark.gpu
def test_streaming_eviction_follows_l2_size():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    small = torch.empty(l2 // 2, dtype=torch.uint8, device="cuda")
    large = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    assert tu.streaming_eviction(small) == "evict_first" and tu.streaming_eviction(large) == ""
