"""Fused training-mode BatchNorm (+ residual add, + ReLU) over channels_last input, statistics in fp32.

Why by hand: in a compiled ResNet-50 step Inductor's batch-norm fusions take half of the GPU time
(benchmarks/RESULTS.md#resnet50), and a bottleneck's ``relu(bn3(x) + shortcut)`` is one op here.

Design (and why):

* channels_last input of shape (N, C, H, W) is a row-major (M = N*H*W, C) matrix (2-D (N, C) input already is
  one): a channel is a column. A program owns ``BLOCK_C`` channels and a range of rows (a *split*), so every tile
  row is ``BLOCK_C`` contiguous values: 128 bytes of a bf16 pixel at 64 channels.
* Forward, three launches: (1) each split's per-channel mean and M2 (sum of squared deviations), from sums of
  ``x - shift`` and its square, ``shift`` being the mean of the split's first tile (stable for means far from
  zero, one FMA per element); (2) per channel, the splits merged (Chan's formula) into mean, rstd and the biased
  variance; (3) ``y = relu(x * scale + shift + residual)``.
* Backward, three launches: (1) each split's per-channel sums of ``g`` and ``g * xhat``, ``g`` being ``dy``
  through the ReLU; without a residual the ReLU's mask is recomputed from ``x`` (the output is never read back),
  with one it is read from the saved output; (2) per channel, those sums over the splits: dweight and dbias;
  (3) ``dx = w * rstd * (g - dbias / M - xhat * dweight / M)``, and ``g`` as the residual's gradient.
* Reads per call: forward ``x`` twice (and the residual once), backward ``x`` and ``dy`` twice (and the output
  twice with a residual). Deterministic: fixed-order sums, no atomics. Plans are cached per shape.
* Other layouts (NCHW) take the PyTorch reference, which has the same math: ResNets here train channels_last.
"""

import functools
from typing import Optional, Tuple

import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import device_function, kernel, library_op, tl, triton, use_triton

# Channels per program: 128 bytes of a bf16 pixel row, a whole cache line.
_BLOCK_CHANNELS = 64
# Programs per SM that the splits aim for.
_PROGRAMS_PER_SM = 4


@device_function
def _program(M, C, ROWS_PER, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's split index, first and end row, channels and their mask."""
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    lo = s * ROWS_PER
    return s, lo, tl.minimum(M, lo + ROWS_PER), c, c < C


@device_function
def _tile(r0, hi, c, c_ok, C, BLOCK_M: tl.constexpr):
    """Offsets and mask of the ``[BLOCK_M, BLOCK_C]`` tile of rows ``r0..`` (int64: M * C may pass 2**31)."""
    r = r0 + tl.arange(0, BLOCK_M)
    return r.to(tl.int64)[:, None] * C + c[None, :], (r < hi)[:, None] & c_ok[None, :]


@device_function
def _scale_shift(Stats, W, B, c, c_ok, C, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Per-channel mean, rstd, ``scale = w * rstd`` and ``shift = b - mean * scale`` (fp32)."""
    mean = tl.load(Stats + c, mask=c_ok, other=0.0)
    rstd = tl.load(Stats + C + c, mask=c_ok, other=0.0)
    scale = rstd
    if HAS_W:
        scale = scale * tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)
    shift = -mean * scale
    if HAS_B:
        shift = shift + tl.load(B + c, mask=c_ok, other=0.0).to(tl.float32)
    return mean, rstd, scale, shift


@device_function
def _g_xhat(DY, X, Y, offs, mask, mean, rstd, scale, shift, RELU: tl.constexpr, MASK_FROM_Y: tl.constexpr):
    """``g`` (``dy`` through the ReLU) and ``xhat`` of one tile, zero outside the mask."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        if MASK_FROM_Y:
            g = tl.where(tl.load(Y + offs, mask=mask, other=0.0) > 0, g, 0.0)
        else:  # the forward's own expression, so the mask is the forward's
            g = tl.where(x * scale[None, :] + shift[None, :] > 0, g, 0.0)
    return g, tl.where(mask, (x - mean[None, :]) * rstd[None, :], 0.0)


@kernel
def _bn_stats_kernel(X, Part, M, C, ROWS_PER, P, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    # Part is (2, SPLIT, C): plane 0 each split's per-channel means, plane 1 (offset P) their M2s.
    s, lo, hi, c, c_ok = _program(M, C, ROWS_PER, BLOCK_M, BLOCK_C)
    offs, mask = _tile(lo, hi, c, c_ok, C, BLOCK_M)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    shift = tl.sum(x, axis=0) / tl.maximum(tl.minimum(hi - lo, BLOCK_M), 1).to(tl.float32)
    # Per-lane sums (one cross-lane reduction at the end); the first tile is already loaded.
    d = tl.where(mask, x - shift[None, :], 0.0)
    s1 = d
    s2 = d * d
    for r0 in range(lo + BLOCK_M, hi, BLOCK_M):
        offs, mask = _tile(r0, hi, c, c_ok, C, BLOCK_M)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
    cnt = tl.maximum(hi - lo, 1).to(tl.float32)
    sum1 = tl.sum(s1, axis=0)
    tl.store(Part + s * C + c, shift + sum1 / cnt, mask=c_ok)
    tl.store(Part + P + s * C + c, tl.maximum(tl.sum(s2, axis=0) - sum1 * sum1 / cnt, 0.0), mask=c_ok)


@kernel
def _bn_merge_kernel(Part, Stats, M, C, SPLIT, ROWS_PER, P, eps, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # Stats is (3, C): mean, rstd, biased variance. Chan's formula with each split's row count as its weight.
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, SPLIT, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = (s < SPLIT)[:, None] & c_ok[None, :]
        cnt = (tl.minimum(M, (s + 1) * ROWS_PER) - s * ROWS_PER).to(tl.float32)[:, None]
        acc += tl.where(ok, tl.load(Part + s[:, None] * C + c[None, :], mask=ok, other=0.0) * cnt, 0.0)
    mean = tl.sum(acc, axis=0) / M
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, SPLIT, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = (s < SPLIT)[:, None] & c_ok[None, :]
        cnt = (tl.minimum(M, (s + 1) * ROWS_PER) - s * ROWS_PER).to(tl.float32)[:, None]
        offs = s[:, None] * C + c[None, :]
        dm = tl.load(Part + offs, mask=ok, other=0.0) - mean[None, :]
        acc += tl.where(ok, tl.load(Part + P + offs, mask=ok, other=0.0) + cnt * dm * dm, 0.0)
    var = tl.sum(acc, axis=0) / M
    tl.store(Stats + c, mean, mask=c_ok)
    tl.store(Stats + C + c, 1.0 / tl.sqrt(var + eps), mask=c_ok)
    tl.store(Stats + 2 * C + c, var, mask=c_ok)


@kernel
def _bn_apply_kernel(X, R, Y, Stats, W, B, M, C, ROWS_PER, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     HAS_RES: tl.constexpr, RELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    _s, lo, hi, c, c_ok = _program(M, C, ROWS_PER, BLOCK_M, BLOCK_C)
    _mean, _rstd, scale, shift = _scale_shift(Stats, W, B, c, c_ok, C, HAS_W, HAS_B)
    for r0 in range(lo, hi, BLOCK_M):
        offs, mask = _tile(r0, hi, c, c_ok, C, BLOCK_M)
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) * scale[None, :] + shift[None, :]
        if HAS_RES:
            z += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        if RELU:
            z = tl.maximum(z, 0.0)
        tl.store(Y + offs, z.to(Y.dtype.element_ty), mask=mask)


@kernel
def _bn_bwd_reduce_kernel(DY, X, Y, Stats, W, B, Part, M, C, ROWS_PER, P, HAS_W: tl.constexpr,
                          HAS_B: tl.constexpr, RELU: tl.constexpr, MASK_FROM_Y: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    # Part is (2, SPLIT, C): plane 0 each split's per-channel sums of g * xhat, plane 1 (offset P) those of g.
    s, lo, hi, c, c_ok = _program(M, C, ROWS_PER, BLOCK_M, BLOCK_C)
    mean, rstd, scale, shift = _scale_shift(Stats, W, B, c, c_ok, C, HAS_W, HAS_B)
    acc_gx = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_M):
        offs, mask = _tile(r0, hi, c, c_ok, C, BLOCK_M)
        g, xhat = _g_xhat(DY, X, Y, offs, mask, mean, rstd, scale, shift, RELU, MASK_FROM_Y)
        acc_gx += g * xhat
        acc_g += g
    tl.store(Part + s * C + c, tl.sum(acc_gx, axis=0), mask=c_ok)
    tl.store(Part + P + s * C + c, tl.sum(acc_g, axis=0), mask=c_ok)


@kernel
def _bn_bwd_sum_kernel(Part, DWB, C, SPLIT, P, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # DWB is (2, C): dweight (the sums of g * xhat), dbias (the sums of g), over the splits in a fixed order.
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc_w = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, SPLIT, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = (s < SPLIT)[:, None] & c_ok[None, :]
        offs = s[:, None] * C + c[None, :]
        acc_w += tl.load(Part + offs, mask=ok, other=0.0)
        acc_b += tl.load(Part + P + offs, mask=ok, other=0.0)
    tl.store(DWB + c, tl.sum(acc_w, axis=0), mask=c_ok)
    tl.store(DWB + C + c, tl.sum(acc_b, axis=0), mask=c_ok)


@kernel
def _bn_bwd_apply_kernel(DY, X, Y, Stats, W, B, DWB, DX, DR, M, C, ROWS_PER, HAS_W: tl.constexpr,
                         HAS_B: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr, MASK_FROM_Y: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    _s, lo, hi, c, c_ok = _program(M, C, ROWS_PER, BLOCK_M, BLOCK_C)
    mean, rstd, scale, shift = _scale_shift(Stats, W, B, c, c_ok, C, HAS_W, HAS_B)
    g_mean = (tl.load(DWB + C + c, mask=c_ok, other=0.0) / M)[None, :]
    gx_mean = (tl.load(DWB + c, mask=c_ok, other=0.0) / M)[None, :]
    for r0 in range(lo, hi, BLOCK_M):
        offs, mask = _tile(r0, hi, c, c_ok, C, BLOCK_M)
        g, xhat = _g_xhat(DY, X, Y, offs, mask, mean, rstd, scale, shift, RELU, MASK_FROM_Y)
        dx = scale[None, :] * (g - g_mean - xhat * gx_mean)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_RES:
            tl.store(DR + offs, g.to(DR.dtype.element_ty), mask=mask)


def rows_layout(x: torch.Tensor) -> bool:
    """True when ``x`` is a row-major (M, C) matrix in memory: contiguous 2-D, or 4-D in channels_last."""
    if x.dim() == 2:
        return x.is_contiguous()
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)


def _like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` in the memory layout of ``x`` (a residual or gradient arriving in another layout)."""
    fmt = torch.channels_last if x.dim() == 4 else torch.contiguous_format
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)


class _Plan:
    """Channel blocks, row tiles and splits of one call: about ``target`` programs over the GPU."""

    def __init__(self, m: int, c: int, target: int, cap: int) -> None:
        block_c = min(tu.next_power_of_2(c), _BLOCK_CHANNELS, cap)
        block_m = max(1, min(tu.next_power_of_2(m), cap // block_c))
        channel_blocks, row_blocks = triton.cdiv(c, block_c), triton.cdiv(m, block_m)
        split = max(1, min(row_blocks, triton.cdiv(target, channel_blocks)))
        self.rows_per = triton.cdiv(row_blocks, split) * block_m
        self.split = triton.cdiv(m, self.rows_per)
        self.grid = (self.split, channel_blocks)
        self.merge_grid = (channel_blocks,)
        self.block_s = max(1, min(tu.next_power_of_2(self.split), cap // block_c))
        self.meta = dict(BLOCK_M=block_m, BLOCK_C=block_c, num_warps=tu.num_warps_for(block_m * block_c))


_cached_plan = functools.lru_cache(maxsize=256)(_Plan)


def _plan(x: torch.Tensor) -> _Plan:
    c = x.shape[1]
    return _cached_plan(x.numel() // c, c, tu.num_programs_target(x, per_sm=_PROGRAMS_PER_SM), tu.MAX_BLOCK)


def _ptr(t: Optional[torch.Tensor], dummy: torch.Tensor) -> torch.Tensor:
    """An absent tensor: pass any tensor (never read: its flag is False) instead of None."""
    return t if t is not None else dummy


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


def _reference_scale_shift(stats, weight, bias, x):
    mean, rstd = stats[0], stats[1]
    scale = rstd * weight.float() if weight is not None else rstd
    shift = -mean * scale + (bias.float() if bias is not None else 0.0)
    return _per_channel(mean, x), _per_channel(rstd, x), _per_channel(scale, x), _per_channel(shift, x)


def _fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
         bias: Optional[torch.Tensor], eps: float, relu: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output and the fp32 statistics, stacked (mean, rstd, biased variance) of shape (3, C)."""
    c = x.shape[1]
    if residual is not None:
        residual = _like(residual, x)
    if use_triton(x) and rows_layout(x):
        plan = _plan(x)
        m = x.numel() // c
        y = torch.empty_like(x)
        stats = torch.empty((3, c), device=x.device, dtype=torch.float32)
        part = torch.empty((2, plan.split, c), device=x.device, dtype=torch.float32)
        _bn_stats_kernel[plan.grid](x, part, m, c, plan.rows_per, part[0].numel(), **plan.meta)
        _bn_merge_kernel[plan.merge_grid](part, stats, m, c, plan.split, plan.rows_per, part[0].numel(), eps,
                                          BLOCK_S=plan.block_s, BLOCK_C=plan.meta["BLOCK_C"])
        _bn_apply_kernel[plan.grid](x, _ptr(residual, x), y, stats, _ptr(weight, x), _ptr(bias, x), m, c,
                                    plan.rows_per, HAS_W=weight is not None, HAS_B=bias is not None,
                                    HAS_RES=residual is not None, RELU=relu, **plan.meta)
        return y, stats
    dims = [0] + list(range(2, x.dim()))
    var, mean = torch.var_mean(x.float(), dim=dims, unbiased=False)
    stats = torch.stack([mean, torch.rsqrt(var + eps), var])
    _, _, scale, shift = _reference_scale_shift(stats, weight, bias, x)
    z = x.float() * scale + shift
    if residual is not None:
        z = z + residual.float()
    if relu:
        z = z.clamp_min(0.0)
    return _like(z.to(x.dtype), x) if x.dim() in (2, 4) else z.to(x.dtype), stats


def _bwd(dy: torch.Tensor, x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor],
         bias: Optional[torch.Tensor], stats: torch.Tensor, has_residual: bool,
         relu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, the residual's gradient (empty without a residual) and the stacked fp32 (dweight, dbias) of shape (2, C).

    ``y`` (the forward's output) is read only with a residual and ReLU, for the ReLU's mask."""
    c = x.shape[1]
    mask_from_y = has_residual and relu
    if use_triton(x) and rows_layout(x):
        dy = _like(dy, x)
        plan = _plan(x)
        m = x.numel() // c
        dx = torch.empty_like(x)
        dres = torch.empty_like(x) if has_residual else x.new_empty(0)
        part = torch.empty((2, plan.split, c), device=x.device, dtype=torch.float32)
        dwb = torch.empty((2, c), device=x.device, dtype=torch.float32)
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, RELU=relu, MASK_FROM_Y=mask_from_y)
        w, b = _ptr(weight, x), _ptr(bias, x)
        _bn_bwd_reduce_kernel[plan.grid](dy, x, y, stats, w, b, part, m, c, plan.rows_per, part[0].numel(),
                                         **flags, **plan.meta)
        _bn_bwd_sum_kernel[plan.merge_grid](part, dwb, c, plan.split, part[0].numel(), BLOCK_S=plan.block_s,
                                            BLOCK_C=plan.meta["BLOCK_C"])
        _bn_bwd_apply_kernel[plan.grid](dy, x, y, stats, w, b, dwb, dx, _ptr(dres if has_residual else None, x), m,
                                        c, plan.rows_per, HAS_RES=has_residual, **flags, **plan.meta)
        return dx, dres, dwb
    mean, rstd, scale, shift = _reference_scale_shift(stats, weight, bias, x)
    xf = x.float()
    g = dy.float()
    if relu:
        g = torch.where((y > 0) if mask_from_y else (xf * scale + shift > 0), g, 0.0)
    xhat = (xf - mean) * rstd
    dims = [0] + list(range(2, x.dim()))
    dwb = torch.stack([(g * xhat).sum(dims), g.sum(dims)])
    m = x.numel() // c
    dx = scale * (g - _per_channel(dwb[1], x) / m - xhat * _per_channel(dwb[0], x) / m)
    dres = g.to(x.dtype) if has_residual else x.new_empty(0)
    return dx.to(x.dtype), dres, dwb


def _param_grads(dwb: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 needs_input_grad: Tuple[bool, ...]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    dw = dwb[0].to(weight.dtype) if weight is not None and needs_input_grad[2] else None
    db = dwb[1].to(bias.dtype) if bias is not None and needs_input_grad[3] else None
    return dw, db


# torch.library ops: what torch.compile traces (and opcheck checks).
@library_op("gallery::batch_norm_act_fwd")
def batch_norm_act_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], eps: float, relu: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _fwd(x, residual, weight, bias, eps, relu)


@batch_norm_act_fwd.register_fake
def _(x, residual, weight, bias, eps, relu):
    return torch.empty_like(x, memory_format=torch.preserve_format), x.new_empty((3, x.shape[1]),
                                                                                  dtype=torch.float32)


@library_op("gallery::batch_norm_act_bwd")
def batch_norm_act_bwd(dy: torch.Tensor, x: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], stats: torch.Tensor, has_residual: bool,
                       relu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, y, weight, bias, stats, has_residual, relu)


@batch_norm_act_bwd.register_fake
def _(dy, x, y, weight, bias, stats, has_residual, relu):
    dres = torch.empty_like(x, memory_format=torch.preserve_format) if has_residual else x.new_empty(0)
    return (torch.empty_like(x, memory_format=torch.preserve_format), dres,
            x.new_empty((2, x.shape[1]), dtype=torch.float32))


def _saved_output(y: torch.Tensor, x: torch.Tensor, has_residual: bool, relu: bool) -> torch.Tensor:
    """What the backward reads as the output: the output itself only where it needs the ReLU's mask from it."""
    return y if has_residual and relu else x


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, _eps, relu = inputs
    y, stats = output
    ctx.has_residual, ctx.relu = residual is not None, relu
    ctx.save_for_backward(x, _saved_output(y, x, ctx.has_residual, relu), weight, bias, stats)


def _backward(ctx, dy, _dstats):
    x, y, weight, bias, stats = ctx.saved_tensors
    dx, dres, dwb = batch_norm_act_bwd(dy, x, y, weight, bias, stats, ctx.has_residual, ctx.relu)
    return (dx, dres if ctx.has_residual else None, *_param_grads(dwb, weight, bias, ctx.needs_input_grad),
            None, None)


batch_norm_act_fwd.register_autograd(_backward, setup_context=_setup_context)


class _BatchNormActFunction(torch.autograd.Function):
    """Eager path: the same launchers without the dispatcher (see `_triton_utils.eager_mode`)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, relu):
        y, stats = _fwd(x, residual, weight, bias, eps, relu)
        ctx.has_residual, ctx.relu = residual is not None, relu
        ctx.save_for_backward(x, _saved_output(y, x, ctx.has_residual, relu), weight, bias, stats)
        ctx.mark_non_differentiable(stats)
        return y, stats

    @staticmethod
    def backward(ctx, dy, _dstats):
        x, y, weight, bias, stats = ctx.saved_tensors
        dx, dres, dwb = _bwd(dy, x, y, weight, bias, stats, ctx.has_residual, ctx.relu)
        return (dx, dres if ctx.has_residual else None, *_param_grads(dwb, weight, bias, ctx.needs_input_grad),
                None, None)


def batch_norm_act(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   eps: float = 1e-5, residual: torch.Tensor | None = None,
                   relu: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Training-mode BatchNorm of ``x`` (N, C, *spatial) over its batch statistics, then ``+ residual``, then ReLU.

    Matches ``relu(F.batch_norm(x, None, None, weight, bias, training=True, eps=eps) + residual)``. Returns the
    output (dtype and memory format of ``x``) and the fp32 statistics stacked as (mean, rstd, biased variance), of
    shape (3, C), from which the caller updates running statistics; they carry no gradient.
    """
    if x.dim() < 2:
        raise ValueError(f"batch_norm_act expects (N, C, *spatial) input, got shape {tuple(x.shape)}")
    c = x.shape[1]
    if x.numel() // c < 2:
        raise ValueError(f"batch_norm_act needs more than one value per channel in training, got input shape "
                         f"{tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (c,):
            raise ValueError(f"{name} must have shape ({c},) to match the channels of x, got {tuple(t.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if tu.eager_mode():
        return _BatchNormActFunction.apply(x, residual, weight, bias, float(eps), relu)
    return batch_norm_act_fwd(x, residual, weight, bias, float(eps), relu)
