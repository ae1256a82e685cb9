"""AdamW and the EMA in one pass over the weights, as persistent pipelined programs: a prototype against the recipe's
two passes, on the SD-1.5 UNet's parameters (one CUDA GPU; correctness alone on a CPU under ``TRITON_INTERPRET=1``).

The recipes update the weights with ``torch.optim.AdamW(fused=True)`` (the clip factor as its ``grad_scale`` where the
clipping is folded in, which writes the clipped gradients back) and then the EMA with the fused lerp kernel
(``gallery_lib.accel.kernels.ema_lerp``). A one-pass kernel (d8ad218, reverted) read each byte once but ran at about
half the memory speed, one program per block: each program waits on its table lookups before its loads. Here the
full blocks run as a few persistent programs per SM whose loop is pipelined (``tl.range(..., num_stages=...)``), the
next block's lookups and loads in flight during this one's math, and the tails of the tensors (masked) in a second
launch. Whether the clipped gradients are written back is a switch: a training loop that drops them after the step
does not need them. All rows share one step count (every parameter of these runs steps together); a library kernel
would read each parameter's own, as torch's does.

For each setting it times one update of the UNet's 860M fp32 parameters (CUDA events, median of 20 after 3 warm-up
updates, p20/p80) and checks the weights, both moments and the EMA against the recipe's two passes.

    python benchmarks/probe_adamw_ema.py --out $OUT/probe_adamw_ema.json
    TRITON_INTERPRET=1 python benchmarks/probe_adamw_ema.py --check-only   # small shapes on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
from gpu_timing import event_ms

from gallery_lib.accel.kernels._triton_utils import tl, triton
from gallery_lib.accel.kernels.ema_lerp import build_tables, foreach_lerp_, launch_fused
from gallery_lib.reports.provenance import result_header

_ALIGN = 16
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
EMA_WEIGHT = 1 - 0.9999


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, e_ptr, offs, mask, inv_scale, step, lr, beta1, beta2, eps, weight_decay,
            ema_weight, MASKED: tl.constexpr, WRITE_GRAD: tl.constexpr):
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
    g = g * inv_scale
    # torch's fused AdamW term by term (aten/src/ATen/native/cuda/fused_adam_utils.cuh, ADAMW mode)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias_correction1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
    p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    e = e + ema_weight * (p - e)  # torch.lerp for a weight below 0.5
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(e_ptr + offs, e, mask=mask)
        if WRITE_GRAD:
            tl.store(g_ptr + offs, g, mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        tl.store(e_ptr + offs, e)
        if WRITE_GRAD:
            tl.store(g_ptr + offs, g)


@triton.jit
def _block_pointers(addr, t, start):
    return (tl.load(addr + t) * 16).to(tl.pointer_type(tl.float32)) + start


@triton.jit
def _full_blocks_kernel(P, G, M, V, E, block_tensor, block_index, n_blocks, scale_ptr, step_ptr, lr, beta1, beta2,
                        eps, weight_decay, ema_weight, HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr,
                        BLOCK: tl.constexpr, STAGES: tl.constexpr):
    inv_scale = 1.0
    if HAS_SCALE:
        inv_scale = 1.0 / tl.load(scale_ptr)
    step = tl.load(step_ptr)
    offs = tl.arange(0, BLOCK)
    for b in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
        t = tl.load(block_tensor + b)
        start = tl.load(block_index + b).to(tl.int64) * BLOCK
        _update(_block_pointers(P, t, start), _block_pointers(G, t, start), _block_pointers(M, t, start),
                _block_pointers(V, t, start), _block_pointers(E, t, start), offs, offs < BLOCK, inv_scale, step, lr,
                beta1, beta2, eps, weight_decay, ema_weight, MASKED=False, WRITE_GRAD=WRITE_GRAD)


@triton.jit
def _tail_blocks_kernel(P, G, M, V, E, tail_tensor, tail_start, numels, scale_ptr, step_ptr, lr, beta1, beta2, eps,
                        weight_decay, ema_weight, HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    inv_scale = 1.0
    if HAS_SCALE:
        inv_scale = 1.0 / tl.load(scale_ptr)
    t = tl.load(tail_tensor + tl.program_id(0))
    start = tl.load(tail_start + tl.program_id(0))
    offs = tl.arange(0, BLOCK)
    _update(_block_pointers(P, t, start), _block_pointers(G, t, start), _block_pointers(M, t, start),
            _block_pointers(V, t, start), _block_pointers(E, t, start), offs, offs < tl.load(numels + t) - start,
            inv_scale, tl.load(step_ptr), lr, beta1, beta2, eps, weight_decay, ema_weight, MASKED=True,
            WRITE_GRAD=WRITE_GRAD)


class OnePass:
    """Pointer tables of (param, grad, exp_avg, exp_avg_sq, ema) fp32 rows sharing one step count."""

    def __init__(self, rows, block: int):
        device = rows[0][0].device
        self.block = block
        full = [t.numel() // block for t, *_ in rows]
        self.block_tensor = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                                    torch.tensor(full)).to(device)
        self.block_index = torch.cat([torch.arange(n, dtype=torch.int32) for n in full]).to(device)
        tails = [(i, n * block) for i, n in enumerate(full) if rows[i][0].numel() > n * block]
        self.tail_tensor = torch.tensor([i for i, _ in tails], dtype=torch.int32, device=device)
        self.tail_start = torch.tensor([s for _, s in tails], dtype=torch.int64, device=device)
        self.numels = torch.tensor([t.numel() for t, *_ in rows], dtype=torch.int64, device=device)
        self.addr = [torch.tensor([r[k].data_ptr() // _ALIGN for r in rows], dtype=torch.int64, device=device)
                     for k in range(5)]
        assert all(r[k].data_ptr() % _ALIGN == 0 for r in rows for k in range(5))
        self.rows = rows

    def step(self, step: torch.Tensor, scale: torch.Tensor | None, *, programs: int, stages: int, warps: int,
             write_grad: bool):
        common = dict(lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"], eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"], ema_weight=EMA_WEIGHT, HAS_SCALE=scale is not None,
                      WRITE_GRAD=write_grad, BLOCK=self.block)
        scale_ptr = step if scale is None else scale
        n = self.block_index.numel()
        if n:
            _full_blocks_kernel[(min(n, programs),)](*self.addr, self.block_tensor, self.block_index, n, scale_ptr,
                                                     step, STAGES=stages, num_warps=warps, **common)
        if self.tail_tensor.numel():
            _tail_blocks_kernel[(self.tail_tensor.numel(),)](*self.addr, self.tail_tensor, self.tail_start,
                                                             self.numels, scale_ptr, step, num_warps=warps,
                                                             **common)


def _shapes(check_only: bool) -> list[tuple[int, ...]]:
    if check_only:  # odd sizes: full blocks, tails, tensors smaller than a block
        return [(7, 33), (130,), (3, 3, 5, 5), (1000,), (1,)]
    from gallery_lib.models.sd_parts import build_stable_diffusion

    with torch.device("meta"):
        unet = build_stable_diffusion("sd15").unet
    return [tuple(p.shape) for p in unet.parameters()]


def _state(shapes, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(shape, scale=1.0):
        return torch.randn(shape, generator=g, device=device) * scale

    params = [rand(s, 0.05) for s in shapes]
    grads = [rand(s, 1e-3) for s in shapes]
    exp_avg = [rand(s, 1e-4) for s in shapes]
    exp_avg_sq = [rand(s, 1e-4).abs() * 1e-3 for s in shapes]
    ema = [p + rand(p.shape, 1e-3) for p in params]
    return params, grads, exp_avg, exp_avg_sq, ema


def _clone(state):
    return tuple([t.clone() for t in tensors] for tensors in state)


def _two_passes(params, grads, exp_avg, exp_avg_sq, ema, step_count, scale, fused_ema: bool):
    """The recipe: torch's fused AdamW (grad_scale: the folded clip factor), then the EMA lerp."""
    opt_params = [torch.nn.Parameter(p, requires_grad=True) for p in params]
    for p, g in zip(opt_params, grads):
        p.grad = g
    opt = torch.optim.AdamW(opt_params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=True)
    for p, m, v in zip(opt_params, exp_avg, exp_avg_sq):
        opt.state[p] = {"step": torch.tensor(float(step_count - 1), device=p.device), "exp_avg": m, "exp_avg_sq": v}

    weights = [p.detach() for p in opt_params]
    tables, rest_ema, rest_weights = build_tables(ema, weights) if fused_ema else ([], ema, weights)

    def run():  # as ModelEma runs it: the EMA's tables built once
        opt.grad_scale = scale
        opt.step()
        opt.grad_scale = None
        for table in tables:
            launch_fused(table, EMA_WEIGHT, None)
        foreach_lerp_(rest_ema, rest_weights, EMA_WEIGHT)
    return run


def _max_rel_diff(a_lists, b_lists):
    ratios = [(a - b).abs().max() / b.abs().max().clamp_min(1e-30)
              for a_list, b_list in zip(a_lists, b_lists) for a, b in zip(a_list, b_list)]
    return torch.stack(ratios).max().item()  # one synchronization


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--check-only", action="store_true", help="small shapes, correctness only (a CPU works)")
    args = parser.parse_args(argv)
    device = "cpu" if args.check_only else "cuda"
    shapes = _shapes(args.check_only)
    scale = torch.tensor(2.5, device=device)  # a clip factor's inverse as the recipe hands it over
    step_count = 7

    # correctness: one update from the same state, both ways
    initial = _state(shapes, device)
    reference = _clone(initial)
    _two_passes(*reference, step_count, scale, fused_ema=not args.check_only)()
    settings = ([(256, 1, 1, 4, True), (256, 3, 2, 4, False)] if args.check_only else
                [(block, programs, stages, warps, False) for block, programs, stages, warps in itertools.product(
                    (2048, 4096), (2, 4, 8), (1, 2, 3), (4, 8))] + [(2048, 4, 2, 8, True)])
    sm = 1 if args.check_only else torch.cuda.get_device_properties(0).multi_processor_count
    report = {**result_header(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "parameters": sum(math.prod(s) for s in shapes), "tensors": len(shapes), "settings": []}
    check = {}
    for block, per_sm, stages, warps, write_grad in settings:
        ours = _clone(initial)
        OnePass(list(zip(*ours)), block).step(torch.tensor(float(step_count), device=device), scale,
                                              programs=per_sm * sm, stages=stages, warps=warps, write_grad=write_grad)
        compared = [0, 2, 3, 4] + ([1] if write_grad else [])
        diff = _max_rel_diff([ours[k] for k in compared], [reference[k] for k in compared])
        check[(block, per_sm, stages, warps, write_grad)] = diff
        print(f"block {block}, {per_sm}/SM, {stages} stages, {warps} warps, grads written {write_grad}: "
              f"max relative difference {diff:.2e}", flush=True)
        if diff >= 1e-5:
            print("  DISAGREES with torch's fused AdamW then the EMA lerp", flush=True)
    agree = all(d < 1e-5 for d in check.values())
    if args.check_only:
        return 0 if agree else 1

    del reference, ours
    state = initial
    step_tensor = torch.tensor(float(step_count), device=device)
    gib = sum(math.prod(s) for s in shapes) * 4 / 2**30
    two = _two_passes(*state, step_count, scale, fused_ema=True)
    report["two_passes_ms"] = event_ms(two)
    report["two_passes_no_scale_ms"] = event_ms(_two_passes(*state, step_count, None, fused_ema=True))
    print(f"two passes (fused AdamW with grad_scale, fused EMA): {report['two_passes_ms'][0]:.3f} ms; "
          f"without grad_scale {report['two_passes_no_scale_ms'][0]:.3f} ms; {gib:.2f} GiB of fp32 weights",
          flush=True)
    table_cache = {}
    for block, per_sm, stages, warps, write_grad in settings:
        if block not in table_cache:
            table_cache[block] = OnePass(list(zip(*state)), block)
        table = table_cache[block]
        ms = event_ms(lambda: table.step(step_tensor, scale, programs=per_sm * sm, stages=stages, warps=warps,
                                      write_grad=write_grad))
        moved = gib * (10 if write_grad else 9)
        row = {"block": block, "programs_per_sm": per_sm, "stages": stages, "warps": warps,
               "writes_grads": write_grad, "ms": ms, "tb_per_s": moved * 2**30 / ms[0] / 1e9,
               "max_rel_diff": check[(block, per_sm, stages, warps, write_grad)]}
        report["settings"].append(row)
        print(f"one pass, block {block}, {per_sm}/SM, {stages} stages, {warps} warps, grads written {write_grad}: "
              f"{ms[0]:.3f} [{ms[1]:.3f}-{ms[2]:.3f}] ms, {row['tb_per_s']:.2f} TB/s", flush=True)
    best = min((r for r in report["settings"] if not r["writes_grads"]), key=lambda r: r["ms"][0])
    table = table_cache[best["block"]]
    with_grads = event_ms(lambda: table.step(step_tensor, scale, programs=best["programs_per_sm"] * sm,
                                          stages=best["stages"], warps=best["warps"], write_grad=True))
    report["best"], report["best_writing_grads_ms"], report["all_agree"] = best, with_grads, agree
    print(f"best: {best}; writing the clipped gradients back too: {with_grads[0]:.3f} ms; every setting agrees "
          f"with the two passes: {agree}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
