"""Swin's window-attention kernel against SDPA's efficient kernel as the Swin hook fed it, attention alone.

    python benchmarks/archive/proto_window_attention.py --out RESULT.json

The measurement behind ``gallery_lib/accel/kernels/window_attention.py`` (benchmarks/RESULTS.md#bench-h100): the
accelerated Swin-T step spent 5.4 ms of its 28 ms in PyTorch's memory-efficient attention. The first numbers came
from this script's own prototype of the kernel (commit e1676dd); it now times the library's kernel.

For each Swin-T stage shape at batch 128 it checks forward and every gradient against fp32 math attention (error
within 2x that of PyTorch's bf16 math attention, + 1e-3), then times forward + backward (CUDA events, median of 50
after 10) of the kernel (``prototype`` in the JSON) and of SDPA's efficient kernel fed as the hook fed it.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

N, D = 49, 32


def window_kernel(qkv, bias, mask, scale):
    from gallery_lib.accel.kernels.window_attention import window_attention

    return window_attention(qkv, bias, mask, scale)


def sdpa_as_the_hook_does(qkv, bias, mask, scale):
    """The gallery's Swin hook before the kernel: q, k, v views, the bias expanded over the batch, SDPA's efficient
    kernel."""
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
    ours = grads(window_kernel, qkv, bias, mask, do)
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
                   "prototype": time_ms(window_kernel, qkv, bias, mask, do),
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
