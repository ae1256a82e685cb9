"""The fused EMA update: ``ema[i].lerp_(model[i], weight)`` for every averaged tensor in one Triton launch.

One kernel over every tensor through a pointer table (``build_tables``), computing the lerp in fp32 registers and
writing the EMA once: 3 passes over the bytes (read EMA, read param, write EMA), the minimum for a separate EMA pass;
bf16/fp16 tensors are read and written at their own width. ``launch_fused(..., programs=N)`` runs it as N persistent
programs, so that it sips bandwidth beside the next forward on a side stream (``ModelEma``'s ``stream`` mode).
``foreach_lerp_`` is the PyTorch reference (and takes the tensors the kernel cannot: strided, in two different
layouts, misaligned).
"""

from __future__ import annotations

import torch

from gallery_lib.accel.kernels._triton_utils import dense, has_triton, tl, triton

_ALIGN = 16  # bytes; addresses are stored divided by this so Triton knows they allow 16-byte vector access
_BLOCK = 4096  # elements per program (benchmarks/RESULTS.md#ema)
_NUM_WARPS = 8


def _by_dtype(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[torch.dtype, tuple[list, list]]:
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for x, y in zip(a, b):
        ga, gb = groups.setdefault(x.dtype, ([], []))
        ga.append(x)
        gb.append(y)
    return groups


def foreach_lerp_(ema: list[torch.Tensor], model: list[torch.Tensor], weight: float) -> None:
    """The reference: ``ema[i].lerp_(model[i], weight)`` with one multi-tensor kernel per dtype."""
    for e, m in _by_dtype(ema, model).values():  # _foreach_lerp_ needs one dtype per call
        torch._foreach_lerp_(e, m, weight)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


if has_triton:

    @triton.jit
    def _ema_lerp_kernel(model_addr, ema_addr, numels, block_tensor, block_index, n_blocks, weight,
                         MODEL_T: tl.constexpr, EMA_T: tl.constexpr, SMALL_WEIGHT: tl.constexpr,
                         BLOCK: tl.constexpr):
        # Each block of the table names a tensor and a block index inside it. The addresses are stored divided
        # by 16 and the starts are multiples of BLOCK, so the compiler can emit 16-byte vector loads and stores.
        for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            t = tl.load(block_tensor + b)
            start = tl.load(block_index + b).to(tl.int64) * BLOCK
            n = tl.load(numels + t)
            m_ptr = (tl.load(model_addr + t) * 16).to(tl.pointer_type(MODEL_T)) + start
            e_ptr = (tl.load(ema_addr + t) * 16).to(tl.pointer_type(EMA_T)) + start
            offs = tl.arange(0, BLOCK)
            if start + BLOCK <= n:
                m = tl.load(m_ptr + offs, cache_modifier=".cg").to(tl.float32)
                e = tl.load(e_ptr + offs, cache_modifier=".cg").to(tl.float32)
            else:
                mask = offs < n - start
                m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                e = tl.load(e_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # the same two-sided formula as torch.lerp, so results match the foreach/loop modes
            if SMALL_WEIGHT:
                out = e + weight * (m - e)
            else:
                out = m - (m - e) * (1.0 - weight)
            if start + BLOCK <= n:
                tl.store(e_ptr + offs, out.to(EMA_T))
            else:
                tl.store(e_ptr + offs, out.to(EMA_T), mask=offs < n - start)

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _fusable(e: torch.Tensor, m: torch.Tensor) -> bool:
    """Whether the kernel, which reads both tensors as flat memory, can take the pair: dense, in the same layout
    (a channels_last conv weight and its EMA copy), aligned and of a dtype it knows."""
    return (e.dtype in _TL_DTYPES and m.dtype in _TL_DTYPES and e.device == m.device and dense(e)
            and e.stride() == m.stride() and e.data_ptr() % _ALIGN == 0 and m.data_ptr() % _ALIGN == 0)


def build_tables(ema: list[torch.Tensor], model: list[torch.Tensor]) -> tuple[list[dict], list, list]:
    """Groups tensor pairs by dtype into pointer tables; tensors the kernel cannot take go to a foreach rest."""
    groups: dict[tuple, list] = {}
    rest_e, rest_m = [], []
    for e, m in zip(ema, model):
        ok = _fusable(e, m)
        if e.numel() == 0:
            continue
        if ok:
            groups.setdefault((m.dtype, e.dtype), []).append((e, m))
        else:
            rest_e.append(e)
            rest_m.append(m)
    tables = []
    for (m_dtype, e_dtype), pairs in groups.items():
        device = pairs[0][0].device
        n_blocks = [triton.cdiv(e.numel(), _BLOCK) for e, _ in pairs]
        block_tensor = torch.repeat_interleave(torch.arange(len(pairs), dtype=torch.int32), torch.tensor(n_blocks))
        block_index = torch.cat([torch.arange(n, dtype=torch.int32) for n in n_blocks])
        as_i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        tables.append({
            "model_addr": as_i64([m.data_ptr() // _ALIGN for _, m in pairs]),
            "ema_addr": as_i64([e.data_ptr() // _ALIGN for e, _ in pairs]),
            "numels": as_i64([e.numel() for e, _ in pairs]),
            "block_tensor": block_tensor.to(device),
            "block_index": block_index.to(device),
            "n_blocks": int(block_tensor.numel()),
            "model_t": _TL_DTYPES[m_dtype],
            "ema_t": _TL_DTYPES[e_dtype],
            "tensors": pairs,  # keeps the tensors alive while their addresses are in the table
        })
    return tables, rest_e, rest_m


def launch_fused(table: dict, weight: float, programs: int | None) -> None:
    n = table["n_blocks"]
    grid = (n if programs is None else max(1, min(n, programs)),)
    _ema_lerp_kernel[grid](table["model_addr"], table["ema_addr"], table["numels"], table["block_tensor"],
                           table["block_index"], n, weight, MODEL_T=table["model_t"], EMA_T=table["ema_t"],
                           SMALL_WEIGHT=abs(weight) < 0.5, BLOCK=_BLOCK, num_warps=_NUM_WARPS)


def fused_lerp_(ema: list[torch.Tensor], model: list[torch.Tensor], weight: float,
                programs: int | None = None) -> None:
    """``ema[i].lerp_(model[i], weight)`` for all i with one Triton launch per dtype pair (needs Triton)."""
    if not has_triton:
        raise RuntimeError("fused_lerp_ needs Triton: pip install triton (or use mode='foreach')")
    tables, rest_e, rest_m = build_tables(ema, model)
    for table in tables:
        launch_fused(table, weight, programs)
    foreach_lerp_(rest_e, rest_m, weight)
