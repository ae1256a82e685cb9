"""Prototype: how fast could a Swin window-attention kernel for Hopper be, against what ``accelerated`` runs now?

    python benchmarks/proto_window_attention.py --out RESULT.json

A measurement for issue 24's Swin goal, not library code: the accelerated Swin-T step spends 5.4 ms of its 28 ms in
PyTorch's memory-efficient attention (benchmarks/RESULTS.md#bench-h100). This Triton prototype does one 49-token
window per program: scores, the relative-position bias (and the shift mask) added in registers, softmax, the output
and its log-sum-exp; the backward recomputes the probabilities and writes dq, dk, dv and per-program partial sums of
the bias gradient (summed over windows afterwards), so no (windows x heads x 49 x 49) bias is ever materialized.

For each Swin-T stage shape at batch 128 it checks forward and every gradient against fp32 math attention (error
within 2x that of PyTorch's bf16 math attention, + 1e-3), then times forward + backward (CUDA events, median of 50
after 10) of the prototype and of SDPA's efficient kernel fed the way the gallery's Swin hook feeds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

N, BN, D = 49, 64, 32
WINDOWS_PER_PROGRAM = 16


@triton.jit
def _scores(q, k, bias_ptr, mask_ptr, window, h, n_win, scale, offs, N: tl.constexpr, HAS_MASK: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * scale
    valid = (offs[:, None] < N) & (offs[None, :] < N)
    s += tl.load(bias_ptr + h * N * N + offs[:, None] * N + offs[None, :], mask=valid, other=0.0)
    if HAS_MASK:
        s += tl.load(mask_ptr + (window % n_win) * N * N + offs[:, None] * N + offs[None, :], mask=valid, other=0.0)
    return tl.where(offs[None, :] < N, s, float("-inf"))


@triton.jit
def _fwd(qkv_ptr, bias_ptr, mask_ptr, o_ptr, lse_ptr, n_windows, n_win, H, scale,
         N: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr):
    # qkv: (windows, N, 3, H, D) as the qkv Linear writes it; o: (windows, N, H, D); lse: (windows, H, BN)
    window, h = tl.program_id(0), tl.program_id(1)
    offs, offs_d = tl.arange(0, BN), tl.arange(0, D)
    row = offs[:, None] < N
    base = qkv_ptr + window.to(tl.int64) * N * 3 * H * D + h * D + offs[:, None] * 3 * H * D + offs_d[None, :]
    q = tl.load(base, mask=row, other=0.0)
    k = tl.load(base + H * D, mask=row, other=0.0)
    v = tl.load(base + 2 * H * D, mask=row, other=0.0)
    s = _scores(q, k, bias_ptr, mask_ptr, window, h, n_win, scale, offs, N, HAS_MASK)
    m = tl.max(s, 1)
    p = tl.exp(s - m[:, None])
    l = tl.sum(p, 1)
    o = tl.dot((p / l[:, None]).to(v.dtype), v)
    o_base = o_ptr + window.to(tl.int64) * N * H * D + h * D + offs[:, None] * H * D + offs_d[None, :]
    tl.store(o_base, o.to(o_ptr.dtype.element_ty), mask=row)
    tl.store(lse_ptr + (window.to(tl.int64) * H + h) * BN + offs, m + tl.log(l))


@triton.jit
def _bwd(qkv_ptr, bias_ptr, mask_ptr, o_ptr, do_ptr, lse_ptr, dqkv_ptr, dbias_ptr, n_windows, n_win, H, scale,
         N: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr, WPP: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    offs, offs_d = tl.arange(0, BN), tl.arange(0, D)
    row = offs[:, None] < N
    dbias = tl.zeros((BN, BN), dtype=tl.float32)
    for j in range(WPP):
        window = pid * WPP + j
        if window < n_windows:
            base = qkv_ptr + window.to(tl.int64) * N * 3 * H * D + h * D + offs[:, None] * 3 * H * D + offs_d[None, :]
            q = tl.load(base, mask=row, other=0.0)
            k = tl.load(base + H * D, mask=row, other=0.0)
            v = tl.load(base + 2 * H * D, mask=row, other=0.0)
            o_off = window.to(tl.int64) * N * H * D + h * D + offs[:, None] * H * D + offs_d[None, :]
            o = tl.load(o_ptr + o_off, mask=row, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + o_off, mask=row, other=0.0)
            lse = tl.load(lse_ptr + (window.to(tl.int64) * H + h) * BN + offs)
            s = _scores(q, k, bias_ptr, mask_ptr, window, h, n_win, scale, offs, N, HAS_MASK)
            p = tl.exp(s - lse[:, None])
            p = tl.where(row, p, 0.0)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            delta = tl.sum(o * do.to(tl.float32), 1)
            ds = p * (dp - delta[:, None])
            dbias += ds
            ds_lo = ds.to(q.dtype)
            dq = tl.dot(ds_lo, k) * scale
            dk = tl.dot(tl.trans(ds_lo), q) * scale
            d_base = dqkv_ptr + window.to(tl.int64) * N * 3 * H * D + h * D + offs[:, None] * 3 * H * D + offs_d[None, :]
            tl.store(d_base, dq.to(dqkv_ptr.dtype.element_ty), mask=row)
            tl.store(d_base + H * D, dk.to(dqkv_ptr.dtype.element_ty), mask=row)
            tl.store(d_base + 2 * H * D, dv.to(dqkv_ptr.dtype.element_ty), mask=row)
    valid = (offs[:, None] < N) & (offs[None, :] < N)
    tl.store(dbias_ptr + (pid.to(tl.int64) * H + h) * N * N + offs[:, None] * N + offs[None, :], dbias, mask=valid)


class WindowAttention(torch.autograd.Function):
    """(windows, N, 3, H, D) qkv, (H, N, N) bias, optional (n_win, N, N) mask -> (windows, N, H, D)."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, scale):
        windows, n, _, heads, d = qkv.shape
        o = torch.empty(windows, n, heads, d, device=qkv.device, dtype=qkv.dtype)
        lse = torch.empty(windows, heads, BN, device=qkv.device, dtype=torch.float32)
        n_win = mask.shape[0] if mask is not None else 1
        _fwd[(windows, heads)](qkv, bias, mask if mask is not None else bias, o, lse, windows, n_win, heads, scale,
                               N=N, BN=BN, D=D, HAS_MASK=mask is not None, num_warps=4)
        ctx.save_for_backward(qkv, bias, mask, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        qkv, bias, mask, o, lse = ctx.saved_tensors
        windows, n, _, heads, d = qkv.shape
        programs = triton.cdiv(windows, WINDOWS_PER_PROGRAM)
        dqkv = torch.empty_like(qkv)
        dbias = torch.empty(programs, heads, n, n, device=qkv.device, dtype=torch.float32)
        n_win = mask.shape[0] if mask is not None else 1
        _bwd[(programs, heads)](qkv, bias, mask if mask is not None else bias, o, do.contiguous(), lse, dqkv, dbias,
                                windows, n_win, heads, ctx.scale, N=N, BN=BN, D=D, HAS_MASK=mask is not None,
                                WPP=WINDOWS_PER_PROGRAM, num_warps=4)
        return dqkv, dbias.sum(0).to(bias.dtype), None, None


def sdpa_as_the_hook_does(qkv, bias, mask, scale):
    """The gallery's Swin hook today: q, k, v views, the bias expanded over the batch, SDPA's efficient kernel."""
    windows, n, _, heads, d = qkv.shape
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    b = bias.unsqueeze(0)
    if mask is not None:
        b = (b + mask.unsqueeze(1)).unsqueeze(0).expand(windows // mask.shape[0], -1, -1, -1, -1)
        b = b.reshape(windows, heads, n, n)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b.to(q.dtype), scale=scale)
    return out.transpose(1, 2)  # (windows, N, H, D)


def math_reference(qkv, bias, mask, scale):
    windows, n, _, heads, d = qkv.shape
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    s = q @ k.transpose(-1, -2) * scale + bias.unsqueeze(0).to(q.dtype)
    if mask is not None:
        s = s.view(windows // mask.shape[0], mask.shape[0], heads, n, n) + mask.unsqueeze(1).unsqueeze(0).to(q.dtype)
        s = s.view(windows, heads, n, n)
    return (s.softmax(-1) @ v).transpose(1, 2)


def inputs(windows, heads, n_win, shifted, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(windows, N, 3, heads, D, device="cuda", generator=g).to(dtype).requires_grad_()
    bias = (torch.randn(heads, N, N, device="cuda", generator=g) * 0.5).requires_grad_()
    mask = None
    if shifted:
        mask = torch.where(torch.rand(n_win, N, N, device="cuda", generator=g) < 0.3, -100.0, 0.0)
    return qkv, bias, mask


def grads(fn, qkv, bias, mask, do):
    qkv.grad = bias.grad = None
    out = fn(qkv, bias, mask, D ** -0.5)
    out.backward(do)
    return out.detach().float(), qkv.grad.float(), bias.grad.float()


def check(windows, heads, n_win, shifted) -> dict:
    qkv, bias, mask = inputs(windows, heads, n_win, shifted)
    do = torch.randn(windows, N, heads, D, device="cuda", dtype=qkv.dtype)
    ours = grads(WindowAttention.apply, qkv, bias, mask, do)
    theirs = grads(math_reference, qkv, bias, mask, do)
    q32, b32 = qkv.detach().float().requires_grad_(), bias.detach().clone().requires_grad_()
    ref = grads(math_reference, q32, b32, mask, do.float())
    errors = {}
    for name, o, t, r in zip(("out", "dqkv", "dbias"), ours, theirs, ref):
        err, torch_err = (o - r).abs().max().item(), (t - r).abs().max().item()
        errors[name] = {"ours": err, "torch_bf16": torch_err, "ok": err <= 2 * torch_err + 1e-3}
    return errors


def time_ms(fn, qkv, bias, mask, do, steps=50) -> dict:
    def step():
        torch.autograd.grad(fn(qkv, bias, mask, D ** -0.5), (qkv, bias), do)

    try:
        for _ in range(10):
            step()
    except RuntimeError as e:
        return {"error": str(e)[:300]}
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=10)
    return {"median_ms": statistics.median(times), "p20_ms": q[1], "p80_ms": q[7]}


# Swin-T at 224 px, batch 128: (windows in the batch, heads, windows per image, blocks, shifted blocks)
STAGES = [(128 * 64, 3, 64, 2, 1), (128 * 16, 6, 16, 2, 1), (128 * 4, 12, 4, 6, 3), (128, 24, 1, 2, 0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "stages": []}
    total = {"prototype": 0.0, "sdpa_efficient": 0.0}
    for windows, heads, n_win, blocks, shifted_blocks in STAGES:
        for shifted in (False, True):
            count = shifted_blocks if shifted else blocks - shifted_blocks
            if count == 0:
                continue
            errors = check(min(windows, 512), heads, n_win, shifted)
            qkv, bias, mask = inputs(windows, heads, n_win, shifted)
            do = torch.randn(windows, N, heads, D, device="cuda", dtype=qkv.dtype)
            row = {"windows": windows, "heads": heads, "shifted": shifted, "blocks": count, "errors": errors,
                   "prototype": time_ms(WindowAttention.apply, qkv, bias, mask, do),
                   "sdpa_efficient": time_ms(sdpa_as_the_hook_does, qkv, bias, mask, do)}
            for name in total:
                total[name] += count * row[name].get("median_ms", float("nan"))
            record["stages"].append(row)
            print(f"[proto] windows {windows} heads {heads} shifted {shifted}: prototype "
                  f"{row['prototype'].get('median_ms', row['prototype'].get('error'))} ms, sdpa efficient "
                  f"{row['sdpa_efficient'].get('median_ms', row['sdpa_efficient'].get('error'))} ms, "
                  f"errors ok {all(e['ok'] for e in errors.values())} "
                  f"{ {k: round(v['ours'], 4) for k, v in errors.items()} }", flush=True)
    record["per_step_ms_fwd_bwd"] = total
    print(f"[proto] Swin-T step, all 12 blocks' attention forward + backward: {total}", flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
