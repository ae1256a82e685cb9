"""Is there a faster cuDNN attention for SD-1.5's shapes than the one PyTorch's SDPA picks? A probe for the SD step.

    python benchmarks/archive/probe_cudnn_sdpa_plans.py --out RESULT.json   (needs a GPU and ``nvidia-cudnn-frontend``)

Carry the frontend as a wheel, as ``probe_cudnn_conv_bn.py`` says. At batch 32 the SD step's largest kernel is cuDNN's
attention backward at 4096 tokens and head dim 40 (34 ms a step, benchmarks/RESULTS.md#bench-h100), and the same kernel
runs in the plain peer. PyTorch builds its cuDNN attention graphs with the frontend headers it was compiled with and
runs the first plan cuDNN's heuristics rank. The frontend from the registry (1.32) can build the forward graph with
each of its implementations (``AUTO``, ``COMPOSITE``, ``UNIFIED``; its backward takes no such choice) and run every
plan cuDNN offers for the forward and the backward. For each self-attention shape of SD-1.5 at 512 px (batch 32,
8 heads, the ``(batch, heads, tokens, head_dim)`` views of ``(batch, tokens, channels)`` the model makes), this times:

- ``torch``: ``scaled_dot_product_attention`` on the cuDNN backend, forward alone and forward + backward (the backward
  as their difference);
- each buildable plan of the forward graph per implementation, and of the backward graph (once, under ``AUTO``);
  outputs and gradients are checked against PyTorch's.

CUDA-event medians of 10 rounds of 5 calls after warm-up, with p20 and p80.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_cudnn_conv_bn import (  # noqa: E402 - the conv probe's graph wrapper, types and timing
    CUDNN_TYPES, CudnnGraph, register_cudnn_types, relative_error, timed_ms)

BATCH, HEADS = 32, 8
SHAPES = [("down0/up3 self 4096x40", 4096, 40), ("down1/up2 self 1024x80", 1024, 80),
          ("down2/up1 self 256x160", 256, 160), ("mid self 64x160", 64, 160)]
MAX_PLANS = 8
TIMING = {"calls": 5, "rounds": 10, "warmup": 2}


def model_views(tokens: int, head_dim: int, generator) -> list[torch.Tensor]:
    """q, k, v, dO as the model lays them out: (batch, tokens, heads * head_dim) seen as (batch, heads, tokens, dim)."""
    return [torch.randn(BATCH, tokens, HEADS * head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
            .view(BATCH, tokens, HEADS, head_dim).transpose(1, 2) for _ in range(4)]


def torch_reference(q, k, v, d_out) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def forward():
            return F.scaled_dot_product_attention(*leaves)

        def forward_backward():
            out = forward()
            return torch.autograd.grad(out, leaves, d_out)

        fwd = timed_ms(forward, **TIMING)
        both = timed_ms(forward_backward, **TIMING)
        out = forward()
        grads = torch.autograd.grad(out, leaves, d_out)
    return {"forward": fwd, "forward_backward": both, "backward_median_ms": both["median_ms"] - fwd["median_ms"],
            "out": out.detach(), "grads": [g.detach() for g in grads]}


def as_output(node, buffer):
    """Marks a graph tensor as an output written to ``buffer``, with its shape, strides and type."""
    node.set_output(True).set_dim(list(buffer.shape)).set_stride(list(buffer.stride())) \
        .set_data_type(CUDNN_TYPES[buffer.dtype])


def attention_graph(handle, tensors: dict, build) -> CudnnGraph:
    """A bf16 graph with fp32 intermediates, every plan the three heuristics modes rank (up to ``MAX_PLANS``)."""
    return CudnnGraph(handle, tensors, build, "FLOAT", max_plans=MAX_PLANS, heur_modes=("A", "B", "FALLBACK"))


def probe_implementation(cudnn, handle, impl_name, q, k, v, d_out, reference) -> dict:
    impl = getattr(cudnn.attention_implementation, impl_name)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)  # the same (batch, heads, tokens, dim) strides as q
    stats = torch.empty(BATCH, HEADS, q.shape[2], 1, device="cuda", dtype=torch.float32)
    row = {}

    def build_forward(graph, t):
        o, s = graph.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, generate_stats=True,
                          implementation=impl)
        as_output(o, out)
        as_output(s, stats)
        return {"o": (o, out), "stats": (s, stats)}

    try:
        fwd = attention_graph(handle, {"q": q, "k": k, "v": v}, build_forward)
        row["forward_plans"] = fwd.time_plans(**TIMING)
        fwd.run_plan(next(iter(fwd.plans)))
        torch.cuda.synchronize()
        row["forward_error"] = relative_error(out, reference["out"])
    except Exception as exc:
        return {"error": f"forward: {type(exc).__name__}: {exc}"[:300]}
    if impl_name != "AUTO":
        return row

    grads = [torch.empty_like(t) for t in (q, k, v)]

    def build_backward(graph, t):
        kwargs = dict(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
                      attn_scale=scale)
        dq, dk, dv = graph.sdpa_backward(**kwargs)  # the backward takes no implementation: its plans are enumerated
        for node, buffer in zip((dq, dk, dv), grads):
            as_output(node, buffer)
        return {"dq": (dq, grads[0]), "dk": (dk, grads[1]), "dv": (dv, grads[2])}

    try:
        bwd = attention_graph(handle, {"q": q, "k": k, "v": v, "o": out, "dO": d_out, "stats": stats},
                              build_backward)
        row["backward_plans"] = bwd.time_plans(**TIMING)
        bwd.run_plan(next(iter(bwd.plans)))
        torch.cuda.synchronize()
        row["backward_error"] = [relative_error(g, r) for g, r in zip(grads, reference["grads"])]
    except Exception as exc:
        row["backward_error"] = f"backward: {type(exc).__name__}: {exc}"[:3000]
    return row


def best(plans: dict) -> float | None:
    medians = [t["median_ms"] for t in plans.values() if "median_ms" in t]
    return min(medians) if medians else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import cudnn

    register_cudnn_types(cudnn)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn_backend": torch.backends.cudnn.version(), "cudnn_frontend": getattr(cudnn, "__version__", "?"),
              "batch": BATCH, "heads": HEADS, "rows": []}
    generator = torch.Generator(device="cuda").manual_seed(0)
    for label, tokens, head_dim in SHAPES:
        q, k, v, d_out = model_views(tokens, head_dim, generator)
        reference = torch_reference(q, k, v, d_out)
        row = {"shape": label, "torch": {key: reference[key] for key in
                                         ("forward", "forward_backward", "backward_median_ms")}}
        for impl_name in ("AUTO", "COMPOSITE", "UNIFIED"):
            row[impl_name] = probe_implementation(cudnn, handle, impl_name, q, k, v, d_out, reference)
        summary = {"torch_forward_ms": reference["forward"]["median_ms"],
                   "torch_backward_ms": reference["backward_median_ms"]}
        for impl_name in ("AUTO", "COMPOSITE", "UNIFIED"):
            summary[f"{impl_name}_best_forward_ms"] = best(row[impl_name].get("forward_plans", {}))
            summary[f"{impl_name}_best_backward_ms"] = best(row[impl_name].get("backward_plans", {}))
        row["summary"] = summary
        result["rows"].append(row)
        print(label, json.dumps(summary), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
