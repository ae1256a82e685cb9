"""``torch.compile(model, backend="gallery")``: found by name, the GEGLU pass rewrites exactly the GEGLU pattern, and
the compiled model computes the eager function (forward and every gradient)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from gallery_lib.accel.compile.backend import fuse_geglu


def _captured(fn, *inputs) -> list[torch.fx.GraphModule]:
    """The graphs Dynamo captures for ``fn(*inputs)``."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    torch.compile(fn, backend=keep)(*inputs)
    return graphs


def _geglu(h):
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate)


@pytest.mark.parametrize("fn, rewrites", [
    (_geglu, 1),
    (lambda h: F.gelu(h.chunk(2, dim=-1)[1]) * h.chunk(2, dim=-1)[0], 0),  # two chunks: not one split
    (lambda h: (lambda a, g: g * F.gelu(a))(*h.chunk(2, dim=-1)), 0),  # gelu of the first half: another function
    (lambda h: (lambda a, g: a * F.gelu(g, approximate="tanh"))(*h.chunk(2, dim=-1)), 0),  # tanh GELU
    (lambda h: (lambda a, g: a * F.gelu(g) + g)(*h.chunk(2, dim=-1)), 0),  # the gate is used elsewhere too
    (lambda h: (lambda a, g: a * F.gelu(g))(*h.chunk(2, dim=0)), 0),  # split along another dimension
    (lambda h: _geglu(h) + _geglu(h * 2), 2),
])
def test_geglu_pass_rewrites_only_the_geglu_pattern(fn, rewrites):
    h = torch.randn(4, 6, 10)
    (gm,) = _captured(fn, h)
    expected = fn(h)
    assert fuse_geglu(gm) == rewrites
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.gallery.geglu_fwd.default) == rewrites
    if fn is _geglu:
        assert operator.mul not in ops and F.gelu not in ops and torch._C._nn.gelu not in ops
    out = gm(h)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, expected)


def test_backend_by_name_matches_eager_forward_and_gradients():
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(24, activation_fn="geglu", mult=2)
    x = torch.randn(2, 7, 24, requires_grad=True)
    eager = ff(x)
    eager.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in ff.parameters()]
    x.grad = None
    ff.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(ff, backend="gallery")  # found through the torch_dynamo_backends entry point
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for got, want in zip([x.grad] + [p.grad for p in ff.parameters()], grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_every_geglu_of_the_tiny_unet_is_fused():
    from diffusers.models.activations import GEGLU

    from gallery_lib.models.sd_parts import build_unet

    unet = build_unet("sd_tiny")
    args = (torch.randn(1, 4, 16, 16), torch.tensor([10]), torch.randn(1, 77, 32))
    total = sum(fuse_geglu(gm) for gm in _captured(lambda *a: unet(*a, return_dict=False)[0], *args))
    assert total == sum(isinstance(m, GEGLU) for m in unet.modules()) > 0


@pytest.mark.gpu
def test_gpu_backend_on_the_tiny_unet_matches_eager(monkeypatch):
    """On a GPU: the Triton GEGLU kernel in the graph, Inductor, CUDA graphs; forward and weight gradients as eager
    (fp32, TF32 off)."""
    from gallery_lib.accel.compile.backend import gallery_backend
    from gallery_lib.models.sd_parts import build_unet

    # TF32 off for this test only: the flags are process-wide, and Inductor's cache key holds them.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    unet = build_unet("sd_tiny").cuda()
    args = (torch.randn(2, 4, 16, 16, device="cuda"), torch.tensor([10, 500], device="cuda"),
            torch.randn(2, 77, 32, device="cuda"))
    unet(*args, return_dict=False)[0].square().mean().backward()
    want = [p.grad.clone() for p in unet.parameters()]
    unet.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(unet, backend=gallery_backend)
    for _ in range(3):  # CUDA graphs are recorded after warm-up runs; the third call replays
        unet.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        compiled(*args, return_dict=False)[0].square().mean().backward()
    for got, ref in zip([p.grad for p in unet.parameters()], want):
        torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-5)
