"""Swin's window attention in Triton, a program per head and a few windows: ``softmax(q k^T * scale + bias + mask) v``.

A Swin window holds few tokens (49 in Swin-T), so the whole score tile lives in registers. Each program loops over a
few windows of one head, loading the head's bias tile once, and pipelines the loop so that the next window's tiles
load while this one's math runs: a program per window left the loads' latency exposed. The general kernels take
the relative-position bias as a dense ``(windows, heads, N, N)`` tensor: the Swin hook had to expand it over the batch
(plus the shift mask), and the backward wrote a gradient of that size to be summed again. Here the program adds the
``(heads, N, N)`` bias and the ``(windows per image, N, N)`` shift mask itself, reads q, k, v straight from the qkv
Linear's ``(windows, N, 3, heads, D)`` output and writes ``(windows, N, heads, D)``, the layout the projection reads.
The backward recomputes the probabilities from the saved log-sum-exp, writes dq, dk, dv into one qkv-shaped gradient
and sums the bias gradient over ``BWD_WINDOWS_PER_PROGRAM`` windows in registers before writing it
(benchmarks/RESULTS.md#bench-h100: 2.15x SDPA's efficient kernel fed as the hook fed it, Swin-T forward + backward).

``window_attention`` runs the kernels on CUDA (and on CPU under ``TRITON_INTERPRET=1``), and otherwise the same math in
PyTorch, differentiable by autograd.
"""

from typing import Optional

import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import device_function, kernel, library_op, tl, triton, use_triton

# Windows one program loops over (its bias loaded once, the next window's loads overlapping this one's math), and the
# loop's pipeline depth: set by a sweep on an H200 (benchmarks/RESULTS.md#window-attention-sweep).
FWD_WINDOWS_PER_PROGRAM, FWD_STAGES, FWD_WARPS = 4, 2, 4
# The backward also sums the bias gradient over its windows in registers: 1/8 of the partial sums reach memory.
BWD_WINDOWS_PER_PROGRAM, BWD_STAGES, BWD_WARPS = 8, 2, 4
# ``scale`` is a compile-time constant of the kernels: a model has one, and a launch traced by torch.compile would
# otherwise pass the Python float as fp64 and round differently from an eager launch.


@device_function
def _scores(q, k, bias, mask_ptr, window, n_win, scale, offs, valid, N: tl.constexpr, HAS_MASK: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * scale
    s += bias
    if HAS_MASK:
        s += tl.load(mask_ptr + (window % n_win) * N * N + offs[:, None] * N + offs[None, :], mask=valid, other=0.0)
    return tl.where(offs[None, :] < N, s, float("-inf"))


@device_function
def _bias_tile(bias_ptr, h, offs, valid, N: tl.constexpr):
    return tl.load(bias_ptr + h * N * N + offs[:, None] * N + offs[None, :], mask=valid, other=0.0)


@device_function
def _qkv_offsets(window, h, H, offs, offs_d, N: tl.constexpr, D: tl.constexpr):
    return window.to(tl.int64) * N * 3 * H * D + h * D + offs[:, None] * 3 * H * D + offs_d[None, :]


@device_function
def _out_offsets(window, h, H, offs, offs_d, N: tl.constexpr, D: tl.constexpr):
    return window.to(tl.int64) * N * H * D + h * D + offs[:, None] * H * D + offs_d[None, :]


@kernel
def _window_attn_fwd_kernel(QKV, BIAS, MASK, OUT, LSE, n_windows, n_win, H, scale: tl.constexpr, N: tl.constexpr,
                            BN: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr, WPP: tl.constexpr,
                            STAGES: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    offs, offs_d = tl.arange(0, BN), tl.arange(0, D)
    valid = (offs[:, None] < N) & (offs[None, :] < N)
    bias = _bias_tile(BIAS, h, offs, valid, N)
    for j in tl.range(WPP, num_stages=STAGES):
        window = pid * WPP + j
        row = (offs[:, None] < N) & (window < n_windows)  # a window past the end loads zeros and stores nothing
        qkv = _qkv_offsets(window, h, H, offs, offs_d, N, D)
        q = tl.load(QKV + qkv, mask=row, other=0.0)
        k = tl.load(QKV + qkv + H * D, mask=row, other=0.0)
        v = tl.load(QKV + qkv + 2 * H * D, mask=row, other=0.0)
        s = _scores(q, k, bias, MASK, window, n_win, scale, offs, valid, N, HAS_MASK)
        m = tl.max(s, 1)
        p = tl.exp(s - m[:, None])
        denom = tl.sum(p, 1)
        out = tl.dot((p / denom[:, None]).to(v.dtype), v)
        tl.store(OUT + _out_offsets(window, h, H, offs, offs_d, N, D), out.to(OUT.dtype.element_ty), mask=row)
        tl.store(LSE + (window.to(tl.int64) * H + h) * BN + offs, m + tl.log(denom), mask=window < n_windows)


@kernel
def _window_attn_bwd_kernel(DOUT, QKV, BIAS, MASK, OUT, LSE, DQKV, DBIAS, n_windows, n_win, H,
                            scale: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                            HAS_MASK: tl.constexpr, WPP: tl.constexpr, STAGES: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    offs, offs_d = tl.arange(0, BN), tl.arange(0, D)
    valid = (offs[:, None] < N) & (offs[None, :] < N)
    bias = _bias_tile(BIAS, h, offs, valid, N)
    dbias = tl.zeros((BN, BN), dtype=tl.float32)
    for j in tl.range(WPP, num_stages=STAGES):
        window = pid * WPP + j
        row = (offs[:, None] < N) & (window < n_windows)  # a window past the end adds p = 0, so ds = 0
        qkv = _qkv_offsets(window, h, H, offs, offs_d, N, D)
        q = tl.load(QKV + qkv, mask=row, other=0.0)
        k = tl.load(QKV + qkv + H * D, mask=row, other=0.0)
        v = tl.load(QKV + qkv + 2 * H * D, mask=row, other=0.0)
        out_offs = _out_offsets(window, h, H, offs, offs_d, N, D)
        out = tl.load(OUT + out_offs, mask=row, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + out_offs, mask=row, other=0.0)
        lse = tl.load(LSE + (window.to(tl.int64) * H + h) * BN + offs, mask=window < n_windows, other=0.0)
        s = _scores(q, k, bias, MASK, window, n_win, scale, offs, valid, N, HAS_MASK)
        p = tl.where(row, tl.exp(s - lse[:, None]), 0.0)
        dv = tl.dot(tl.trans(p.to(dout.dtype)), dout)
        dp = tl.dot(dout, tl.trans(v))
        ds = p * (dp - tl.sum(out * dout.to(tl.float32), 1)[:, None])
        dbias += ds
        ds_low = ds.to(q.dtype)
        dq = tl.dot(ds_low, k) * scale
        dk = tl.dot(tl.trans(ds_low), q) * scale
        tl.store(DQKV + qkv, dq.to(DQKV.dtype.element_ty), mask=row)
        tl.store(DQKV + qkv + H * D, dk.to(DQKV.dtype.element_ty), mask=row)
        tl.store(DQKV + qkv + 2 * H * D, dv.to(DQKV.dtype.element_ty), mask=row)
    tl.store(DBIAS + (pid.to(tl.int64) * H + h) * N * N + offs[:, None] * N + offs[None, :], dbias, mask=valid)


def _block(n: int) -> int:
    return max(16, tu.next_power_of_2(n))  # tl.dot needs 16 rows at least


def _fwd(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor], scale: float):
    windows, n, _, heads, d = qkv.shape
    out = qkv.new_empty(windows, n, heads, d)
    lse = qkv.new_empty(windows, heads, _block(n), dtype=torch.float32)
    if windows:
        _window_attn_fwd_kernel[(triton.cdiv(windows, FWD_WINDOWS_PER_PROGRAM), heads)](
            qkv, bias, bias if mask is None else mask, out, lse, windows, 1 if mask is None else mask.shape[0], heads,
            scale=scale, N=n, BN=_block(n), D=d, HAS_MASK=mask is not None, WPP=FWD_WINDOWS_PER_PROGRAM,
            STAGES=FWD_STAGES, num_warps=FWD_WARPS)
    return out, lse


def _bwd(dout, qkv, bias, mask, out, lse, scale: float):
    windows, n, _, heads, d = qkv.shape
    programs = triton.cdiv(windows, BWD_WINDOWS_PER_PROGRAM)
    dqkv = torch.empty_like(qkv)
    dbias = torch.zeros(max(programs, 1), heads, n, n, device=qkv.device, dtype=torch.float32)
    if windows:
        _window_attn_bwd_kernel[(programs, heads)](dout.contiguous(), qkv, bias, bias if mask is None else mask,
                                                   out, lse, dqkv, dbias, windows,
                                                   1 if mask is None else mask.shape[0], heads, scale=scale, N=n,
                                                   BN=_block(n), D=d, HAS_MASK=mask is not None,
                                                   WPP=BWD_WINDOWS_PER_PROGRAM, STAGES=BWD_STAGES,
                                                   num_warps=BWD_WARPS)
    return dqkv, dbias.sum(0).to(bias.dtype)


@library_op("gallery::window_attention_fwd")
def window_attention_fwd(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(qkv, bias, mask, scale)


@window_attention_fwd.register_fake
def _(qkv, bias, mask, scale):
    windows, n, _, heads, d = qkv.shape
    return qkv.new_empty(windows, n, heads, d), qkv.new_empty(windows, heads, _block(n), dtype=torch.float32)


@library_op("gallery::window_attention_bwd")
def window_attention_bwd(dout: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
                         out: torch.Tensor, lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd(dout, qkv, bias, mask, out, lse, scale)


@window_attention_bwd.register_fake
def _(dout, qkv, bias, mask, out, lse, scale):
    return torch.empty_like(qkv), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    qkv, bias, mask, scale = inputs
    ctx.save_for_backward(qkv, bias, mask, output[0], output[1])
    ctx.scale = scale


def _backward(ctx, dout, _dlse):
    qkv, bias, mask, out, lse = ctx.saved_tensors
    dqkv, dbias = window_attention_bwd(dout, qkv, bias, mask, out, lse, ctx.scale)
    return dqkv, dbias, None, None


window_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _WindowAttentionFunction(torch.autograd.Function):
    """Eager path: the same launchers without the dispatcher (see `_triton_utils.eager_mode`)."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, scale):
        out, lse = _fwd(qkv, bias, mask, scale)
        ctx.save_for_backward(qkv, bias, mask, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, bias, mask, out, lse = ctx.saved_tensors
        dqkv, dbias = _bwd(dout, qkv, bias, mask, out, lse, ctx.scale)
        return dqkv, dbias, None, None


def window_attention_reference(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
                               scale: float) -> torch.Tensor:
    """The same function in PyTorch (fp32 math): what the kernels must match, and the path without them."""
    windows, n, _, heads, d = qkv.shape
    q, k, v = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)  # (windows, heads, N, D)
    s = q @ k.transpose(-1, -2) * scale + bias.float()
    if mask is not None:
        s = (s.view(windows // mask.shape[0], mask.shape[0], heads, n, n) + mask.float().unsqueeze(1)).flatten(0, 1)
    return (s.softmax(-1) @ v).transpose(1, 2).to(qkv.dtype)


def supports(n: int, head_dim: int) -> bool:
    """Whether the kernels take windows of ``n`` tokens at ``head_dim``: the score tile must fit in registers and
    ``tl.arange`` needs a power-of-two head dim."""
    return n <= 64 and head_dim in (16, 32, 64)


def window_attention(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Window attention of ``qkv`` ``(windows, N, 3, heads, D)`` with an additive ``bias`` ``(heads, N, N)`` and an
    optional shift ``mask`` ``(windows per image, N, N)`` (window ``w`` uses ``mask[w % len(mask)]``); returns
    ``(windows, N, heads, D)``. ``scale`` defaults to ``D ** -0.5``."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"window_attention expects qkv of shape (windows, N, 3, heads, D), got {tuple(qkv.shape)}")
    windows, n, _, heads, d = qkv.shape
    if bias.shape != (heads, n, n):
        raise ValueError(f"window_attention expects a bias of shape {(heads, n, n)}, got {tuple(bias.shape)}")
    if mask is not None and (mask.dim() != 3 or mask.shape[1:] != (n, n) or windows % mask.shape[0]):
        raise ValueError(f"window_attention expects a mask of shape (windows per image, {n}, {n}) dividing the "
                         f"{windows} windows, got {tuple(mask.shape)}")
    scale = d ** -0.5 if scale is None else scale
    if not (use_triton(qkv) and supports(n, d)):
        return window_attention_reference(qkv, bias, mask, scale)
    qkv, bias = qkv.contiguous(), bias.float().contiguous()
    mask = None if mask is None else mask.float().contiguous()
    if tu.eager_mode():
        return _WindowAttentionFunction.apply(qkv, bias, mask, scale)
    return window_attention_fwd(qkv, bias, mask, scale)[0]
