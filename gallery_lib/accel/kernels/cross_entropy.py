"""Fused softmax cross-entropy with soft targets (timm Mixup/CutMix output) and label smoothing, mean over rows.

Per row, one pass over the logits computes the log-sum-exp (online max and sum) together with the target sums,
so the loss is ``lse * sum(t') - sum(t' * x)`` with ``t' = (1 - eps) * t + eps / V``. Only the per-row lse and
target mass are saved; backward recomputes the probabilities from them in a single pass, so no second
(N, V) probability tensor is ever stored. Matches ``F.cross_entropy(x, t, label_smoothing=eps)`` with probability
targets, including the gradient with respect to the targets.

Launches (the whole cost at ImageNet shapes: a 128x1000 bf16 batch is 256 KiB): the forward is a zero-fill of
a 4-byte counter plus one kernel, one program per row; each program stores its row loss and bumps the counter,
and the program that finishes last sums the row losses in row order (deterministic) and writes the mean, in the
logits dtype. The old version ran the kernel, then ``sum``, ``/ n`` and ``.to(dtype)`` as three more launches.
Backward is one kernel that reads the upstream gradient from device memory (no host sync). Eager calls skip the
``torch.library`` dispatcher (see `_triton_utils.eager_mode`), and backward no longer receives (and zero-fills)
gradients for the saved per-row statistics.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import kernel, library_op, tl, use_triton

# Warps per row program (None: from the row block). Module-level so that benchmarks/sweep_kernel_plans.py can time
# alternatives; the values are its winners (benchmarks/RESULTS.md#kernels).
FWD_WARPS: Optional[int] = None
BWD_WARPS: Optional[int] = 8


@kernel
def _ce_fwd_kernel(X, T, LOSS, ROWS, LSE, TSUM, COUNTER, N, V, smoothing, BLOCK: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK)
    # Finite "minus infinity" (-3e38) keeps exp(m_old - m_new) free of inf - inf on masked lanes.
    m = tl.full([BLOCK], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    sum_t = tl.zeros([BLOCK], dtype=tl.float32)
    sum_tx = tl.zeros([BLOCK], dtype=tl.float32)
    sum_x = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        mask = v0 + cols < V
        x = tl.load(X + base + v0 + cols, mask=mask, other=-3.0e38).to(tl.float32)
        t = tl.load(T + base + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.where(mask, tl.exp(x - m_new), 0.0)
        m = m_new
        x = tl.where(mask, x, 0.0)
        sum_t += t
        sum_tx += t * x
        sum_x += x
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
    t_mass = (1.0 - smoothing) * tl.sum(sum_t, axis=0) + smoothing
    loss = lse * t_mass - (1.0 - smoothing) * tl.sum(sum_tx, axis=0) - smoothing / V * tl.sum(sum_x, axis=0)
    tl.store(ROWS + row, loss)
    tl.store(LSE + row, lse)
    tl.store(TSUM + row, t_mass)
    # acq_rel: the row stores above are visible to whichever program sees the final count.
    done = tl.atomic_add(COUNTER, 1, sem="acq_rel")
    if done == N - 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, N, BLOCK_N):
            r = r0 + tl.arange(0, BLOCK_N)
            acc += tl.load(ROWS + r, mask=r < N, other=0.0, cache_modifier=".cg")
        tl.store(LOSS, (tl.sum(acc, axis=0) / N).to(LOSS.dtype.element_ty))


@kernel
def _ce_bwd_kernel(GRAD, X, T, LSE, TSUM, DX, DT, V, smoothing, inv_n,
                   TARGET_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK)
    scale = tl.load(GRAD).to(tl.float32) * inv_n
    lse = tl.load(LSE + row)
    t_mass = tl.load(TSUM + row)
    for v0 in range(0, V, BLOCK):
        mask = v0 + cols < V
        x = tl.load(X + base + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(T + base + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        dx = scale * (p * t_mass - (1.0 - smoothing) * t - smoothing / V)
        tl.store(DX + base + v0 + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if TARGET_GRAD:
            dt = scale * (1.0 - smoothing) * (lse - x)
            tl.store(DT + base + v0 + cols, dt.to(DT.dtype.element_ty), mask=mask)


def _fwd(logits: torch.Tensor, target: torch.Tensor,
         label_smoothing: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, target = logits.contiguous(), target.contiguous()
    n, v = logits.shape
    if use_triton(logits):
        loss = logits.new_empty(())
        loss_rows = torch.empty(n, device=logits.device, dtype=torch.float32)
        lse = torch.empty_like(loss_rows)
        t_mass = torch.empty_like(loss_rows)
        counter = torch.zeros(1, device=logits.device, dtype=torch.int32)
        block = tu.reduction_block(v)
        _ce_fwd_kernel[(n,)](logits, target, loss, loss_rows, lse, t_mass, counter, n, v, label_smoothing,
                             BLOCK=block, BLOCK_N=min(tu.next_power_of_2(n), 1024),
                             num_warps=FWD_WARPS or tu.num_warps_for(block))
        return loss, lse, t_mass
    x, t = logits.float(), target.float()
    lse = torch.logsumexp(x, dim=-1)
    t_mass = (1.0 - label_smoothing) * t.sum(-1) + label_smoothing
    loss_rows = lse * t_mass - (1.0 - label_smoothing) * (t * x).sum(-1) - label_smoothing / v * x.sum(-1)
    return (loss_rows.sum() / n).to(logits.dtype), lse, t_mass


@library_op("gallery::soft_cross_entropy_fwd")
def soft_cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor,
                           label_smoothing: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd(logits, target, label_smoothing)


@soft_cross_entropy_fwd.register_fake
def _(logits, target, label_smoothing):
    rows = logits.new_empty((logits.shape[0],), dtype=torch.float32)
    return logits.new_empty(()), rows, torch.empty_like(rows)


def _bwd(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, t_mass: torch.Tensor,
         label_smoothing: float, target_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    logits, target = logits.contiguous(), target.contiguous()
    n, v = logits.shape
    if use_triton(logits):
        dx = torch.empty_like(logits)
        dt = torch.empty_like(target) if target_grad else target.new_empty((0,))
        block = tu.reduction_block(v)
        _ce_bwd_kernel[(n,)](grad, logits, target, lse, t_mass, dx, dt, v, label_smoothing, 1.0 / n,
                             TARGET_GRAD=target_grad, BLOCK=block, num_warps=BWD_WARPS or tu.num_warps_for(block))
        return dx, dt
    x, t = logits.float(), target.float()
    scale = grad.float() / n
    p = torch.exp(x - lse[:, None])
    dx = scale * (p * t_mass[:, None] - (1.0 - label_smoothing) * t - label_smoothing / v)
    if target_grad:
        dt = (scale * (1.0 - label_smoothing) * (lse[:, None] - x)).to(target.dtype)
    else:
        dt = target.new_empty((0,))
    return dx.to(logits.dtype), dt


@library_op("gallery::soft_cross_entropy_bwd")
def soft_cross_entropy_bwd(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           t_mass: torch.Tensor, label_smoothing: float,
                           target_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _bwd(grad, logits, target, lse, t_mass, label_smoothing, target_grad)


@soft_cross_entropy_bwd.register_fake
def _(grad, logits, target, lse, t_mass, label_smoothing, target_grad):
    dt = torch.empty_like(target, memory_format=torch.contiguous_format) if target_grad else target.new_empty((0,))
    return torch.empty_like(logits, memory_format=torch.contiguous_format), dt


def _setup_context(ctx, inputs, output):
    logits, target, label_smoothing = inputs
    _loss, lse, t_mass = output
    ctx.save_for_backward(logits, target, lse, t_mass)
    ctx.label_smoothing = label_smoothing


def _backward(ctx, grad, _dlse, _dtmass):
    logits, target, lse, t_mass = ctx.saved_tensors
    target_grad = bool(ctx.needs_input_grad[1])
    dx, dt = soft_cross_entropy_bwd(grad, logits, target, lse, t_mass, ctx.label_smoothing, target_grad)
    return dx, (dt if target_grad else None), None


soft_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


class _SoftCrossEntropyFunction(torch.autograd.Function):
    """Eager path: the same launchers without the dispatcher (see `_triton_utils.eager_mode`)."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing):
        loss, lse, t_mass = _fwd(logits, target, label_smoothing)
        ctx.save_for_backward(logits, target, lse, t_mass)
        ctx.label_smoothing = label_smoothing
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse, t_mass = ctx.saved_tensors
        target_grad = bool(ctx.needs_input_grad[1])
        dx, dt = _bwd(grad, logits, target, lse, t_mass, ctx.label_smoothing, target_grad)
        return dx, (dt if target_grad else None), None


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (N, V) against probability ``target`` (N, V), with label smoothing.

    Integer class targets of shape (N,) are accepted and one-hot encoded. Equals
    ``F.cross_entropy(logits, target, label_smoothing=label_smoothing)`` (and timm's ``SoftTargetCrossEntropy``
    when ``label_smoothing=0``, Mixup having smoothed the targets already).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V); flatten extra dims first, got shape {tuple(logits.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not target.is_floating_point():
        if target.shape != logits.shape[:1]:
            raise ValueError(f"class targets must have shape ({logits.shape[0]},), got {tuple(target.shape)}")
        target = F.one_hot(target, logits.shape[1]).to(logits.dtype)
    if target.shape != logits.shape:
        raise ValueError(f"soft targets must match logits {tuple(logits.shape)}, got {tuple(target.shape)}")
    if tu.eager_mode():
        return _SoftCrossEntropyFunction.apply(logits, target, float(label_smoothing))
    loss, _, _ = soft_cross_entropy_fwd(logits, target, float(label_smoothing))
    return loss
