"""AdamW and the EMA lerp in one pass over fp32 weights: ``AdamW(fused=True).step()`` then ``ema.lerp_(param, w)``.

Run apart, the two passes read each weight twice: torch's fused AdamW reads weight, gradient and both moments and
writes weight and moments; the EMA kernel (``ema_lerp.py``) reads the new weight and the average again and writes the
average. Here one kernel reads the five tensors once and writes four. It runs over pointer tables (``build_tables``,
addresses stored divided by 16 so the loads vectorize): the whole blocks of every tensor as a few persistent programs
per SM whose loop is pipelined, the next block's loads in flight during this one's math, and the tails (masked) in a
second launch. The gradients are read, not written: torch's kernel writes them back divided by ``grad_scale``, which
a loop that clears them after the step does not need.

The arithmetic is torch's fused AdamW's, term by term (``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ADAMW
mode), with the betas rounded as torch's kernel for the device rounds them (``torch_betas``), the bias corrections
in double precision from each tensor's own step count, and a step flagged in
``found_inf`` leaving the weights and moments as they were; the EMA lerp is ``torch.lerp``'s two-sided formula, towards
the new weights. The PyTorch path is torch's fused AdamW followed by ``ModelEma``'s own update
(``gallery_lib/accel/adamw_ema.py`` falls back to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels._triton_utils import device_function, kernel, tl

_ALIGN = 16  # bytes; addresses are stored divided by this, so Triton knows they allow 16-byte vector access
# Launch settings: the fastest of the probe's sweep on SD-1.5's UNet (benchmarks/RESULTS.md#adamw-ema).
BLOCK = 2048
PROGRAMS_PER_SM = 2
LOOP_STAGES = 2
NUM_WARPS = 4
ALIGNED_ROWS = True  # tell the compiler that the whole blocks' rows are 16-byte aligned


@dataclass(frozen=True)
class Hyper:
    """One parameter group's scalars for this step: torch's AdamW arguments but the betas (in the tables, read in
    double precision) and the EMA's weight ``1 - decay``."""

    lr: float
    eps: float
    weight_decay: float
    ema_weight: float


@device_function
def _corrections(step_ptr, betas, lr):
    """The step size and the square root of the second bias correction at the row's step count, from powers of the
    betas in double precision: in fp32, ``1 - 0.999 ** step`` would lose four digits at early steps."""
    step = tl.load(step_ptr).to(tl.float64)
    beta1 = tl.load(betas)
    beta2 = tl.load(betas + 1)
    bias_correction1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
    return (lr / bias_correction1).to(tl.float32), bias_correction2_sqrt.to(tl.float32)


@device_function
def _adamw_ema(p_ptr, g_ptr, m_ptr, v_ptr, e_ptr, step_ptr, offs, mask, betas, lr, eps, lr_decay, ema_weight,
               scale_ptr, found_inf_ptr, MASKED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
               SMALL_WEIGHT: tl.constexpr):
    if MASKED:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        e = tl.load(e_ptr + offs, mask=mask, other=0.0)
    else:
        p = tl.load(p_ptr + offs, cache_modifier=".cg")
        g = tl.load(g_ptr + offs, cache_modifier=".cg")
        m = tl.load(m_ptr + offs, cache_modifier=".cg")
        v = tl.load(v_ptr + offs, cache_modifier=".cg")
        e = tl.load(e_ptr + offs, cache_modifier=".cg")
    step_size, bias_correction2_sqrt = _corrections(step_ptr, betas, lr)
    beta1 = tl.load(betas)
    beta2 = tl.load(betas + 1)
    # 1 - beta in double from the table's betas (torch_betas)
    one_minus_beta1 = (1.0 - beta1).to(tl.float32)
    one_minus_beta2 = (1.0 - beta2).to(tl.float32)
    beta1 = beta1.to(tl.float32)
    beta2 = beta2.to(tl.float32)
    if HAS_SCALE:  # the folded clip factor (gallery_lib/accel/clipping.py), as torch's grad_scale
        g = g / tl.load(scale_ptr)
    p_new = p - lr_decay * p
    m_new = beta1 * m + one_minus_beta1 * g
    v_new = beta2 * v + one_minus_beta2 * g * g
    p_new = p_new - step_size * m_new / (tl.sqrt(v_new) / bias_correction2_sqrt + eps)
    if HAS_FOUND_INF:  # a flagged step leaves the weights and moments (GradScaler's and the non-finite guard's flag)
        skip = tl.load(found_inf_ptr) == 1.0
        p_new = tl.where(skip, p, p_new)
        m_new = tl.where(skip, m, m_new)
        v_new = tl.where(skip, v, v_new)
    if SMALL_WEIGHT:  # torch.lerp's two formulas, so the average matches ModelEma's other modes
        e = e + ema_weight * (p_new - e)
    else:
        e = p_new - (p_new - e) * (1.0 - ema_weight)
    if MASKED:
        tl.store(p_ptr + offs, p_new, mask=mask)
        tl.store(m_ptr + offs, m_new, mask=mask)
        tl.store(v_ptr + offs, v_new, mask=mask)
        tl.store(e_ptr + offs, e, mask=mask)
    else:
        tl.store(p_ptr + offs, p_new)
        tl.store(m_ptr + offs, m_new)
        tl.store(v_ptr + offs, v_new)
        tl.store(e_ptr + offs, e)


@device_function
def _row(addr, t, start, ALIGNED: tl.constexpr):
    row = (tl.load(addr + t) * 16).to(tl.pointer_type(tl.float32)) + start
    if ALIGNED:  # without the hint the compiler loses the alignment through the cast: 4-byte copies and stores
        row = tl.multiple_of(row, 16)
    return row


@device_function
def _step_of(steps, t):
    return tl.load(steps + t).to(tl.pointer_type(tl.float32))


@kernel
def _adamw_ema_blocks_kernel(P, G, M, V, E, steps, block_tensor, block_index, n_blocks, betas, lr, eps, lr_decay,
                             ema_weight, scale_ptr, found_inf_ptr, HAS_SCALE: tl.constexpr,
                             HAS_FOUND_INF: tl.constexpr, SMALL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                             STAGES: tl.constexpr, ALIGNED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for b in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
        t = tl.load(block_tensor + b)
        start = tl.load(block_index + b).to(tl.int64) * BLOCK
        _adamw_ema(_row(P, t, start, ALIGNED), _row(G, t, start, ALIGNED), _row(M, t, start, ALIGNED),
                   _row(V, t, start, ALIGNED), _row(E, t, start, ALIGNED), _step_of(steps, t), offs, offs < BLOCK,
                   betas, lr, eps, lr_decay, ema_weight, scale_ptr, found_inf_ptr, MASKED=False, HAS_SCALE=HAS_SCALE,
                   HAS_FOUND_INF=HAS_FOUND_INF, SMALL_WEIGHT=SMALL_WEIGHT)


@kernel
def _adamw_ema_tails_kernel(P, G, M, V, E, steps, tail_tensor, tail_start, numels, betas, lr, eps, lr_decay,
                            ema_weight, scale_ptr, found_inf_ptr, HAS_SCALE: tl.constexpr,
                            HAS_FOUND_INF: tl.constexpr, SMALL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.load(tail_tensor + tl.program_id(0))
    start = tl.load(tail_start + tl.program_id(0))
    offs = tl.arange(0, BLOCK)
    _adamw_ema(_row(P, t, start, False), _row(G, t, start, False), _row(M, t, start, False),
               _row(V, t, start, False), _row(E, t, start, False), _step_of(steps, t), offs,
               offs < tl.load(numels + t) - start, betas, lr, eps, lr_decay, ema_weight, scale_ptr, found_inf_ptr,
               MASKED=True, HAS_SCALE=HAS_SCALE, HAS_FOUND_INF=HAS_FOUND_INF, SMALL_WEIGHT=SMALL_WEIGHT)


def fusable(param: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the kernel can take ``param`` with its gradient, moments or average: fp32 tensors on one device, dense
    in one layout, 16-byte aligned."""
    return (param.numel() > 0 and tu.dense(param)
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32
                    and t.device == param.device and t.stride() == param.stride() and t.shape == param.shape
                    and t.data_ptr() % _ALIGN == 0 for t in (param, *others)))


@dataclass
class Tables:
    """Pointer tables of one parameter group's rows (param, grad, exp_avg, exp_avg_sq, ema) with their step counts:
    the whole blocks, the tails, and the group's betas. They keep every tensor they point to alive but the gradients,
    which the training loop frees after each step: ``point_to_grads`` gives them the next step's."""

    addresses: list[torch.Tensor]  # five int64 tables, one per tensor kind, addresses divided by 16
    steps: torch.Tensor  # int64 addresses of torch's 0-d fp32 step counts
    block_tensor: torch.Tensor
    block_index: torch.Tensor
    tail_tensor: torch.Tensor
    tail_start: torch.Tensor
    numels: torch.Tensor
    betas: torch.Tensor  # fp64 (beta1, beta2)
    kept: list[torch.Tensor]  # the params, moments, averages and step counts
    step_counts: list[torch.Tensor]

    @property
    def device(self) -> torch.device:
        return self.kept[0].device


def _addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Their addresses divided by 16, on ``device``, without waiting for it: a copy from pageable memory would make
    the host wait for every kernel queued before it."""
    table = torch.tensor([t.data_ptr() // _ALIGN for t in tensors], dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


def torch_betas(betas: tuple[float, float], device: torch.device) -> tuple[float, float]:
    """The betas as torch's fused AdamW on ``device`` uses them: its CUDA kernel rounds them to fp32 before it
    computes ``1 - beta`` (``1 - 0.999`` comes out 1.3e-5 smaller), its CPU kernel keeps them in double."""
    if device.type != "cuda":
        return tuple(betas)
    return tuple(torch.tensor(betas, dtype=torch.float32).tolist())


def build_tables(rows: list[tuple[torch.Tensor, ...]], steps: list[torch.Tensor], betas: tuple[float, float]) -> Tables:
    """The tables of ``rows`` (each ``fusable``) and their step-count tensors."""
    device = rows[0][0].device
    whole = [r[0].numel() // BLOCK for r in rows]
    tails = [(i, n * BLOCK) for i, n in enumerate(whole) if rows[i][0].numel() > n * BLOCK]

    def int64(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return Tables(
        addresses=[_addresses([r[k] for r in rows], device) for k in range(5)],
        steps=int64([s.data_ptr() for s in steps]),
        block_tensor=torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                             torch.tensor(whole)).to(device),
        block_index=torch.cat([torch.arange(n, dtype=torch.int32) for n in whole]).to(device),
        tail_tensor=torch.tensor([i for i, _ in tails], dtype=torch.int32, device=device),
        tail_start=int64([s for _, s in tails]),
        numels=int64([r[0].numel() for r in rows]),
        betas=torch.tensor(torch_betas(betas, device), dtype=torch.float64, device=device),
        kept=[t for r in rows for k, t in enumerate(r) if k != 1] + list(steps),
        step_counts=list(steps),
    )


def point_to_grads(tables: Tables, grads: list[torch.Tensor]) -> None:
    """Points the tables at this step's gradients (the same rows, each ``fusable`` with its param)."""
    tables.addresses[1] = _addresses(grads, tables.device)


def launch(tables: Tables, hyper: Hyper, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
    """One AdamW step and EMA update of every row of ``tables``. As in torch's AdamW, the caller advances the step
    counts before (and takes a flagged step back after)."""
    first = tables.kept[0]
    flags = dict(HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                 SMALL_WEIGHT=abs(hyper.ema_weight) < 0.5, BLOCK=BLOCK, num_warps=NUM_WARPS)
    scalars = (tables.betas, hyper.lr, hyper.eps, hyper.lr * hyper.weight_decay, hyper.ema_weight,
               first if grad_scale is None else grad_scale, first if found_inf is None else found_inf)  # unread
    n_blocks = tables.block_index.numel()
    if n_blocks:
        # on the interpreter 3 programs, so that each loops over several blocks as on a GPU
        programs = tu.sm_count(first.device) * PROGRAMS_PER_SM if first.is_cuda else 3
        _adamw_ema_blocks_kernel[(min(n_blocks, programs),)](
            *tables.addresses, tables.steps, tables.block_tensor, tables.block_index, n_blocks, *scalars,
            STAGES=LOOP_STAGES, ALIGNED=ALIGNED_ROWS, **flags)
    if tables.tail_tensor.numel():
        _adamw_ema_tails_kernel[(tables.tail_tensor.numel(),)](
            *tables.addresses, tables.steps, tables.tail_tensor, tables.tail_start, tables.numels, *scalars, **flags)
