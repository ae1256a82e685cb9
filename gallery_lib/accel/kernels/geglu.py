"""Fused GEGLU gate: ``out = a * gelu(gate)`` with ``a, gate = h.chunk(2, dim=-1)`` (diffusers ``GEGLU``).

The projection producing ``h`` stays a cuBLAS matmul; this kernel replaces the chunk, the erf GELU and the product
(three reads and two intermediate tensors in eager PyTorch) by one read of ``h`` and one write of ``out``. Backward
recomputes GELU and its derivative from ``h``, writing ``dh`` in one pass.

The kernels are plain streaming passes over (rows x columns) tiles (one launch each way, ``3 * rows * d`` elements
forward, ``5 * rows * d`` backward); at SD shapes the old cost beyond that was the host: eager calls now skip the
``torch.library`` dispatcher and its generated autograd wrapper (see `_triton_utils.eager_mode`).
"""


from typing import Optional

import torch
import torch.nn.functional as F

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import device_function, kernel, library_op, tl, triton, use_triton

_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
# Launch plan: a program takes a (rows x columns) tile of TILE elements; its column block is the widest power of two
# up to MAX_COLS that divides the half-width, so no lane of a tile is masked off at SD's widths (1280 = 5 x 256). The
# old plan, one 1024-wide slice of one row per program, left 3/4 of every second program idle at 1280. Module-level
# so that benchmarks/sweep_kernel_plans.py can time alternatives; the values are its best plan
# (benchmarks/RESULTS.md#kernels).
TILE = 4096
MAX_COLS = 1024
WARPS = None  # None: from the tile size
# The forward's loads hint that h is read once and may leave L2 first (None: when h fits in L2). The backward never
# does: it measured slower with the hint at every SD shape.
FWD_EVICT_FIRST: Optional[bool] = None


@device_function
def _tile(R, D, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows, columns and mask. Tiles are numbered row-major, so consecutive programs walk memory in
    order rather than striding down one column block at a time."""
    n_col_blocks = tl.cdiv(D, BLOCK_C)
    pid = tl.program_id(0)
    rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    return rows.to(tl.int64), cols, mask


@kernel
def _geglu_fwd_kernel(H, OUT, R, D, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVICT: tl.constexpr):
    rows, cols, mask = _tile(R, D, BLOCK_R, BLOCK_C)
    h_offs = rows[:, None] * 2 * D + cols[None, :]
    a = tl.load(H + h_offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    gate = tl.load(H + h_offs + D, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    gelu = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    tl.store(OUT + rows[:, None] * D + cols[None, :], (a * gelu).to(OUT.dtype.element_ty), mask=mask)


@kernel
def _geglu_bwd_kernel(DOUT, H, DH, R, D, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, mask = _tile(R, D, BLOCK_R, BLOCK_C)
    h_offs = rows[:, None] * 2 * D + cols[None, :]
    a = tl.load(H + h_offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(H + h_offs + D, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    pdf = tl.exp(-0.5 * gate * gate) * 0.3989422804014327
    da = dout * gate * cdf
    dgate = dout * a * (cdf + gate * pdf)
    tl.store(DH + h_offs, da.to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + h_offs + D, dgate.to(DH.dtype.element_ty), mask=mask)


def _column_block(d: int) -> int:
    """The widest power of two <= MAX_COLS dividing ``d``; a masked power of two where only a narrow one divides."""
    cap = min(MAX_COLS, tu.MAX_BLOCK, tu.next_power_of_2(d))
    block = cap
    while block > 1 and d % block:
        block //= 2
    return block if block >= min(64, cap) else cap


def _launch(kernel_fn, rows: int, d: int, *args, **meta) -> None:
    block_c = _column_block(d)
    block_r = min(tu.next_power_of_2(rows), max(1, TILE // block_c))
    grid = (triton.cdiv(rows, block_r) * triton.cdiv(d, block_c),)
    kernel_fn[grid](*args, rows, d, BLOCK_R=block_r, BLOCK_C=block_c,
                    num_warps=WARPS or tu.num_warps_for(block_r * block_c), **meta)


def _fwd(h: torch.Tensor) -> torch.Tensor:
    h = h.contiguous()
    d = h.shape[-1] // 2
    if use_triton(h):
        out = h.new_empty((*h.shape[:-1], d))
        rows = h.numel() // max(2 * d, 1)
        if rows and d:
            _launch(_geglu_fwd_kernel, rows, d, h, out, EVICT=tu.streaming_eviction(h, FWD_EVICT_FIRST))
        return out
    a, gate = h.float().chunk(2, dim=-1)
    return (a * F.gelu(gate)).to(h.dtype)


@library_op("gallery::geglu_fwd")
def geglu_fwd(h: torch.Tensor) -> torch.Tensor:
    return _fwd(h)


@geglu_fwd.register_fake
def _(h):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


def _bwd(dout: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    h, dout = h.contiguous(), dout.contiguous()
    d = h.shape[-1] // 2
    if use_triton(h):
        dh = torch.empty_like(h)
        rows = h.numel() // max(2 * d, 1)
        if rows and d:
            _launch(_geglu_bwd_kernel, rows, d, dout, h, dh)
        return dh
    a, gate = h.float().chunk(2, dim=-1)
    dout = dout.float()
    cdf = 0.5 * (1.0 + torch.erf(gate * _SQRT1_2))
    pdf = torch.exp(-0.5 * gate * gate) * _INV_SQRT_2PI
    return torch.cat([dout * gate * cdf, dout * a * (cdf + gate * pdf)], dim=-1).to(h.dtype)


@library_op("gallery::geglu_bwd")
def geglu_bwd(dout: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return _bwd(dout, h)


@geglu_bwd.register_fake
def _(dout, h):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dout):
    (h,) = ctx.saved_tensors
    return geglu_bwd(dout, h)


geglu_fwd.register_autograd(_backward, setup_context=_setup_context)


class _GegluFunction(torch.autograd.Function):
    """Eager path: the same launchers without the dispatcher (see `_triton_utils.eager_mode`)."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return _fwd(h)

    @staticmethod
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        return _bwd(dout, h)


def geglu(h: torch.Tensor) -> torch.Tensor:
    """``a * gelu(gate)`` (exact erf GELU) where ``a, gate = h.chunk(2, dim=-1)``; the gate is the second half."""
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"geglu expects an even last dimension (the [a, gate] halves), got shape {tuple(h.shape)}")
    return _GegluFunction.apply(h) if tu.eager_mode() else geglu_fwd(h)
