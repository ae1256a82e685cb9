"""Soft-target cross-entropy kernel: Triton (interpreter on CPU) and fallback paths vs torch, opcheck, compile, GPU."""

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import (assert_within_torch_error, gpu_matrix, make_path_fixture, reference_dtype,
                            run_file_in_interpreter)

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import set_triton_enabled, soft_cross_entropy
from gallery_lib.accel.kernels.cross_entropy import soft_cross_entropy_bwd, soft_cross_entropy_fwd


def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


path = make_path_fixture("_ce_fwd_kernel")


def reference(logits, target, smoothing):
    """Soft-target CE with label smoothing written out: -sum(((1-eps) t + eps/V) * log_softmax(x)), mean over rows."""
    v = logits.shape[-1]
    smoothed = (1 - smoothing) * target + smoothing / v
    return -(smoothed * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


def run(fn, logits, target, grad_scale=1.0):
    logits, target = logits.detach().clone().requires_grad_(), target.detach().clone().requires_grad_()
    loss = fn(logits, target)
    (loss * grad_scale).backward()
    return loss, logits.grad, target.grad


def mixup_targets(n, v, gen):
    """What timm Mixup produces: a lam-weighted mix of two one-hot rows."""
    a, b = torch.randint(0, v, (n,), generator=gen), torch.randint(0, v, (n,), generator=gen)
    lam = torch.rand(n, 1, generator=gen)
    return lam * F.one_hot(a, v) + (1 - lam) * F.one_hot(b, v)


# (rows, classes, smoothing, max_block): one row, prime class counts, ImageNet's 1000 classes split over blocks.
CASES = [(1, 7, 0.0, 4096), (5, 11, 0.1, 4096), (4, 37, 0.2, 8), (3, 1000, 0.1, 128), (6, 10, 1.0, 4)]


@pytest.mark.isa
@pytest.mark.parametrize("n,v,smoothing,max_block", CASES)
def test_loss_and_grads_match_torch(path, n, v, smoothing, max_block):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=gen) * 4
    target = mixup_targets(n, v, gen)
    expected = run(lambda x, t: reference(x, t, smoothing), logits.double(), target.double(), 0.7)
    torch_fp32 = run(lambda x, t: reference(x, t, smoothing), logits, target, 0.7)
    with tu.set_max_block(max_block):
        got = run(lambda x, t: soft_cross_entropy(x, t, smoothing), logits, target, 0.7)
    assert path == "fallback" or tu.launch_counts["_ce_bwd_kernel"] > 0
    # Against fp64, as close as PyTorch's own fp32 reference gets (2x), plus two fp32 ulps of the largest value. A
    # fixed tolerance against that fp32 reference failed on an AMD EPYC: there PyTorch's log_softmax is off by 3.8e-7
    # at one dlogits element of the 3x1000 case, where the kernel is off by 6.7e-8.
    assert_within_torch_error(("loss", "dlogits", "dtarget"), got, torch_fp32, expected, torch.float32, atol=None)
    torch.testing.assert_close(got[0], F.cross_entropy(logits, target, label_smoothing=smoothing), atol=1e-7,
                               rtol=1e-6)


def test_class_index_targets(path):
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(5, 13, generator=gen), torch.randint(0, 13, (5,), generator=gen)
    torch.testing.assert_close(soft_cross_entropy(logits, labels, 0.1),
                               F.cross_entropy(logits, labels, label_smoothing=0.1), atol=1e-7, rtol=1e-6)


def test_extreme_logits_stay_finite(path):
    logits = torch.tensor([[1e4, -1e4, 0.0, 3.0], [-80.0, -90.0, -100.0, -85.0]])
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    loss, dx, _ = run(lambda x, t: soft_cross_entropy(x, t, 0.1), logits, target)
    e_loss, e_dx, _ = run(lambda x, t: reference(x, t, 0.1), logits, target)
    assert torch.isfinite(loss) and torch.isfinite(dx).all()
    torch.testing.assert_close(loss, e_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(dx, e_dx, rtol=1e-6, atol=1e-7)


def test_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of both ops (reference path on CPU)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=gen, requires_grad=True)
    t = mixup_targets(4, 9, gen).requires_grad_()
    with set_triton_enabled(False):
        torch.library.opcheck(soft_cross_entropy_fwd, (x, t, 0.1))
        _, lse, mass = soft_cross_entropy_fwd(x.detach(), t.detach(), 0.1)
        for target_grad in (True, False):
            torch.library.opcheck(soft_cross_entropy_bwd, (torch.tensor(1.0), x.detach(), t.detach(), lse, mass, 0.1,
                                                           target_grad))


@pytest.mark.isa
def test_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=gen, requires_grad=True)
    t = mixup_targets(4, 9, gen)
    torch.compile(lambda x: soft_cross_entropy(x, t, 0.1) * 2, backend="aot_eager", fullgraph=True)(x).backward()
    x2 = x.detach().clone().requires_grad_()
    (reference(x2, t, 0.1) * 2).backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("logits,target,match", [
    (torch.randn(2, 3, 4), torch.randn(2, 3, 4), "logits must be"),
    (torch.randn(2, 4), torch.rand(2, 5), "soft targets must match"),
    (torch.randn(2, 4), torch.zeros(3, dtype=torch.long), "class targets"),
])
def test_bad_input_raises(logits, target, match):
    with pytest.raises(ValueError, match=match):
        soft_cross_entropy(logits, target)


@gpu_matrix
@pytest.mark.parametrize("n,v", [(128, 1000), (256, 1000), (64, 21841)])
def test_gpu_real_shapes(n, v, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, v, device="cuda", generator=gen) * 4
    target = torch.softmax(torch.randn(n, v, device="cuda", generator=gen) * 5, dim=-1)
    rd = reference_dtype(dtype)
    ref = run(lambda x, t: reference(x, t, 0.1), logits.to(rd), target.to(rd))
    ours = run(lambda x, t: soft_cross_entropy(x, t, 0.1), logits.to(dtype), target)
    theirs = run(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), logits.to(dtype), target.to(dtype))
    assert_within_torch_error(("loss", "dlogits", "dtarget"), ours, theirs, ref, dtype)
