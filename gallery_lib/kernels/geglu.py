"""Fused GEGLU gate: ``out = a * gelu(gate)`` with ``a, gate = h.chunk(2, dim=-1)`` (diffusers ``GEGLU``).

The projection producing ``h`` stays a cuBLAS matmul; this kernel replaces the chunk, the erf GELU and the product
(three reads and two intermediate tensors in eager PyTorch) by one read of ``h`` and one write of ``out``. Backward
recomputes GELU and its derivative from ``h``, writing ``dh`` in one pass.

The kernels are plain streaming passes (one launch each way, ``3 * rows * d`` elements forward, ``5 * rows * d``
backward); at SD shapes the old cost beyond that was the host: eager calls now skip the ``torch.library``
dispatcher and its generated autograd wrapper (see `_triton_utils.eager_mode`).
"""


import torch
import torch.nn.functional as F

from gallery_lib.kernels import _triton_utils as tu
from gallery_lib.kernels._triton_utils import kernel, library_op, tl, triton, use_triton

_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
# Columns per program: a 1024-wide slice of one row keeps 4-8 warps busy with 16 B loads.
_BLOCK = 1024


@kernel
def _geglu_fwd_kernel(H, OUT, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    a = tl.load(H + row * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(H + row * 2 * D + D + cols, mask=mask, other=0.0).to(tl.float32)
    gelu = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    tl.store(OUT + row * D + cols, (a * gelu).to(OUT.dtype.element_ty), mask=mask)


@kernel
def _geglu_bwd_kernel(DOUT, H, DH, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    a = tl.load(H + row * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(H + row * 2 * D + D + cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    pdf = tl.exp(-0.5 * gate * gate) * 0.3989422804014327
    da = dout * gate * cdf
    dgate = dout * a * (cdf + gate * pdf)
    tl.store(DH + row * 2 * D + cols, da.to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + row * 2 * D + D + cols, dgate.to(DH.dtype.element_ty), mask=mask)


def _grid(rows: int, d: int) -> tuple[int, int, int]:
    block = min(_BLOCK, tu.next_power_of_2(d), tu.MAX_BLOCK)
    return rows, triton.cdiv(d, block), block


def _fwd(h: torch.Tensor) -> torch.Tensor:
    h = h.contiguous()
    d = h.shape[-1] // 2
    if use_triton(h):
        out = h.new_empty((*h.shape[:-1], d))
        rows, col_blocks, block = _grid(h.numel() // max(2 * d, 1), d)
        if rows and d:
            _geglu_fwd_kernel[(rows, col_blocks)](h, out, d, BLOCK=block, num_warps=tu.num_warps_for(block))
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
        rows, col_blocks, block = _grid(h.numel() // max(2 * d, 1), d)
        if rows and d:
            _geglu_bwd_kernel[(rows, col_blocks)](dout, h, dh, d, BLOCK=block, num_warps=tu.num_warps_for(block))
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
