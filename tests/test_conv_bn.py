"""The conv + batch-norm fusion (``kernel_ops=conv_bn_relu``): the op's gradients, timm's bottleneck rebuilt on it,
a tiny ResNet's loss curve, its compiled graph, the config's checks; on a GPU, cuDNN's graphs against the reference.

The reference of each test is plain PyTorch written in the test (or timm's own block), never the op's own code."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from gallery_lib.accel.kernels.conv_bn import scale_bias_relu_conv
from gallery_lib.accel.kernels.patch import apply_kernels
from gallery_lib.config import ConfigError, RunConfig, validate_for_machine

timm_resnet = pytest.importorskip("timm.models.resnet")
CL = torch.channels_last


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12)).item()


def _plain(x, scale, bias, weight, stride, padding):
    y = F.conv2d(torch.relu(x * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)), weight, stride=stride,
                 padding=padding)
    return y, y.sum((0, 2, 3)), (y * y).sum((0, 2, 3))


def _op_case(n, cin, cout, k, stride, h, w, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cin, h, w, generator=g).to(device, dtype).contiguous(memory_format=CL)
    weight = (torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5).to(device, dtype)
    scale = (1 + 0.2 * torch.randn(cin, generator=g)).to(device)
    bias = (0.2 * torch.randn(cin, generator=g)).to(device)
    return [t.requires_grad_() for t in (x, scale, bias, weight.contiguous(memory_format=CL))]


@pytest.mark.parametrize("n,cin,cout,k,stride,h,w", [(3, 5, 7, 3, 1, 9, 11), (2, 6, 13, 3, 2, 10, 7),
                                                     (5, 7, 3, 1, 1, 6, 5)])
def test_op_forward_and_every_gradient_match_plain_pytorch(n, cin, cout, k, stride, h, w):
    inputs = _op_case(n, cin, cout, k, stride, h, w)
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    got = scale_bias_relu_conv(*inputs, stride, k // 2)
    expected = _plain(*twins, stride, k // 2)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=g) for t in expected]  # a loss that reads y and both sums
    sum(((t * wt).sum() for t, wt in zip(got, weights))).backward()
    sum(((t * wt).sum() for t, wt in zip(expected, weights))).backward()
    assert got[0].is_contiguous(memory_format=CL)
    for name, a, b in zip(("y", "sum", "sum of squares"), got, expected):
        assert _relative(a, b) < 1e-5, name
    for name, a, b in zip(("x", "scale", "bias", "weight"), inputs, twins):
        assert _relative(a.grad, b.grad) < 1e-4, f"d{name}"


def _bottleneck_pair(inplanes, planes, stride, seed=0):
    torch.manual_seed(seed)
    downsample = None
    if stride != 1 or inplanes != planes * 4:
        downsample = torch.nn.Sequential(torch.nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                         torch.nn.BatchNorm2d(planes * 4))
    block = timm_resnet.Bottleneck(inplanes, planes, stride=stride, downsample=downsample)
    for norm in (m for m in block.modules() if isinstance(m, torch.nn.BatchNorm2d)):  # not the identity at init
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(norm.bias, -0.3, 0.3)
    block = block.to(memory_format=CL)
    fused = copy.deepcopy(block)
    report = apply_kernels(fused, conv_bn_relu=True)
    assert report.counts == {"conv_bn_relu": 1}
    return block, fused, report


@pytest.mark.parametrize("inplanes,planes,stride", [(12, 5, 1), (20, 5, 1), (12, 6, 2)])
def test_bottleneck_matches_timm_in_training_and_eval(inplanes, planes, stride):
    block, fused, _ = _bottleneck_pair(inplanes, planes, stride)
    x = torch.randn(3, inplanes, 9, 9).contiguous(memory_format=CL).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    for step in range(2):  # the second step reads the running averages the first updated
        expected, got = block(x), fused(x2)
        assert _relative(got, expected) < 1e-5, f"step {step}"
        dy = torch.randn_like(expected)
        (expected * dy).sum().backward()
        (got * dy).sum().backward()
    assert _relative(x2.grad, x.grad) < 1e-4
    for (name, p), p2 in zip(block.named_parameters(), fused.parameters()):
        assert _relative(p2.grad, p.grad) < 1e-4, name
    for (name, b), b2 in zip(block.named_buffers(), fused.buffers()):
        assert torch.allclose(b2.float(), b.float(), rtol=1e-5, atol=1e-6), name
    block.eval(), fused.eval()
    with torch.no_grad():
        assert _relative(fused(x), block(x)) < 1e-5


def test_patch_leaves_unsupported_blocks_alone_and_undoes():
    block, fused, report = _bottleneck_pair(12, 5, 1)
    report.undo()
    assert "forward" not in vars(fused)
    with_se = timm_resnet.Bottleneck(16, 4, attn_layer=torch.nn.Identity)
    skipped = apply_kernels(with_se, conv_bn_relu=True)
    assert not skipped.swapped and "squeeze-excitation" in skipped.skipped[0][1]
    assert apply_kernels(copy.deepcopy(block)).skipped[0][1] == "conv_bn_relu=False"  # off unless named


def _micro_resnet(seed=0):
    from gallery_lib.families.resnet import build_resnet_micro

    torch.manual_seed(seed)
    return build_resnet_micro(num_classes=10).to(memory_format=CL)


def test_micro_resnet_loss_curve_matches_step_by_step():
    plain = _micro_resnet()
    fused = copy.deepcopy(plain)
    assert apply_kernels(fused, conv_bn_relu=True).counts == {"conv_bn_relu": 4}
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, 32, 32, generator=g).contiguous(memory_format=CL),
                torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
    curves = []
    for model in (plain, fused):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        losses = []
        for _ in range(3):  # epochs over the same batches: the loss must fall
            for images, labels in batches:
                loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]
    for step, (a, b) in enumerate(zip(*curves)):
        assert abs(a - b) <= 1e-3 * abs(a), f"step {step}: plain {a}, fused {b}"


@pytest.mark.slow
def test_compiled_fused_block_has_no_graph_break_and_matches_eager():
    block, fused, _ = _bottleneck_pair(12, 6, 2)
    images = torch.randn(4, 12, 9, 9).contiguous(memory_format=CL)
    got, expected = torch.compile(fused, fullgraph=True)(images), block(images)
    got.square().sum().backward()
    expected.square().sum().backward()
    assert _relative(got, expected) < 1e-5
    for (name, p), p2 in zip(block.named_parameters(), fused.parameters()):
        assert _relative(p2.grad, p.grad) < 1e-4, name


def _resnet_config(**overrides) -> RunConfig:
    return RunConfig(**{"model": "resnet_micro", "batch_size": 8, "steps": 4, "warmup_steps": 1, "kernels": True,
                        "kernel_ops": "conv_bn_relu", **overrides})


def test_kernel_ops_all_leaves_the_cudnn_fusion_out():
    assert "conv_bn_relu" not in _resnet_config(kernel_ops="all").kernel_op_names
    assert _resnet_config().kernel_op_names == ("conv_bn_relu",)


def test_cudnn_fusion_on_a_gpu_needs_float16_and_the_frontend(monkeypatch):
    with pytest.raises(ConfigError, match="amp_dtype='float16'"):
        validate_for_machine(_resnet_config(amp_dtype="bfloat16", device="cuda"), cuda_devices=1)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cudnn" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps nvidia-cudnn-frontend"):
        validate_for_machine(_resnet_config(amp_dtype="float16", device="cuda"), cuda_devices=1)
    assert validate_for_machine(_resnet_config(amp_dtype="bfloat16", device="cpu"), cuda_devices=0) == "cpu"


# --- GPU: cuDNN's graphs (float16, channels_last) against the reference --------------------------------------------

# ResNet-50's conv2 and conv3 shapes at a small batch, the strided conv2, and an odd one.
GPU_SHAPES = [(8, 64, 64, 3, 1, 56, 56), (8, 64, 256, 1, 1, 56, 56), (8, 128, 128, 3, 2, 56, 56),
              (8, 512, 2048, 1, 1, 7, 7), (6, 40, 72, 3, 1, 17, 17)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,cin,cout,k,stride,h,w", GPU_SHAPES)
def test_cudnn_graph_matches_the_reference_in_float16(n, cin, cout, k, stride, h, w):
    from gallery_lib.accel.kernels.conv_bn import cudnn_runner, has_cudnn_frontend

    assert has_cudnn_frontend(), "pip install nvidia-cudnn-frontend to test the cuDNN path"
    inputs = _op_case(n, cin, cout, k, stride, h, w, device="cuda", dtype=torch.float16)
    exact = [t.detach().double().requires_grad_() for t in inputs]  # fp64 on the GPU: the truth
    got = scale_bias_relu_conv(*inputs, stride, k // 2)
    assert not cudnn_runner().declined, cudnn_runner().declined
    # PyTorch's own fp16 ops, given the scale and bias in the dtype cuDNN reads them in (fp32, or fp16 where its
    # engines take only that)
    (_, affine_dtype), = [built for key, built in cudnn_runner().graphs.items()
                          if key[3] == (n, cin, h, w) and key[5][:2] == (cout, cin) and key[1] == stride]
    half_ref = [t.detach().clone() for t in inputs]
    half_ref[1:3] = [t.to(affine_dtype).float() for t in half_ref[1:3]]
    half_ref = [t.requires_grad_() for t in half_ref]
    truth = _plain(*exact, stride, k // 2)
    with torch.autocast("cuda", dtype=torch.float16):
        ours_ref = _plain(*half_ref, stride, k // 2)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=g).cuda() for t in truth]
    for outs in (got, truth, ours_ref):
        sum(((t.double() * wt).sum() for t, wt in zip(outs, weights))).backward()
    for name, a, t, r in zip(("y", "sum", "sum of squares"), got, truth, ours_ref):
        assert _relative(a, t) <= 2 * _relative(r, t) + 1e-6, name
    for name, a, t, r in zip(("x", "scale", "bias", "weight"), inputs, exact, half_ref):
        assert _relative(a.grad, t.grad) <= 2 * _relative(r.grad, t.grad) + 1e-6, f"d{name}"


@pytest.mark.gpu
def test_compiled_resnet50_step_with_cuda_graphs_matches_eager_float16():
    from gallery_lib.families.resnet import build_resnet50

    torch.manual_seed(0)
    plain = build_resnet50(num_classes=100).cuda().to(memory_format=CL)
    fused = copy.deepcopy(plain)
    assert apply_kernels(fused, conv_bn_relu=True).counts == {"conv_bn_relu": 16}
    step = torch.compile(fused, mode="reduce-overhead")
    images = torch.randn(32, 3, 224, 224, device="cuda").contiguous(memory_format=CL)
    labels = torch.randint(0, 100, (32,), device="cuda")
    losses = {}
    for name, model in (("plain", plain), ("fused", step)):
        for _ in range(3):  # CUDA graphs record on the third call
            torch.compiler.cudagraph_mark_step_begin()
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
        losses[name] = loss.item()
    assert abs(losses["fused"] - losses["plain"]) < 2e-2 * abs(losses["plain"]), losses
    for (name, p), p2 in zip(plain.named_parameters(), fused.parameters()):
        assert _relative(p2.grad, p.grad) < 5e-2, name
