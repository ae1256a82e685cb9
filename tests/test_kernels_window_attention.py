"""Window-attention kernel: Triton (interpreter on CPU) against the fp32 PyTorch math, the Swin hook, GPU shapes."""

import pytest
import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels.window_attention import window_attention, window_attention_reference
from kernel_testing import INTERPRETER_ONLY, reference_dtype, run_file_in_interpreter


@pytest.mark.slow  # over 20 s on 2 cores: left out of the fast tier
def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


@pytest.fixture
def interpreter():
    if not tu.interpreter_ready():
        pytest.skip(INTERPRETER_ONLY)


def _inputs(windows, n, heads, d, n_win, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(windows, n, 3, heads, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    bias = (torch.randn(heads, n, n, generator=g) * 0.5).to(device).requires_grad_()
    mask = None
    if n_win:
        mask = torch.where(torch.rand(n_win, n, n, generator=g) < 0.3, -100.0, 0.0).to(device)
    return qkv, bias, mask


def _forward_and_grads(fn, qkv, bias, mask, dout):
    out = fn(qkv, bias, mask, 0.3)
    return (out, *torch.autograd.grad(out, (qkv, bias), dout))


@pytest.mark.parametrize("windows, n, heads, d, n_win", [
    (6, 10, 2, 16, 3),   # a padded window (10 of 16 rows), the shift mask cycling over 3 windows per image
    (5, 16, 3, 32, None),
    (17, 7, 1, 16, 1),   # more windows than one backward program sums (8), one mask for all
])
@pytest.mark.isa
def test_triton_forward_and_grads_match_the_math(interpreter, windows, n, heads, d, n_win):
    qkv, bias, mask = _inputs(windows, n, heads, d, n_win)
    dout = torch.randn(windows, n, heads, d)
    tu.launch_counts.clear()
    ours = _forward_and_grads(window_attention, qkv, bias, mask, dout)
    assert tu.launch_counts["_window_attn_fwd_kernel"] == 1 and tu.launch_counts["_window_attn_bwd_kernel"] == 1
    reference = _forward_and_grads(window_attention_reference, qkv, bias, mask, dout)
    for name, o, r in zip(("out", "dqkv", "dbias"), ours, reference):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5, msg=name)


def test_triton_hooked_swin_matches_timm(interpreter):
    """The Swin hook's ``window`` path (layouts in, layout out, the shift mask) against timm's own attention."""
    timm = pytest.importorskip("timm")
    from gallery_lib.accel.attention import hook_swin_attention

    torch.manual_seed(0)
    model = timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10,
    ).eval()  # head dim 16, 16-token windows: sizes the kernel takes
    x = torch.randn(2, 3, 32, 32)
    reference = model(x)
    reference.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    tu.launch_counts.clear()
    with hook_swin_attention(model, "window"):
        out = model(x)
        out.square().mean().backward()
    assert tu.launch_counts["_window_attn_fwd_kernel"] == 4 and tu.launch_counts["_window_attn_bwd_kernel"] == 4
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_without_triton_it_is_the_math():
    qkv, bias, mask = _inputs(4, 9, 2, 16, 2)
    with tu.set_triton_enabled(False):
        tu.launch_counts.clear()
        out = window_attention(qkv, bias, mask)
        assert not tu.launch_counts
    torch.testing.assert_close(out, window_attention_reference(qkv, bias, mask, 16 ** -0.5), rtol=0, atol=0)


def test_bad_shapes_say_what_is_expected():
    qkv, bias, mask = _inputs(4, 9, 2, 16, 2)
    with pytest.raises(ValueError, match=r"qkv of shape \(windows, N, 3, heads, D\)"):
        window_attention(qkv[:, :, :2], bias)
    with pytest.raises(ValueError, match=r"bias of shape \(2, 9, 9\)"):
        window_attention(qkv, bias[:1])
    with pytest.raises(ValueError, match="mask of shape"):
        window_attention(qkv, bias, torch.zeros(3, 9, 9))


# Swin-T at batch 8: (windows, heads, windows per image), the 49-token windows of every stage
SWIN_T = [(8 * 64, 3, 64), (8 * 16, 6, 16), (8 * 4, 12, 4), (8, 24, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("windows, heads, n_win", SWIN_T)
@pytest.mark.parametrize("shifted", [False, True])
def test_gpu_swin_t_shapes_within_torch_bf16_error(windows, heads, n_win, shifted):
    """bf16 forward and gradients within 2x the error of PyTorch's own bf16 math against fp32 (+1e-3)."""
    qkv, bias, mask = _inputs(windows, 49, heads, 32, n_win if shifted else None, torch.bfloat16, "cuda")
    dout = torch.randn(windows, 49, heads, 32, device="cuda", dtype=torch.bfloat16)
    ours = _forward_and_grads(window_attention, qkv, bias, mask, dout)

    def bf16_math(qkv_, bias_, mask_, scale):
        q, k, v = qkv_.permute(2, 0, 3, 1, 4).unbind(0)
        s = q @ k.transpose(-1, -2) * scale + bias_.to(q.dtype)
        if mask_ is not None:
            s = (s.view(-1, mask_.shape[0], heads, 49, 49) + mask_.to(q.dtype).unsqueeze(1)).flatten(0, 1)
        return (s.softmax(-1) @ v).transpose(1, 2)

    theirs = _forward_and_grads(bf16_math, qkv, bias, mask, dout)
    q32, b32 = qkv.detach().to(reference_dtype(qkv.dtype)).requires_grad_(), bias.detach().clone().requires_grad_()
    reference = _forward_and_grads(window_attention_reference, q32, b32, mask, dout.float())
    for name, o, t, r in zip(("out", "dqkv", "dbias"), ours, theirs, reference):
        err, torch_err = (o.float() - r).abs().max().item(), (t.float() - r).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, (name, err, torch_err)


@pytest.mark.gpu
def test_gpu_compiles_without_graph_break_and_matches_eager():
    qkv, bias, mask = _inputs(128, 49, 3, 32, 64, torch.bfloat16, "cuda")
    eager = window_attention(qkv, bias, mask)
    torch._dynamo.reset()
    compiled = torch.compile(window_attention, fullgraph=True)(qkv, bias, mask)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    compiled.float().sum().backward()
    assert qkv.grad is not None and bias.grad is not None
