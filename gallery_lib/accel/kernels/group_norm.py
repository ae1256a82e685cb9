"""Fused GroupNorm (+ optional SiLU) over NCHW or channels_last input, statistics in fp32.

Design (and why):

* Every tile is dense and contiguous: a program takes a *window* of channels of one sample and a range of spatial
  positions, and loads tiles ``[channels, positions]`` in NCHW (a channel's positions are one contiguous row) or
  ``[positions, channels]`` in channels_last (a pixel's channels are contiguous). Statistics are reduced per
  channel, along the positions. SD's groups hold 10, 20 or 40 channels; a tile of whole groups padded to a power
  of two (the old ``[groups, next_pow2(C/G), positions]`` tile) masked ~37% of its lanes, and in channels_last its
  20-byte runs ruled out 16-byte loads.
* Per-channel partials: the statistics phase writes, per (sample, split, channel), the mean and M2 (sum of squared
  deviations) of its positions. They come from sums of ``x - shift`` and its square, ``shift`` being the
  channel's mean over the program's first tile: one subtraction and one FMA per element where per-element Welford
  costs a division, and stable for means far from zero because the shift removes them before squaring.
* Group combine: the normalize phase loads the few partials of the groups its window overlaps (a
  ``[groups, C/G]`` tile per split), merges them with Chan's formula (equal counts within a split, exact weights
  across splits), saves (mean, rstd) of shape (N, G) and maps them back to its channels with a one-hot select
  (registers cannot be gathered). Weight and bias are per-channel loads, so ``scale``/``shift`` are per channel.
* Two plans (`_Plan`). Split: windows of 64 channels (a power of two dividing C where possible: a full 128-byte
  line of a bf16 pixel row) or, in NCHW, as many channels as fill a ``MAX_BLOCK`` tile; the positions are split
  over ``SPLIT`` programs so that about 4 programs per SM run; the statistics and the normalize phases are two
  launches. Fused: windows of whole groups (`_groups_per_window`: 120 of 128 lanes for SD's groups) with no
  split, when those programs fill the GPU or a window is only a few tiles long (the 8x8..16x16 UNet levels, where
  launches, not bytes, cost the time): one launch, the program reading back its own partials after a barrier.
* Backward: per channel, the sums of ``dz`` and ``dz*xhat`` (``dz`` is ``dy`` through the SiLU, whose input is
  recomputed from ``x``: the pre-activation never reaches memory) ARE the partials of dbias/dweight, and the group
  terms of dx are ``sum_c w_c * dbias_c`` and ``sum_c w_c * dweight_c``; then
  ``dx = rstd * (dz * w - c1 - xhat * c2)``. Split plan: launch 1 writes the partials, launch 2 writes ``dx``
  and its first-sample programs sum the partial rows into dweight/dbias. Fused plan: one launch writes the
  partials and ``dx``, and a ``sum`` over the sample rows finishes dweight/dbias. Deterministic, no atomics.
* Per call: forward 1 launch (fused) or 2 (split), reads ``x`` twice (fused: the second read from L1/L2; split:
  from L2 when ``x`` fits there), writes ``y``, the (N, G) statistics and 2*N*SPLIT*C floats of partials; backward
  2 launches, reads ``x`` and ``dy`` twice, writes ``dx`` and the partials. Plans are cached per shape, so a small
  call costs little host time.
"""

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import device_function, kernel, library_op, tl, triton, use_triton

_ACTIVATIONS = (None, "silu")
# Channels per program of the split plan in channels_last: 128 bytes of a bf16 pixel row, a whole cache line.
_CL_CHANNELS = 64
# The fused plan also runs when a window spans at most this many tiles of positions: its second read then hits L1/L2
# and one launch less saves more than the missing split would give.
_FUSED_MAX_HW_BLOCKS = 4
# Programs per SM the split plan aims for, and the pipeline depth of the loops over positions (None: plain loops):
# 3 stages at 4 per SM measured fastest on SD-1.5's norms at batch 32 (benchmarks/RESULTS.md#group-norm-pipelining).
PROGRAMS_PER_SM = 4
LOOP_STAGES = 3


@device_function
def _gn_program(C, HW, SPLIT, HW_PER, WIN: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's sample ``n``, split ``s``, window start ``c_lo``, channels ``c`` and their mask, sample offset
    and spatial range ``hw_lo..hw_hi``."""
    # Program -> (sample n, split s, window w), w fastest so neighbouring programs share pixel rows in L2.
    pid = tl.program_id(0)
    n_win = tl.cdiv(C, WIN)
    s = (pid // n_win) % SPLIT
    n = pid // (n_win * SPLIT)
    c_lo = (pid % n_win) * WIN
    lane = tl.arange(0, BLOCK_C)
    c = c_lo + lane
    hw_lo = s * HW_PER
    return n, s, c_lo, c, (lane < WIN) & (c < C), n.to(tl.int64) * C * HW, hw_lo, tl.minimum(HW, hw_lo + HW_PER)


@device_function
def _tile(c, c_ok, h0, hw_hi, C, HW, CL: tl.constexpr, BLOCK_HW: tl.constexpr):
    """Offsets within a sample and mask of the tile of channels ``c`` at positions ``h0..``: ``[positions, channels]``
    in channels_last, ``[channels, positions]`` in NCHW (the contiguous axis last either way)."""
    hw = h0 + tl.arange(0, BLOCK_HW)
    if CL:
        offs = hw[:, None] * C + c[None, :]
        mask = (hw < hw_hi)[:, None] & c_ok[None, :]
    else:
        offs = c[:, None] * HW + hw[None, :]
        mask = c_ok[:, None] & (hw < hw_hi)[None, :]
    return offs, mask


@device_function
def _chan(v, CL: tl.constexpr):
    """A per-channel vector shaped to broadcast over a tile."""
    if CL:
        t = v[None, :]
    else:
        t = v[:, None]
    return t


@device_function
def _hw_sum(t, CL: tl.constexpr):
    """Per-channel sums of a tile: the reduction over positions."""
    if CL:
        v = tl.sum(t, axis=0)
    else:
        v = tl.sum(t, axis=1)
    return v


@device_function
def _tile_zeros(CL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
    """fp32 zeros of the tile's shape (per-lane accumulators)."""
    if CL:
        z = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
    else:
        z = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
    return z


@device_function
def _gn_affine(W, B, c, c_ok, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """fp32 weight and bias of channels ``c``; 1 and 0 where the module has none."""
    if HAS_W:
        w = tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(c.shape, dtype=tl.float32) + 1.0
    if HAS_B:
        b = tl.load(B + c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(c.shape, dtype=tl.float32)
    return w, b


@device_function
def _window_groups(c_lo, C, G, Cg, WIN: tl.constexpr, BLOCK_GW: tl.constexpr):
    """The groups overlapping the window ``c_lo..c_lo+WIN``: first group, indices and mask."""
    g_lo = c_lo // Cg
    g = g_lo + tl.arange(0, BLOCK_GW)
    return g_lo, g, (g < G) & (g * Cg < tl.minimum(C, c_lo + WIN))


@device_function
def _group_tile(g, g_ok, j0, Cg, BLOCK_CG: tl.constexpr):
    """Channel indices ``[groups, BLOCK_CG]`` of channels ``j0..`` within groups ``g``, and their mask."""
    j = j0 + tl.arange(0, BLOCK_CG)[None, :]
    return g[:, None] * Cg + j, g_ok[:, None] & (j < Cg)


@device_function
def _to_channels(v, c, g_lo, Cg, BLOCK_GW: tl.constexpr):
    """The per-group vector ``v`` (groups ``g_lo..``) per channel ``c``: a one-hot select, as registers cannot be
    gathered (``BLOCK_C * BLOCK_GW`` compares, once per program)."""
    hit = (c // Cg - g_lo)[:, None] == tl.arange(0, BLOCK_GW)[None, :]
    return tl.sum(tl.where(hit, v[None, :], 0.0), axis=1)


@device_function
def _channel_moments(X, base, c, c_ok, hw_lo, hw_hi, C, HW, CL: tl.constexpr, BLOCK_HW: tl.constexpr,
                     STAGES: tl.constexpr):
    """Mean and M2 of each channel ``c`` over positions ``hw_lo..hw_hi`` (see the module docstring)."""
    offs, mask = _tile(c, c_ok, hw_lo, hw_hi, C, HW, CL, BLOCK_HW)
    x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
    shift = _hw_sum(x, CL) / tl.maximum(tl.minimum(hw_hi - hw_lo, BLOCK_HW), 1).to(tl.float32)
    shift_t = _chan(shift, CL)
    # Per-lane sums (one cross-lane reduction at the end, not one per tile); the first tile is already loaded.
    d = tl.where(mask, x - shift_t, 0.0)
    s1 = d
    s2 = d * d
    for h0 in tl.range(hw_lo + BLOCK_HW, hw_hi, BLOCK_HW, num_stages=STAGES):
        offs, mask = _tile(c, c_ok, h0, hw_hi, C, HW, CL, BLOCK_HW)
        x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift_t, 0.0)
        s1 += d
        s2 += d * d
    cnt = tl.maximum(hw_hi - hw_lo, 1).to(tl.float32)
    sum1 = _hw_sum(s1, CL)
    return shift + sum1 / cnt, tl.maximum(_hw_sum(s2, CL) - sum1 * sum1 / cnt, 0.0)


@device_function
def _group_moments(Part, P, n, g, g_ok, C, Cg, HW, SPLIT, HW_PER,
                   BLOCK_GW: tl.constexpr, BLOCK_CG: tl.constexpr):
    """Mean and variance of groups ``g`` of sample ``n`` from the per-channel partials of every split.

    A piece is a split's partials of up to ``BLOCK_CG`` channels: equal counts, so its mean is the mean of the channel
    means and its M2 adds their spread; pieces are merged with Chan's formula.
    """
    cnt = tl.zeros([BLOCK_GW], dtype=tl.float32)
    mean = tl.zeros([BLOCK_GW], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_GW], dtype=tl.float32)
    for s in range(0, SPLIT):
        row = Part + (n * SPLIT + s) * C
        cnt_s = (tl.minimum(HW, (s + 1) * HW_PER) - s * HW_PER).to(tl.float32)
        for j0 in range(0, Cg, BLOCK_CG):
            ch, ok = _group_tile(g, g_ok, j0, Cg, BLOCK_CG)
            k = tl.minimum(Cg - j0, BLOCK_CG).to(tl.float32)
            m = tl.load(row + ch, mask=ok, other=0.0)
            mean_b = tl.sum(m, axis=1) / k
            dm = tl.where(ok, m - mean_b[:, None], 0.0)
            m2_b = tl.sum(tl.load(row + P + ch, mask=ok, other=0.0), axis=1) + cnt_s * tl.sum(dm * dm, axis=1)
            cnt_b = cnt_s * k
            delta = mean_b - mean
            total = cnt + cnt_b
            mean += delta * (cnt_b / total)
            m2 += m2_b + delta * delta * (cnt * cnt_b / total)
            cnt = total
    return mean, m2 / tl.maximum(cnt, 1.0)


@device_function
def _group_dots(Part, P, W, n, g, g_ok, C, Cg, SPLIT, HAS_W: tl.constexpr,
                BLOCK_GW: tl.constexpr, BLOCK_CG: tl.constexpr):
    """``sum_c w_c * dweight_c`` and ``sum_c w_c * dbias_c`` of groups ``g`` of sample ``n``, over every split."""
    sum_dzx = tl.zeros([BLOCK_GW], dtype=tl.float32)
    sum_dz = tl.zeros([BLOCK_GW], dtype=tl.float32)
    for j0 in range(0, Cg, BLOCK_CG):
        ch, ok = _group_tile(g, g_ok, j0, Cg, BLOCK_CG)
        acc_dzx = tl.zeros([BLOCK_GW, BLOCK_CG], dtype=tl.float32)
        acc_dz = tl.zeros([BLOCK_GW, BLOCK_CG], dtype=tl.float32)
        for s in range(0, SPLIT):
            row = Part + (n * SPLIT + s) * C
            acc_dzx += tl.load(row + ch, mask=ok, other=0.0)
            acc_dz += tl.load(row + P + ch, mask=ok, other=0.0)
        if HAS_W:
            w = tl.load(W + ch, mask=ok, other=0.0).to(tl.float32)
            acc_dzx = acc_dzx * w
            acc_dz = acc_dz * w
        sum_dzx += tl.sum(acc_dzx, axis=1)
        sum_dz += tl.sum(acc_dz, axis=1)
    return sum_dzx, sum_dz


@device_function
def _xhat_dz(X, DY, base, offs, mask, mean, rstd, w, b, SILU: tl.constexpr):
    """``xhat`` and ``dz`` of one tile; ``dz`` is ``dy`` through the SiLU, whose input is recomputed, never stored."""
    x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
    dz = tl.load(DY + base + offs, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    if SILU:
        z = xhat * w + b
        sig = tl.sigmoid(z)
        dz = dz * sig * (1.0 + z * (1.0 - sig))
    return xhat, dz


@device_function
def _sum_rows(Part, P, DWB, c, c_ok, R, C, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """dweight and dbias of channels ``c``: the sums of the ``R`` (sample, split) partial rows, in a fixed order."""
    r = tl.arange(0, BLOCK_R)[:, None]
    acc_w = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs = (r0 + r) * C + c[None, :]
        ok = (r0 + r < R) & c_ok[None, :]
        acc_w += tl.load(Part + offs, mask=ok, other=0.0)
        acc_b += tl.load(Part + P + offs, mask=ok, other=0.0)
    tl.store(DWB + c, tl.sum(acc_w, axis=0), mask=c_ok)
    tl.store(DWB + C + c, tl.sum(acc_b, axis=0), mask=c_ok)


@kernel
def _gn_fwd_kernel(X, Y, W, B, Part, Mean, Rstd, C, HW, G, Cg, SPLIT, HW_PER, P, eps,
                   STATS: tl.constexpr, APPLY: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                   SILU: tl.constexpr, CL: tl.constexpr, WIN: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_HW: tl.constexpr, BLOCK_GW: tl.constexpr, BLOCK_CG: tl.constexpr, STAGES: tl.constexpr):
    # Part is (2, N * SPLIT, C): plane 0 the per-channel means, plane 1 (offset P) the M2s.
    n, s, c_lo, c, c_ok, base, hw_lo, hw_hi = _gn_program(C, HW, SPLIT, HW_PER, WIN, BLOCK_C)
    if STATS:
        mean_c, m2_c = _channel_moments(X, base, c, c_ok, hw_lo, hw_hi, C, HW, CL, BLOCK_HW, STAGES)
        row = (n * SPLIT + s) * C
        tl.store(Part + row + c, mean_c, mask=c_ok)
        tl.store(Part + P + row + c, m2_c, mask=c_ok)
        if APPLY:  # fused plan: the window holds whole groups, whose partials this program has just stored
            tl.debug_barrier()
    if APPLY:
        g_lo, g, g_ok = _window_groups(c_lo, C, G, Cg, WIN, BLOCK_GW)
        mean_g, var_g = _group_moments(Part, P, n, g, g_ok, C, Cg, HW, SPLIT, HW_PER, BLOCK_GW, BLOCK_CG)
        rstd_g = 1.0 / tl.sqrt(var_g + eps)
        # Saved once per group: by the first split of the window that holds the group's first channel.
        own = g_ok & (g * Cg >= c_lo) & (s == 0)
        tl.store(Mean + n * G + g, mean_g, mask=own)
        tl.store(Rstd + n * G + g, rstd_g, mask=own)
        w, b = _gn_affine(W, B, c, c_ok, HAS_W, HAS_B)
        scale = w * _to_channels(rstd_g, c, g_lo, Cg, BLOCK_GW)
        shift = _chan(b - _to_channels(mean_g, c, g_lo, Cg, BLOCK_GW) * scale, CL)
        scale = _chan(scale, CL)
        for h0 in tl.range(hw_lo, hw_hi, BLOCK_HW, num_stages=STAGES):
            offs, mask = _tile(c, c_ok, h0, hw_hi, C, HW, CL, BLOCK_HW)
            z = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32) * scale + shift
            if SILU:
                z = z * tl.sigmoid(z)
            tl.store(Y + base + offs, z.to(Y.dtype.element_ty), mask=mask)


@kernel
def _gn_bwd_kernel(DY, X, W, B, Mean, Rstd, DX, Part, DWB, C, HW, G, Cg, SPLIT, HW_PER, P, R,
                   STATS: tl.constexpr, APPLY: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                   SILU: tl.constexpr, CL: tl.constexpr, WIN: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_HW: tl.constexpr, BLOCK_GW: tl.constexpr, BLOCK_CG: tl.constexpr, BLOCK_R: tl.constexpr,
                   STAGES: tl.constexpr):
    # Part is (2, R = N * SPLIT, C): plane 0 the per-channel sums of dz*xhat (dweight), plane 1 those of dz (dbias).
    n, s, c_lo, c, c_ok, base, hw_lo, hw_hi = _gn_program(C, HW, SPLIT, HW_PER, WIN, BLOCK_C)
    mean = _chan(tl.load(Mean + n * G + c // Cg, mask=c_ok, other=0.0), CL)
    rstd = _chan(tl.load(Rstd + n * G + c // Cg, mask=c_ok, other=0.0), CL)
    w_c, b_c = _gn_affine(W, B, c, c_ok, HAS_W, HAS_B)
    w, b = _chan(w_c, CL), _chan(b_c, CL)
    if STATS:
        acc_dzx = _tile_zeros(CL, BLOCK_C, BLOCK_HW)
        acc_dz = _tile_zeros(CL, BLOCK_C, BLOCK_HW)
        for h0 in tl.range(hw_lo, hw_hi, BLOCK_HW, num_stages=STAGES):
            offs, mask = _tile(c, c_ok, h0, hw_hi, C, HW, CL, BLOCK_HW)
            xhat, dz = _xhat_dz(X, DY, base, offs, mask, mean, rstd, w, b, SILU)
            acc_dzx += dz * xhat
            acc_dz += dz
        row = (n * SPLIT + s) * C
        tl.store(Part + row + c, _hw_sum(acc_dzx, CL), mask=c_ok)
        tl.store(Part + P + row + c, _hw_sum(acc_dz, CL), mask=c_ok)
        if APPLY:  # fused plan: the window holds whole groups, whose partials this program has just stored
            tl.debug_barrier()
    if APPLY:
        g_lo, g, g_ok = _window_groups(c_lo, C, G, Cg, WIN, BLOCK_GW)
        sum_wdzx, sum_wdz = _group_dots(Part, P, W, n, g, g_ok, C, Cg, SPLIT, HAS_W, BLOCK_GW, BLOCK_CG)
        inv_m = 1.0 / (Cg * 1.0 * HW)  # Cg or HW may arrive as a constexpr 1
        c_xmean = _chan(_to_channels(sum_wdzx, c, g_lo, Cg, BLOCK_GW) * inv_m, CL)
        c_mean = _chan(_to_channels(sum_wdz, c, g_lo, Cg, BLOCK_GW) * inv_m, CL)
        for h0 in tl.range(hw_lo, hw_hi, BLOCK_HW, num_stages=STAGES):
            offs, mask = _tile(c, c_ok, h0, hw_hi, C, HW, CL, BLOCK_HW)
            xhat, dz = _xhat_dz(X, DY, base, offs, mask, mean, rstd, w, b, SILU)
            dx = rstd * (dz * w - c_mean - xhat * c_xmean)
            tl.store(DX + base + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if not STATS:
            # Split plan: every partial row is complete (previous launch); the first sample's first-split programs
            # finish dweight/dbias, one window each.
            if (n == 0) & (s == 0):
                _sum_rows(Part, P, DWB, c, c_ok, R, C, BLOCK_C, BLOCK_R)


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _as_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t.contiguous()


def _ptr(t: Optional[torch.Tensor], dummy: torch.Tensor) -> torch.Tensor:
    """Absent weight/bias: pass any tensor (never read: HAS_W/HAS_B are False) instead of None."""
    return t if t is not None else dummy


def _groups_per_window(cg: int, groups: int, cap: int, align: int) -> int:
    """Groups per program of the fused plan: the fewest whose channels fill >= 3/4 of their power-of-two block and
    are a multiple of ``align`` (channels_last: 8, so that bf16 pixel runs stay 16-byte aligned; SD's 10/20/40
    channels per group give windows of 120 channels in 128 lanes); else the fewest that fill 3/4, else 1; 0 when
    one group does not fit in ``cap`` lanes."""
    unaligned = 0
    for gw in range(1, groups + 1):
        lanes = tu.next_power_of_2(gw * cg)
        if lanes > cap:
            break
        if 4 * gw * cg >= 3 * lanes:
            if gw * cg % align == 0:
                return gw
            unaligned = unaligned or gw
    return unaligned or (1 if tu.next_power_of_2(cg) <= cap else 0)


def _split_channels(c: int, hw: int, channels_last: bool, cap: int) -> int:
    """Channels per program of the split plan: a power of two dividing ``c`` (dense, aligned tiles); a masked tail
    only when ``c`` has no such divisor of useful size (odd counts)."""
    limit = min(_CL_CHANNELS, cap) if channels_last else max(1, cap // min(tu.next_power_of_2(hw), cap))
    block = min(c & -c, limit)
    if block < min(8, tu.next_power_of_2(c), limit):
        block = min(tu.next_power_of_2(c), limit)
    return block


class _Plan:
    """Windows, tiles and split of one call: see the module docstring."""

    def __init__(self, n: int, c: int, hw: int, groups: int, channels_last: bool, target: int, cap: int) -> None:
        self.hw = hw
        cg = c // groups
        gw = _groups_per_window(cg, groups, cap, 8 if channels_last else 1)
        self.fused = False
        if gw:  # fused plan: windows of whole groups, no split
            win = gw * cg
            block_c = tu.next_power_of_2(win)
            block_hw = min(tu.next_power_of_2(hw), max(1, cap // block_c))
            tiles, hw_blocks = n * triton.cdiv(c, win), triton.cdiv(hw, block_hw)
            self.fused = tiles >= target or hw_blocks <= _FUSED_MAX_HW_BLOCKS
            block_gw, split = gw, 1
        if not self.fused:
            win = block_c = _split_channels(c, hw, channels_last, cap)
            block_hw = min(tu.next_power_of_2(hw), max(1, cap // block_c))
            tiles, hw_blocks = n * triton.cdiv(c, win), triton.cdiv(hw, block_hw)
            split = max(1, min(hw_blocks, triton.cdiv(target, tiles)))
            block_gw = min(groups, (win - 1) // cg + 2)  # the most groups a window of `win` channels overlaps
        self.hw_per = triton.cdiv(hw_blocks, split) * block_hw
        self.split = triton.cdiv(hw, self.hw_per) if hw else 1
        self.grid = (tiles * self.split,)
        self.block_r = max(1, min(tu.next_power_of_2(n * self.split), cap // block_c))
        self.meta = dict(CL=channels_last, WIN=win, BLOCK_C=block_c, BLOCK_HW=block_hw,
                         BLOCK_GW=tu.next_power_of_2(block_gw), BLOCK_CG=min(tu.next_power_of_2(cg), cap),
                         num_warps=tu.num_warps_for(block_c * block_hw))


_cached_plan = functools.lru_cache(maxsize=256)(_Plan)


def _plan(x: torch.Tensor, groups: int, channels_last: bool) -> _Plan:
    """The plan of ``x``, cached: at the 8x8 UNet levels a call's host time is comparable to its GPU time."""
    n, c = x.shape[0], x.shape[1]
    return _cached_plan(n, c, x.numel() // max(1, n * c), groups, channels_last,
                        tu.num_programs_target(x, per_sm=PROGRAMS_PER_SM), tu.MAX_BLOCK)


def _fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], num_groups: int, eps: float,
         silu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, c = x.shape[0], x.shape[1]
    cl = _channels_last(x)
    x = _as_layout(x, cl)
    if use_triton(x):
        plan = _plan(x, num_groups, cl)
        y = torch.empty_like(x)
        mean = torch.empty((n, num_groups), device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        part = torch.empty((2, n * plan.split, c), device=x.device, dtype=torch.float32)
        args = (x, y, _ptr(weight, x), _ptr(bias, x), part, mean, rstd, c, plan.hw, num_groups, c // num_groups,
                plan.split, plan.hw_per, part[0].numel(), eps)
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu, STAGES=LOOP_STAGES, **plan.meta)
        if plan.fused:
            _gn_fwd_kernel[plan.grid](*args, STATS=True, APPLY=True, **flags)
        else:
            _gn_fwd_kernel[plan.grid](*args, STATS=True, APPLY=False, **flags)
            _gn_fwd_kernel[plan.grid](*args, STATS=False, APPLY=True, **flags)
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
        plan = _plan(x, num_groups, cl)
        dx = torch.empty_like(x)
        rows = n * plan.split
        part = torch.empty((2, rows, c), device=x.device, dtype=torch.float32)
        # Split plan: the normalize launch writes dweight/dbias; fused plan: a sum over the sample rows below.
        dwb = part if plan.fused else torch.empty((2, c), device=x.device, dtype=torch.float32)
        args = (dy, x, _ptr(weight, x), _ptr(bias, x), mean, rstd, dx, part, dwb, c, plan.hw, num_groups,
                c // num_groups, plan.split, plan.hw_per, rows * c, rows)
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu, BLOCK_R=plan.block_r,
                     STAGES=LOOP_STAGES, **plan.meta)
        if plan.fused:
            _gn_bwd_kernel[plan.grid](*args, STATS=True, APPLY=True, **flags)
            return dx, part.sum(1)
        _gn_bwd_kernel[plan.grid](*args, STATS=True, APPLY=False, **flags)
        _gn_bwd_kernel[plan.grid](*args, STATS=False, APPLY=True, **flags)
        return dx, dwb
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
