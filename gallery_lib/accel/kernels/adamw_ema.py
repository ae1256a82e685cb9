"""AdamW and the EMA of its result in one pass over the bytes (``gallery_lib.accel.optim.AdamWWithEma``'s kernel).

``torch.optim.AdamW(fused=True)`` followed by a separate EMA pass reads every weight twice: once to update it and
once more to average it. This kernel reads each parameter, gradient, moment and EMA element once, applies the math
of PyTorch's fused AdamW in fp32 registers (decoupled weight decay, bias corrections from each tensor's own step
count), and writes the weight, both moments and ``ema.lerp_(new weight, ema_weight)``: 9 passes instead of 10, and one
launch per dtype pair instead of two kernels. Like the fused AdamW, a set ``found_inf`` flag skips the update (the
EMA still moves towards the unchanged weight, as ``ModelEma`` does after a skipped step).

The tables (``build_tables``) follow ``ema_lerp.py``: one row per tensor, one per ``BLOCK`` elements, addresses stored
divided by 16 so the loads vectorize. Tensors may be contiguous or channels_last: all five of a row share the
parameter's strides and are dense, so one flat index walks them together. The reference the tests hold it to is
PyTorch's own: ``torch.optim.AdamW`` then ``torch.lerp``.
"""

from __future__ import annotations

import math

import torch

from gallery_lib.accel.kernels._triton_utils import has_triton, tl, triton

_ALIGN = 16  # bytes; see ema_lerp.py
_BLOCK = 2048  # elements per program: five fp32 streams held in registers (benchmarks/RESULTS.md#ema)
_NUM_WARPS = 8


if has_triton:

    @triton.jit
    def _load(ptr, offs, mask, MASKED: tl.constexpr):
        # Unmasked loads and stores of whole blocks vectorize (16 bytes); a mask split them into single words.
        if MASKED:
            x = tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            x = tl.load(ptr + offs, cache_modifier=".cg")
        return x.to(tl.float32)

    @triton.jit
    def _store(ptr, offs, x, mask, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ptr + offs, x.to(ptr.dtype.element_ty))

    @triton.jit
    def _adamw_ema_block(p_ptr, g_ptr, m_ptr, v_ptr, e_ptr, offs, mask, skip, step, lr, beta1, beta2, log2_beta1,
                         log2_beta2, eps, weight_decay, ema_weight, MASKED: tl.constexpr):
        p = _load(p_ptr, offs, mask, MASKED)
        e = _load(e_ptr, offs, mask, MASKED)
        if not skip:
            g = _load(g_ptr, offs, mask, MASKED)
            m = _load(m_ptr, offs, mask, MASKED)
            v = _load(v_ptr, offs, mask, MASKED)
            # PyTorch's fused AdamW, term by term (aten/src/ATen/native/cuda/fused_adam_utils.cuh)
            p = p - lr * weight_decay * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
            bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
            p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
            p = p.to(p_ptr.dtype.element_ty)  # the EMA averages the weight as stored
            _store(p_ptr, offs, p, mask, MASKED)
            _store(m_ptr, offs, m, mask, MASKED)
            _store(v_ptr, offs, v, mask, MASKED)
            p = p.to(tl.float32)
        if ema_weight < 0.5:  # torch.lerp's two-sided formula, so results match the other EMA modes
            e = e + ema_weight * (p - e)
        else:
            e = p - (p - e) * (1.0 - ema_weight)
        _store(e_ptr, offs, e, mask, MASKED)

    @triton.jit
    def _adamw_ema_kernel(param_addr, grad_addr, exp_avg_addr, exp_avg_sq_addr, ema_addr, step_addr, numels,
                          block_tensor, block_index, n_blocks, found_inf_ptr, lr, beta1, beta2, log2_beta1,
                          log2_beta2, eps, weight_decay, ema_weight, PARAM_T: tl.constexpr, EMA_T: tl.constexpr,
                          HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
        skip = False
        if HAS_FOUND_INF:
            skip = tl.load(found_inf_ptr) != 0.0
        for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            t = tl.load(block_tensor + b)
            start = tl.load(block_index + b).to(tl.int64) * BLOCK
            n = tl.load(numels + t)
            p_ptr = (tl.load(param_addr + t) * 16).to(tl.pointer_type(PARAM_T)) + start
            g_ptr = (tl.load(grad_addr + t) * 16).to(tl.pointer_type(PARAM_T)) + start
            m_ptr = (tl.load(exp_avg_addr + t) * 16).to(tl.pointer_type(PARAM_T)) + start
            v_ptr = (tl.load(exp_avg_sq_addr + t) * 16).to(tl.pointer_type(PARAM_T)) + start
            e_ptr = (tl.load(ema_addr + t) * 16).to(tl.pointer_type(EMA_T)) + start
            step = tl.load(tl.load(step_addr + t).to(tl.pointer_type(tl.float32)))
            offs = tl.arange(0, BLOCK)
            mask = offs < n - start
            if start + BLOCK <= n:
                _adamw_ema_block(p_ptr, g_ptr, m_ptr, v_ptr, e_ptr, offs, mask, skip, step, lr, beta1, beta2,
                                 log2_beta1, log2_beta2, eps, weight_decay, ema_weight, MASKED=False)
            else:
                _adamw_ema_block(p_ptr, g_ptr, m_ptr, v_ptr, e_ptr, offs, mask, skip, step, lr, beta1, beta2,
                                 log2_beta1, log2_beta2, eps, weight_decay, ema_weight, MASKED=True)

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
else:
    _TL_DTYPES = {}


def _dense_layout(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def fusable(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            ema: torch.Tensor) -> bool:
    """Whether the kernel can take this parameter: real dtypes it knows, one device, the same dense layout for the
    four tensors of the parameter's dtype, 16-byte aligned starts."""
    same = (grad, exp_avg, exp_avg_sq)
    return (param.dtype in _TL_DTYPES and ema.dtype in _TL_DTYPES and not grad.is_sparse
            and all(t.dtype == param.dtype and t.stride() == param.stride() for t in same)
            and ema.stride() == param.stride() and _dense_layout(param)
            and all(t.device == param.device and t.data_ptr() % _ALIGN == 0 for t in (param, ema, *same)))


def build_tables(rows: list[tuple[torch.Tensor, ...]]) -> list[dict]:
    """Pointer tables for ``(param, grad, exp_avg, exp_avg_sq, ema, step)`` rows that are all ``fusable``, one per
    (parameter dtype, EMA dtype) pair."""
    groups: dict[tuple, list] = {}
    for row in rows:
        if row[0].numel():
            groups.setdefault((row[0].dtype, row[4].dtype), []).append(row)
    tables = []
    for (param_dtype, ema_dtype), group in groups.items():
        device = group[0][0].device
        n_blocks = [triton.cdiv(row[0].numel(), _BLOCK) for row in group]
        block_tensor = torch.repeat_interleave(torch.arange(len(group), dtype=torch.int32), torch.tensor(n_blocks))
        block_index = torch.cat([torch.arange(n, dtype=torch.int32) for n in n_blocks])
        as_i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        tables.append({
            **{name: as_i64([row[i].data_ptr() // _ALIGN for row in group])
               for i, name in enumerate(("param_addr", "grad_addr", "exp_avg_addr", "exp_avg_sq_addr", "ema_addr"))},
            "step_addr": as_i64([row[5].data_ptr() for row in group]),
            "numels": as_i64([row[0].numel() for row in group]),
            "block_tensor": block_tensor.to(device),
            "block_index": block_index.to(device),
            "n_blocks": int(block_tensor.numel()),
            "param_t": _TL_DTYPES[param_dtype],
            "ema_t": _TL_DTYPES[ema_dtype],
            "tensors": group,  # keeps the tensors alive while their addresses are in the table
        })
    return tables


def launch(table: dict, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           ema_weight: float, found_inf: torch.Tensor | None) -> None:
    """One AdamW + EMA step over a table's tensors; their step counts must already count this step."""
    n = table["n_blocks"]
    _adamw_ema_kernel[(n,)](
        table["param_addr"], table["grad_addr"], table["exp_avg_addr"], table["exp_avg_sq_addr"], table["ema_addr"],
        table["step_addr"], table["numels"], table["block_tensor"], table["block_index"], n,
        found_inf if found_inf is not None else table["numels"], lr, beta1, beta2, math.log2(beta1),
        math.log2(beta2), eps, weight_decay, ema_weight, PARAM_T=table["param_t"], EMA_T=table["ema_t"],
        HAS_FOUND_INF=found_inf is not None, BLOCK=_BLOCK, num_warps=_NUM_WARPS)

