"""Fused LayerNorm over the last dimension: each Triton program normalizes a block of rows, statistics in fp32.

Design (and why):

* Forward: rows that fit in one block (every Swin and SD width, 96..1280) stay in registers: one read of ``x``,
  one write of ``y`` plus 8 bytes of statistics per row, one launch. A program takes ``BLOCK_M`` rows so that
  narrow rows (Swin's 96) still give each program a few KiB to load. Wider rows loop over column blocks (Welford
  statistics, then a second pass).
* Backward: one launch of two programs per SM; each strides over row blocks, writes ``dx`` for its rows
  and keeps its weight/bias gradient partials in registers (the weight is loaded once, outside the loop), then
  stores one fp32 row of partials. A single ``sum`` over the programs' rows finishes dweight and dbias together
  (two stages, deterministic, no atomics). Per call: reads ``x`` and ``dy`` once, writes ``dx``, two launches
  in all (the old version also zero-filled the partials and summed dweight and dbias separately: five).
* Eager calls skip the ``torch.library`` dispatcher (see `_triton_utils.eager_mode`), and backward no longer
  receives (and zero-fills) gradients for the saved statistics.
"""

from typing import Optional, Tuple

import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import kernel, library_op, tl, triton, use_triton


@kernel
def _ln_fwd_kernel(X, Y, W, B, Mean, Rstd, R, D, eps,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, SINGLE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < R
    row_base = rows.to(tl.int64)[:, None] * D
    cols = tl.arange(0, BLOCK_D)
    if SINGLE:  # the whole row block lives in registers: one read, one write
        c_mask = cols < D
        mask = r_mask[:, None] & c_mask[None, :]
        x = tl.load(X + row_base + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + row_base + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc_n = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc_mean = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc_m2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            mask = r_mask[:, None] & (d0 + cols < D)[None, :]
            x = tl.load(X + row_base + d0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc_n += mask.to(tl.float32)
            delta = x - acc_mean
            acc_mean += tl.where(mask, delta / tl.maximum(acc_n, 1.0), 0.0)
            acc_m2 += tl.where(mask, delta * (x - acc_mean), 0.0)
        count = tl.maximum(tl.sum(acc_n, axis=1), 1.0)
        mean = tl.sum(acc_mean * acc_n, axis=1) / count
        diff = acc_mean - mean[:, None]
        rstd = 1.0 / tl.sqrt((tl.sum(acc_m2, axis=1) + tl.sum(acc_n * diff * diff, axis=1)) / count + eps)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            mask = r_mask[:, None] & (c < D)[None, :]
            x = tl.load(X + row_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
            if HAS_B:
                y = y + tl.load(B + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + row_base + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=r_mask)
    tl.store(Rstd + rows, rstd, mask=r_mask)


@kernel
def _ln_bwd_kernel(DY, X, W, Mean, Rstd, DX, Part, R, D, n_blocks, P,
                   HAS_W: tl.constexpr, SINGLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # Part is (2, programs, D): plane 0 the dweight partials, plane 1 (offset P) the dbias partials.
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    part = pid.to(tl.int64) * D
    DWp = Part
    DBp = Part + P
    # Per-element accumulators, reduced over rows once at the end: a column sum per row block would cost a
    # cross-warp reduction (shared memory and a barrier) in every iteration of the loop.
    acc_dw = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SINGLE:
        if HAS_W:
            w_row = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    for rb in range(pid, n_blocks, n_progs):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < R
        row_base = rows.to(tl.int64)[:, None] * D
        mean = tl.load(Mean + rows, mask=r_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=r_mask, other=0.0)
        if SINGLE:  # one column block: x and dy are read once and stay in registers
            c_mask = cols < D
            mask = r_mask[:, None] & c_mask[None, :]
            x = tl.load(X + row_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = dy
            if HAS_W:
                wdy = dy * w_row
            c1 = tl.sum(wdy * xhat, axis=1) / D
            c2 = tl.sum(wdy, axis=1) / D
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            tl.store(DX + row_base + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            acc_dw += dy * xhat
            acc_db += dy
        else:
            # Row sums of w*dy*xhat and w*dy (the mean terms of dx), then a second pass for dx.
            s_xhat = tl.zeros([BLOCK_M], dtype=tl.float32)
            s_dy = tl.zeros([BLOCK_M], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                c = d0 + cols
                mask = r_mask[:, None] & (c < D)[None, :]
                x = tl.load(X + row_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                wdy = dy
                if HAS_W:
                    wdy = dy * tl.load(W + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
                s_xhat += tl.sum(wdy * xhat, axis=1)
                s_dy += tl.sum(wdy, axis=1)
            c1 = s_xhat / D
            c2 = s_dy / D
            for d0 in range(0, D, BLOCK_D):
                c = d0 + cols
                c_mask = c < D
                mask = r_mask[:, None] & c_mask[None, :]
                x = tl.load(X + row_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                wdy = dy
                if HAS_W:
                    wdy = dy * tl.load(W + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
                tl.store(DX + row_base + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                # This program's own partial row: read-modify-write without races.
                dw_old = tl.load(DWp + part + c, mask=c_mask, other=0.0)
                db_old = tl.load(DBp + part + c, mask=c_mask, other=0.0)
                tl.store(DWp + part + c, dw_old + tl.sum(dy * xhat, axis=0), mask=c_mask)
                tl.store(DBp + part + c, db_old + tl.sum(dy, axis=0), mask=c_mask)
    if SINGLE:
        tl.store(DWp + part + cols, tl.sum(acc_dw, axis=0), mask=cols < D)
        tl.store(DBp + part + cols, tl.sum(acc_db, axis=0), mask=cols < D)


def _ptr(t: Optional[torch.Tensor], dummy: torch.Tensor) -> torch.Tensor:
    """Absent weight/bias: pass any tensor (never read: HAS_W/HAS_B are False) instead of None."""
    return t if t is not None else dummy


# Launch plan: elements (rows x padded width) a program handles per step, forward and backward; backward
# programs per SM (few and long-lived: their weight-gradient partials stay in registers across row blocks); warps
# per program (None: one warp per 1024 tile elements). Module-level so that benchmarks/sweep_kernel_plans.py can
# time alternatives; the values are its winners at the Swin-T and SD widths (benchmarks/RESULTS.md#kernels).
FWD_TILE = 4096
BWD_TILE = 4096
BWD_PROGRAMS_PER_SM = 2
FWD_WARPS: Optional[int] = None
BWD_WARPS: Optional[int] = None
# The forward's loads of x hint that it is read once and may leave L2 first (None: when x fits in L2).
FWD_EVICT_FIRST: Optional[bool] = None


def _blocks(rows: int, width: int, tile: int) -> tuple[int, int, bool]:
    block_d = tu.reduction_block(width)
    block_m = min(tu.next_power_of_2(rows), max(1, tile // block_d))
    return block_m, block_d, block_d >= width


def _warps(fixed: Optional[int], block_m: int, block_d: int) -> int:
    return fixed or max(1, min(16, block_m * block_d // 1024))


def _n_programs(x: torch.Tensor, n_blocks: int) -> int:
    if x.is_cuda:
        return max(1, min(n_blocks, tu.num_programs_target(x, per_sm=BWD_PROGRAMS_PER_SM)))
    return max(1, min(n_blocks, 3))  # the interpreter: still more than one program, so the strided loop is exercised


def _fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
         eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    d = x.shape[-1]
    rows = x.numel() // max(d, 1)
    if use_triton(x):
        y = torch.empty_like(x)
        mean = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        block_m, block_d, single = _blocks(rows, d, FWD_TILE)
        _ln_fwd_kernel[(triton.cdiv(rows, block_m),)](
            x, y, _ptr(weight, x), _ptr(bias, x), mean, rstd, rows, d, eps,
            HAS_W=weight is not None, HAS_B=bias is not None,
            SINGLE=single, BLOCK_M=block_m, BLOCK_D=block_d, EVICT=tu.streaming_eviction(x, FWD_EVICT_FIRST),
            num_warps=_warps(FWD_WARPS, block_m, block_d))
        return y, mean, rstd
    var, mean = torch.var_mean(x.float(), dim=-1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    y = (x.float() - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
         rstd: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns dx and the stacked fp32 (dweight, dbias) of shape (2, D)."""
    x, dy = x.contiguous(), dy.contiguous()
    d = x.shape[-1]
    rows = x.numel() // max(d, 1)
    if use_triton(x):
        dx = torch.empty_like(x)
        block_m, block_d, single = _blocks(rows, d, BWD_TILE)
        n_blocks = triton.cdiv(rows, block_m)
        progs = _n_programs(x, n_blocks)
        # The single-block kernel writes every program's partial row; the multi-block one accumulates into it.
        alloc = torch.empty if single else torch.zeros
        part = alloc((2, progs, d), device=x.device, dtype=torch.float32)
        _ln_bwd_kernel[(progs,)](
            dy, x, _ptr(weight, x), mean, rstd, dx, part, rows, d, n_blocks, progs * d, HAS_W=weight is not None,
            SINGLE=single, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=_warps(BWD_WARPS, block_m, block_d))
        return dx, part.sum(1)
    xhat = (x.float() - mean[..., None]) * rstd[..., None]
    dyf = dy.float()
    wdy = dyf * weight.float() if weight is not None else dyf
    dx = rstd[..., None] * (wdy - wdy.mean(-1, keepdim=True) - xhat * (wdy * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), torch.stack([(dyf * xhat).reshape(-1, d).sum(0), dyf.reshape(-1, d).sum(0)])


def _param_grads(dwb: torch.Tensor, weight: Optional[torch.Tensor], bias_dtype: Optional[torch.dtype],
                 needs_input_grad: Tuple[bool, ...]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    dw = dwb[0].to(weight.dtype) if weight is not None and needs_input_grad[1] else None
    db = dwb[1].to(bias_dtype) if bias_dtype is not None and needs_input_grad[2] else None
    return dw, db


# torch.library ops: what torch.compile traces (and opcheck checks).
@library_op("gallery::layer_norm_fwd")
def layer_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd(x, weight, bias, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@library_op("gallery::layer_norm_bwd")
def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                   rstd: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, weight, mean, rstd)


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((2, x.shape[-1]), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dwb = layer_norm_bwd(dy, x, weight, mean, rstd)
    return (dx, *_param_grads(dwb, weight, ctx.bias_dtype, ctx.needs_input_grad), None)


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _LayerNormFunction(torch.autograd.Function):
    """Eager path: the same launchers without the dispatcher (see `_triton_utils.eager_mode`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _fwd(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dwb = _bwd(dy, x, weight, mean, rstd)
        return (dx, *_param_grads(dwb, weight, ctx.bias_dtype, ctx.needs_input_grad), None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` (fp32 statistics, output in ``x.dtype``).

    Matches ``F.layer_norm(x, x.shape[-1:], weight, bias, eps)``.
    """
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"layer_norm expects a non-empty last dimension, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (d,):
            raise ValueError(f"{name} must have shape ({d},) to match the last dim of x, got {tuple(t.shape)}")
    if tu.eager_mode():
        return _LayerNormFunction.apply(x, weight, bias, float(eps))
    y, _, _ = layer_norm_fwd(x, weight, bias, float(eps))
    return y
