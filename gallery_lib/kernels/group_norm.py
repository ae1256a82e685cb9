"""Fused GroupNorm (+ optional SiLU) over NCHW or channels_last input, statistics in fp32.

Design (and why):

* The work unit is a tile ``[BLOCK_G groups, BLOCK_CG channels, BLOCK_HW positions]`` of one sample. NCHW takes one
  group per tile, whose channels are contiguous runs of HW positions. Channels_last takes every group of the
  sample per tile, so a tile is a band of whole ``C``-long pixel rows: contiguous, coalesced memory, instead of
  ``C/G``-element slivers at a stride of ``C`` (the old strided access read 5x more sectors than it used).
* One program per (sample, group) gives only N*G programs (256 at batch 8): one or two 8-warp programs per SM
  cannot keep enough loads in flight. The spatial axis is therefore split over ``SPLIT`` programs per group so
  that about 4 programs per SM run. Forward: a statistics launch writes per-split Welford partials (count,
  mean, M2: stable for means far from zero, unlike sum/sum-of-squares), then the normalize launch combines the
  few partials of its groups (Chan's formula) and writes ``silu(x * scale + shift)``; its read of ``x`` mostly
  hits L2. When one program per group already fills the GPU (SPLIT = 1) both phases run in one launch.
* Backward needs, per group, ``sum(w*dz)`` and ``sum(w*dz*xhat)``, which are ``sum_c w_c * dbias_c`` and
  ``sum_c w_c * dweight_c``: the first launch writes only per-channel partial sums of ``dz`` and ``dz*xhat``
  (also the weight/bias gradient partials), the second combines them per group and writes ``dx``, and one
  ``sum`` over the (sample, split) rows finishes dweight/dbias: deterministic, no atomics. ``dz`` (the SiLU
  gradient) is recomputed from ``x`` and the saved mean/rstd, so the pre-activation never reaches memory.
* Per call: forward 1-2 launches, reads ``x`` (twice when split, the second mostly from L2), writes ``y`` and
  2*N*G floats; backward 3 launches, reads ``x`` and ``dy`` (twice when split), writes ``dx`` and small partials.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from gallery_lib.kernels import _triton_utils as tu
from gallery_lib.kernels._triton_utils import device_function, kernel, library_op, tl, triton, use_triton

_ACTIVATIONS = (None, "silu")


@device_function
def _gn_program(C, HW, G, SPLIT, HW_PER, BLOCK_G: tl.constexpr):
    """This program's sample ``n``, split ``s``, groups ``g1`` and their mask, sample offset and spatial range."""
    # Program -> (sample n, split s, group block gb), gb fastest so neighbouring programs share pixel rows in L2.
    pid = tl.program_id(0)
    n_gb = tl.cdiv(G, BLOCK_G)
    s = (pid // n_gb) % SPLIT
    n = pid // (n_gb * SPLIT)
    g1 = (pid % n_gb) * BLOCK_G + tl.arange(0, BLOCK_G)
    hw_lo = s * HW_PER
    return n, s, g1, g1 < G, n.to(tl.int64) * C * HW, hw_lo, tl.minimum(HW, hw_lo + HW_PER)


@device_function
def _gn_channels(g1, g_ok, c0, Cg, BLOCK_CG: tl.constexpr):
    """Channel indices ``[BLOCK_G, BLOCK_CG]`` of the channel block at ``c0`` of groups ``g1``, and their mask."""
    c1 = tl.arange(0, BLOCK_CG)[None, :]
    return g1[:, None] * Cg + c0 + c1, g_ok[:, None] & (c0 + c1 < Cg)


@device_function
def _gn_tile(ch2, gc2, h0, hw_hi, C, HW, CL: tl.constexpr, BLOCK_HW: tl.constexpr):
    """Offsets within a sample (NCHW or channels_last) and mask of the tile ``[groups, channels, positions h0..]``."""
    hw = h0 + tl.arange(0, BLOCK_HW)[None, None, :]
    ch = ch2[:, :, None]
    if CL:
        offs = hw * C + ch
    else:
        offs = ch * HW + hw
    return offs, gc2[:, :, None] & (hw < hw_hi)


@device_function
def _gn_affine(W, B, ch2, gc2, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """fp32 weight and bias of channels ``ch2``; 1 and 0 where the module has none."""
    if HAS_W:
        w = tl.load(W + ch2, mask=gc2, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(ch2.shape, dtype=tl.float32) + 1.0
    if HAS_B:
        b = tl.load(B + ch2, mask=gc2, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(ch2.shape, dtype=tl.float32)
    return w, b


@device_function
def _dsilu(dy, z):
    """Gradient through ``silu(z)``: the pre-activation ``z`` is recomputed, never stored."""
    sig = tl.sigmoid(z)
    return dy * sig * (1.0 + z * (1.0 - sig))


@kernel
def _gn_fwd_kernel(X, Y, W, B, Part, Mean, Rstd, C, HW, G, Cg, SPLIT, HW_PER, P, eps,
                   STATS: tl.constexpr, APPLY: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                   SILU: tl.constexpr, CL: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_CG: tl.constexpr, BLOCK_HW: tl.constexpr):
    n, s, g1, g_ok, base, hw_lo, hw_hi = _gn_program(C, HW, G, SPLIT, HW_PER, BLOCK_G)
    if STATS:
        # Per-lane Welford accumulators, merged across lanes at the end (stable in one read).
        acc_n = tl.zeros([BLOCK_G, BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        acc_mean = tl.zeros([BLOCK_G, BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        acc_m2 = tl.zeros([BLOCK_G, BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        for c0 in range(0, Cg, BLOCK_CG):
            ch2, gc2 = _gn_channels(g1, g_ok, c0, Cg, BLOCK_CG)
            for h0 in range(hw_lo, hw_hi, BLOCK_HW):
                offs, mask = _gn_tile(ch2, gc2, h0, hw_hi, C, HW, CL, BLOCK_HW)
                x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
                acc_n += mask.to(tl.float32)
                delta = x - acc_mean
                acc_mean += tl.where(mask, delta / tl.maximum(acc_n, 1.0), 0.0)
                acc_m2 += tl.where(mask, delta * (x - acc_mean), 0.0)
        cnt = tl.sum(tl.sum(acc_n, axis=2), axis=1)
        mean = tl.sum(tl.sum(acc_mean * acc_n, axis=2), axis=1) / tl.maximum(cnt, 1.0)
        diff = acc_mean - mean[:, None, None]
        m2 = tl.sum(tl.sum(acc_m2 + acc_n * diff * diff, axis=2), axis=1)
        if not APPLY:  # first phase of a split group: publish this split's partial statistics
            slot = (n * SPLIT + s) * G + g1
            tl.store(Part + slot, cnt, mask=g_ok)
            tl.store(Part + P + slot, mean, mask=g_ok)
            tl.store(Part + 2 * P + slot, m2, mask=g_ok)
    if APPLY:
        if not STATS:  # combine the splits' partials (Chan et al.), a few floats per group
            cnt = tl.zeros([BLOCK_G], dtype=tl.float32)
            mean = tl.zeros([BLOCK_G], dtype=tl.float32)
            m2 = tl.zeros([BLOCK_G], dtype=tl.float32)
            for s2 in range(0, SPLIT):
                slot = (n * SPLIT + s2) * G + g1
                cb = tl.load(Part + slot, mask=g_ok, other=0.0)
                delta = tl.load(Part + P + slot, mask=g_ok, other=0.0) - mean
                total = cnt + cb
                frac = cb / tl.maximum(total, 1.0)
                mean += delta * frac
                m2 += tl.load(Part + 2 * P + slot, mask=g_ok, other=0.0) + delta * delta * cnt * frac
                cnt = total
        rstd = 1.0 / tl.sqrt(m2 / tl.maximum(cnt, 1.0) + eps)
        tl.store(Mean + n * G + g1, mean, mask=g_ok & (s == 0))
        tl.store(Rstd + n * G + g1, rstd, mask=g_ok & (s == 0))
        for c0 in range(0, Cg, BLOCK_CG):
            ch2, gc2 = _gn_channels(g1, g_ok, c0, Cg, BLOCK_CG)
            w, b = _gn_affine(W, B, ch2, gc2, HAS_W, HAS_B)
            scale = w * rstd[:, None]
            shift = (b - mean[:, None] * scale)[:, :, None]
            scale = scale[:, :, None]
            for h0 in range(hw_lo, hw_hi, BLOCK_HW):
                offs, mask = _gn_tile(ch2, gc2, h0, hw_hi, C, HW, CL, BLOCK_HW)
                z = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32) * scale + shift
                if SILU:
                    z = z * tl.sigmoid(z)
                tl.store(Y + base + offs, z.to(Y.dtype.element_ty), mask=mask)


@kernel
def _gn_bwd_kernel(DY, X, W, B, Mean, Rstd, DX, Part, C, HW, G, Cg, SPLIT, HW_PER, P,
                   STATS: tl.constexpr, APPLY: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                   SILU: tl.constexpr, CL: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_CG: tl.constexpr, BLOCK_HW: tl.constexpr):
    n, s, g1, g_ok, base, hw_lo, hw_hi = _gn_program(C, HW, G, SPLIT, HW_PER, BLOCK_G)
    mean = tl.load(Mean + n * G + g1, mask=g_ok, other=0.0)[:, None, None]
    rstd = tl.load(Rstd + n * G + g1, mask=g_ok, other=0.0)[:, None, None]
    # Group sums of w*dz and w*dz*xhat (the mean terms of dx), built from per-channel sums of dz and dz*xhat.
    sum_wdz = tl.zeros([BLOCK_G], dtype=tl.float32)
    sum_wdzx = tl.zeros([BLOCK_G], dtype=tl.float32)
    if STATS:
        row = (n * SPLIT + s) * C
        for c0 in range(0, Cg, BLOCK_CG):
            ch2, gc2 = _gn_channels(g1, g_ok, c0, Cg, BLOCK_CG)
            w2, b2 = _gn_affine(W, B, ch2, gc2, HAS_W, HAS_B)
            w, b = w2[:, :, None], b2[:, :, None]
            acc_dzx = tl.zeros([BLOCK_G, BLOCK_CG, BLOCK_HW], dtype=tl.float32)
            acc_dz = tl.zeros([BLOCK_G, BLOCK_CG, BLOCK_HW], dtype=tl.float32)
            for h0 in range(hw_lo, hw_hi, BLOCK_HW):
                offs, mask = _gn_tile(ch2, gc2, h0, hw_hi, C, HW, CL, BLOCK_HW)
                x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
                dz = tl.load(DY + base + offs, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                if SILU:
                    dz = _dsilu(dz, xhat * w + b)
                acc_dzx += dz * xhat
                acc_dz += dz
            dw_c = tl.sum(acc_dzx, axis=2)
            db_c = tl.sum(acc_dz, axis=2)
            # Weight/bias gradient partials of this (sample, split): summed over rows by the launcher.
            tl.store(Part + row + ch2, dw_c, mask=gc2)
            tl.store(Part + P + row + ch2, db_c, mask=gc2)
            sum_wdzx += tl.sum(w2 * dw_c, axis=1)
            sum_wdz += tl.sum(w2 * db_c, axis=1)
    if APPLY:
        if not STATS:
            for s2 in range(0, SPLIT):
                row = (n * SPLIT + s2) * C
                for c0 in range(0, Cg, BLOCK_CG):
                    ch2, gc2 = _gn_channels(g1, g_ok, c0, Cg, BLOCK_CG)
                    w2, _ = _gn_affine(W, B, ch2, gc2, HAS_W, False)
                    sum_wdzx += tl.sum(w2 * tl.load(Part + row + ch2, mask=gc2, other=0.0), axis=1)
                    sum_wdz += tl.sum(w2 * tl.load(Part + P + row + ch2, mask=gc2, other=0.0), axis=1)
        inv_m = 1.0 / (Cg * 1.0 * HW)  # Cg or HW may arrive as a constexpr 1
        c_mean = (sum_wdz * inv_m)[:, None, None]
        c_xmean = (sum_wdzx * inv_m)[:, None, None]
        for c0 in range(0, Cg, BLOCK_CG):
            ch2, gc2 = _gn_channels(g1, g_ok, c0, Cg, BLOCK_CG)
            w2, b2 = _gn_affine(W, B, ch2, gc2, HAS_W, HAS_B)
            w, b = w2[:, :, None], b2[:, :, None]
            for h0 in range(hw_lo, hw_hi, BLOCK_HW):
                offs, mask = _gn_tile(ch2, gc2, h0, hw_hi, C, HW, CL, BLOCK_HW)
                x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
                dz = tl.load(DY + base + offs, mask=mask, other=0.0).to(tl.float32)
                xhat = (x - mean) * rstd
                if SILU:
                    dz = _dsilu(dz, xhat * w + b)
                dx = rstd * (dz * w - c_mean - xhat * c_xmean)
                tl.store(DX + base + offs, dx.to(DX.dtype.element_ty), mask=mask)


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _as_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t.contiguous()


def _ptr(t: Optional[torch.Tensor], dummy: torch.Tensor) -> torch.Tensor:
    """Absent weight/bias: pass any tensor (never read: HAS_W/HAS_B are False) instead of None."""
    return t if t is not None else dummy


class _Plan:
    """Tile and split of one launch: see the module docstring."""

    def __init__(self, x: torch.Tensor, groups: int, channels_last: bool) -> None:
        n, c = x.shape[0], x.shape[1]
        self.hw = x.numel() // max(1, n * c)
        cg = c // groups
        cap = tu.MAX_BLOCK
        self.block_cg = min(tu.next_power_of_2(cg), cap)
        # Channels_last: all groups of a pixel row in one tile (contiguous); NCHW: one group (its rows are contiguous).
        self.block_g = min(tu.next_power_of_2(groups), max(1, cap // self.block_cg)) if channels_last else 1
        self.block_hw = min(tu.next_power_of_2(self.hw), max(1, cap // (self.block_g * self.block_cg)))
        tiles = n * triton.cdiv(groups, self.block_g)
        hw_blocks = triton.cdiv(self.hw, self.block_hw)
        split = max(1, min(hw_blocks, triton.cdiv(tu.num_programs_target(x, per_sm=4), tiles)))
        self.hw_per = triton.cdiv(hw_blocks, split) * self.block_hw
        self.split = triton.cdiv(self.hw, self.hw_per) if self.hw else 1
        self.grid = (tiles * self.split,)
        self.meta = dict(CL=channels_last, BLOCK_G=self.block_g, BLOCK_CG=self.block_cg, BLOCK_HW=self.block_hw,
                         num_warps=tu.num_warps_for(self.block_g * self.block_cg * self.block_hw))


def _fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], num_groups: int, eps: float,
         silu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, c = x.shape[0], x.shape[1]
    cl = _channels_last(x)
    x = _as_layout(x, cl)
    if use_triton(x):
        plan = _Plan(x, num_groups, cl)
        y = torch.empty_like(x)
        mean = torch.empty((n, num_groups), device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        p = n * plan.split * num_groups
        part = torch.empty((3, p), device=x.device, dtype=torch.float32) if plan.split > 1 else mean
        args = (x, y, _ptr(weight, x), _ptr(bias, x), part, mean, rstd, c, plan.hw, num_groups, c // num_groups,
                plan.split, plan.hw_per, p, eps)
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu, **plan.meta)
        if plan.split > 1:
            _gn_fwd_kernel[plan.grid](*args, STATS=True, APPLY=False, **flags)
        _gn_fwd_kernel[plan.grid](*args, STATS=plan.split == 1, APPLY=True, **flags)
        return y, mean, rstd
    var, mean = torch.var_mean(x.float().reshape(n, num_groups, -1), dim=-1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    z = _xhat_reference(x, mean, rstd, num_groups) * _affine(weight, c, x, 1.0) + _affine(bias, c, x, 0.0)
    if silu:
        z = F.silu(z)
    return _as_layout(z.to(x.dtype), cl), mean, rstd


def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
         mean: torch.Tensor, rstd: torch.Tensor, num_groups: int, silu: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns dx and the stacked fp32 (dweight, dbias) of shape (2, C)."""
    n, c = x.shape[0], x.shape[1]
    cl = _channels_last(x)
    x, dy = _as_layout(x, cl), _as_layout(dy, cl)
    if use_triton(x):
        plan = _Plan(x, num_groups, cl)
        dx = torch.empty_like(x)
        p = n * plan.split * c
        part = torch.empty((2, n * plan.split, c), device=x.device, dtype=torch.float32)
        args = (dy, x, _ptr(weight, x), _ptr(bias, x), mean, rstd, dx, part, c, plan.hw, num_groups,
                c // num_groups, plan.split, plan.hw_per, p)
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu, **plan.meta)
        if plan.split > 1:
            _gn_bwd_kernel[plan.grid](*args, STATS=True, APPLY=False, **flags)
            _gn_bwd_kernel[plan.grid](*args, STATS=False, APPLY=True, **flags)
        else:
            _gn_bwd_kernel[plan.grid](*args, STATS=True, APPLY=True, **flags)
        # Second stage of the weight/bias reduction: one sum over the (sample, split) rows, deterministic.
        return dx, part.sum(1)
    w = _affine(weight, c, x, 1.0)
    xhat = _xhat_reference(x, mean, rstd, num_groups)
    dz = dy.float()
    if silu:
        z = xhat * w + _affine(bias, c, x, 0.0)
        sig = torch.sigmoid(z)
        dz = dz * sig * (1.0 + z * (1.0 - sig))
    reduce_dims = [0] + list(range(2, x.dim()))
    dwb = torch.stack([(dz * xhat).sum(reduce_dims), dz.sum(reduce_dims)])
    dxhat = (dz * w).reshape(n, num_groups, -1)
    xg = xhat.reshape(n, num_groups, -1)
    dx = rstd[..., None] * (dxhat - dxhat.mean(-1, keepdim=True) - xg * (dxhat * xg).mean(-1, keepdim=True))
    return _as_layout(dx.reshape(x.shape).to(x.dtype), cl), dwb


def _affine(t: torch.Tensor | None, c: int, like: torch.Tensor, fill: float) -> torch.Tensor:
    """A per-channel fp32 vector broadcastable over (N, C, *spatial)."""
    v = t.float() if t is not None else torch.full((c,), fill, device=like.device, dtype=torch.float32)
    return v.view(1, c, *([1] * (like.dim() - 2)))


def _xhat_reference(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, num_groups: int) -> torch.Tensor:
    xg = x.float().reshape(x.shape[0], num_groups, -1)
    return ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)


def _param_grads(dwb: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 needs_input_grad: Tuple[bool, ...]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    dw = dwb[0].to(weight.dtype) if weight is not None and needs_input_grad[1] else None
    db = dwb[1].to(bias.dtype) if bias is not None and needs_input_grad[2] else None
    return dw, db


# torch.library ops: what torch.compile traces (and opcheck checks).
@library_op("gallery::group_norm_fwd")
def group_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   num_groups: int, eps: float, silu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd(x, weight, bias, num_groups, eps, silu)


@group_norm_fwd.register_fake
def _(x, weight, bias, num_groups, eps, silu):
    stats = x.new_empty((x.shape[0], num_groups), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.preserve_format), stats, torch.empty_like(stats)


@library_op("gallery::group_norm_bwd")
def group_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor, num_groups: int,
                   silu: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, weight, bias, mean, rstd, num_groups, silu)


@group_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, num_groups, silu):
    return torch.empty_like(x, memory_format=torch.preserve_format), x.new_empty((2, x.shape[1]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, _eps, silu = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups, ctx.silu = num_groups, silu


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dwb = group_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.num_groups, ctx.silu)
    return (dx, *_param_grads(dwb, weight, bias, ctx.needs_input_grad), None, None, None)


group_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _GroupNormFunction(torch.autograd.Function):
    """Eager path: the same launchers without the dispatcher (see `_triton_utils.eager_mode`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_groups, eps, silu):
        y, mean, rstd = _fwd(x, weight, bias, num_groups, eps, silu)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.num_groups, ctx.silu = num_groups, silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dwb = _bwd(dy, x, weight, bias, mean, rstd, ctx.num_groups, ctx.silu)
        return (dx, *_param_grads(dwb, weight, bias, ctx.needs_input_grad), None, None, None)


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, activation: str | None = None) -> torch.Tensor:
    """GroupNorm over ``x`` of shape (N, C, *spatial), optionally followed by SiLU, as one fused op.

    Statistics are computed in fp32; the output has the dtype and memory format (NCHW or channels_last) of ``x``.
    Matches ``F.silu(F.group_norm(x, num_groups, weight, bias, eps))`` for ``activation="silu"``.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() < 2:
        raise ValueError(f"group_norm expects (N, C, *spatial) input, got shape {tuple(x.shape)}")
    c = x.shape[1]
    if num_groups < 1 or c % num_groups:
        raise ValueError(f"num_channels ({c}) must be divisible by num_groups ({num_groups})")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (c,):
            raise ValueError(f"{name} must have shape ({c},) to match the channels of x, got {tuple(t.shape)}")
    if tu.eager_mode():
        return _GroupNormFunction.apply(x, weight, bias, num_groups, float(eps), activation == "silu")
    y, _, _ = group_norm_fwd(x, weight, bias, num_groups, float(eps), activation == "silu")
    return y
