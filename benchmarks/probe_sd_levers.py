"""Two candidate levers for SD-1.5 training at batch 32, measured before any library code is written for them.

1. ``gn_conv``: the ResNet trick for diffusers' ``ResnetBlock2D``. A block computes ``conv(silu(group_norm(x)))``
   twice. Fused, the convolution applies the norm's per-(image, channel) scale and bias and the SiLU as it reads its
   input (a cuDNN runtime-fusion prologue), and sums its own output per (image, channel) as it writes it (a
   reduction epilogue), which gives the next GroupNorm its statistics without a pass of its own. For each of the
   UNet's ResnetBlock2D conv shapes this asks cuDNN (frontend graphs) to build

   - ``prologue``: scale -> bias -> swish -> conv_fprop,
   - ``prologue+sums``: the same plus the (N, C, 1, 1) sums of y and of y*y,

   in bfloat16 (the recipe's autocast dtype) and float16, and times what builds against what the compiled model runs
   today: the norm's statistics, its apply + SiLU (one Inductor kernel, as in a compiled block) and PyTorch's conv.
2. ``qkv``: diffusers' fused QKV projections (``UNet2DConditionModel.fuse_qkv_projections``): the whole UNet's
   forward + backward at batch 32 (bf16 autocast, channels_last, ``torch.compile``), with and without.

    python benchmarks/probe_sd_levers.py --out probe.json [--only gn_conv|qkv]

CUDA events after warm-up; median [p20-p80] ms of ``--iters`` calls.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
import torch.nn.functional as F
from gpu_timing import event_ms

# (channels, latent side) of the UNet's 3x3 convolutions inside ResnetBlock2D at 512 px (latent 64): conv2 of every
# block, and conv1 where the channel count stays (SD-1.5: 320 at 64, 640 at 32, 1280 at 16 and 8).
SHAPES = ((320, 64), (640, 32), (1280, 16), (1280, 8))
GROUPS = 32


def timed(fn, iters: int) -> dict:
    ms, p20, p80 = event_ms(fn, iters)
    return {"ms": round(ms, 4), "p20": round(p20, 4), "p80": round(p80, 4)}


def norm_scale_bias(x, gamma, beta):
    """GroupNorm as a per-(image, channel) affine: what the fused convolution's prologue applies."""
    n, c = x.shape[:2]
    xg = x.float().reshape(n, GROUPS, -1)
    mean, var = xg.mean(-1), xg.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5)
    scale = gamma.float().view(1, GROUPS, -1) * rstd[..., None]
    bias = beta.float().view(1, GROUPS, -1) - mean[..., None] * scale
    return scale.reshape(n, c, 1, 1), bias.reshape(n, c, 1, 1)


def build_cudnn(cudnn, handle, x, scale, bias, w, io_dtype, sums: str = "none", activation: str = "swish",
                intermediate: torch.dtype | None = None):
    """scale -> bias -> ``activation`` -> conv_fprop, with ``sums``: ``none``, ``genstats`` (per channel, as the
    ResNet's batch norms take them) or ``per_image`` (per image and channel, as a GroupNorm needs them)."""
    types = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16,
             torch.float32: cudnn.data_type.FLOAT}
    graph = cudnn.pygraph(io_data_type=types[io_dtype], intermediate_data_type=types[intermediate or io_dtype],
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    named = {"x": x, "scale": scale, "bias": bias, "w": w}
    t = {k: graph.tensor(name=k, dim=list(v.shape), stride=list(v.stride()), data_type=types[v.dtype])
         for k, v in named.items()}
    a = getattr(graph, activation)(input=graph.bias(input=graph.scale(input=t["x"], scale=t["scale"]),
                                                    bias=t["bias"]))
    y = graph.conv_fprop(image=a, weight=t["w"], padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    y.set_output(True).set_data_type(types[io_dtype])
    outputs = [y]
    if sums == "genstats":
        outputs += list(graph.genstats(input=y))
        for o in outputs[1:]:
            o.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    elif sums == "per_image":
        n, k = x.shape[0], w.shape[0]
        s = graph.reduction(input=y, mode=cudnn.reduction_mode.ADD, compute_data_type=cudnn.data_type.FLOAT)
        s.set_output(True).set_dim([n, k, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        sq = graph.reduction(input=graph.mul(a=y, b=y), mode=cudnn.reduction_mode.ADD,
                             compute_data_type=cudnn.data_type.FLOAT)
        sq.set_output(True).set_dim([n, k, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        outputs += [s, sq]
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, t, outputs


def diagnose_support(cudnn, handle) -> list[dict]:
    """Which part of the fused GroupNorm convolution cuDNN declines, at one shape: every combination of the affine's
    shape (per channel, as batch norm has it; per image and channel, as GroupNorm needs), the activation, the sums and
    the intermediate dtype, in float16 and bfloat16. Builds only, no timing."""
    rows = []
    n, c, side = 32, 320, 64
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(n, c, side, side, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = torch.randn(c, c, 3, 3, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        for affine in ("channel", "image_channel"):
            shape = (1, c, 1, 1) if affine == "channel" else (n, c, 1, 1)
            scale = torch.ones(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            for activation in ("relu", "swish"):
                for sums in ("none", "genstats", "per_image"):
                    for intermediate in (dtype, torch.float32):
                        row = {"dtype": str(dtype).split(".")[-1], "affine": affine, "activation": activation,
                               "sums": sums, "intermediate": str(intermediate).split(".")[-1]}
                        try:
                            graph, _, _ = build_cudnn(cudnn, handle, x, scale, scale.clone(), w, dtype, sums,
                                                      activation, intermediate)
                            row["built"] = graph.get_execution_plan_count()
                        except Exception as exc:
                            row["built"] = 0
                            row["why"] = str(exc).split("Reason:")[-1][:160].strip()
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return rows


def probe_gn_conv(iters: int) -> dict:
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    support = diagnose_support(cudnn, handle)
    rows = []
    for channels, side in SHAPES:
        torch.manual_seed(0)
        n = 32
        x32 = torch.randn(n, channels, side, side, device="cuda")
        gamma = 1 + 0.1 * torch.randn(channels, device="cuda")
        beta = 0.1 * torch.randn(channels, device="cuda")
        w32 = torch.randn(channels, channels, 3, 3, device="cuda") / (channels * 9) ** 0.5
        for dtype in (torch.bfloat16, torch.float16):
            row = {"channels": channels, "side": side, "batch": n, "dtype": str(dtype).split(".")[-1]}
            x = x32.to(dtype).contiguous(memory_format=torch.channels_last)
            w = w32.to(dtype).contiguous(memory_format=torch.channels_last)
            gn_silu = torch.compile(lambda x: F.silu(F.group_norm(x, GROUPS, gamma.to(x.dtype), beta.to(x.dtype))))
            row["today_gn_silu"] = timed(lambda: gn_silu(x), iters)
            a = gn_silu(x)
            row["today_conv"] = timed(lambda: F.conv2d(a, w, padding=1), iters)
            row["today_total_ms"] = round(row["today_gn_silu"]["ms"] + row["today_conv"]["ms"], 4)
            expected = F.conv2d(a.float(), w.float(), padding=1)
            scale, bias = norm_scale_bias(x, gamma, beta)
            for affine in (torch.float32, dtype):
                sc = scale.to(affine).contiguous(memory_format=torch.channels_last)
                bi = bias.to(affine).contiguous(memory_format=torch.channels_last)
                for sums in ("none", "per_image"):
                    kind = "prologue+sums" if sums != "none" else "prologue"
                    name = f"cudnn_{kind}_affine_{str(affine).split('.')[-1]}"
                    try:
                        graph, t, outs = build_cudnn(cudnn, handle, x, sc, bi, w, dtype, sums)
                        y = torch.empty(n, channels, side, side, device="cuda", dtype=dtype,
                                        memory_format=torch.channels_last)
                        bufs = [y] + [torch.empty(n, channels, 1, 1, device="cuda") for _ in outs[1:]]
                        pack = {t["x"]: x, t["scale"]: sc, t["bias"]: bi, t["w"]: w}
                        pack.update(zip(outs, bufs))
                        best = None
                        for plan in range(min(4, graph.get_execution_plan_count())):
                            try:
                                ws = torch.empty(max(graph.get_workspace_size_plan_at_index(plan), 1),
                                                 device="cuda", dtype=torch.uint8)

                                def call(plan=plan, ws=ws):
                                    graph.execute_plan_at_index(pack, ws, plan, handle=handle)
                                got = timed(call, iters)
                                if best is None or got["ms"] < best["ms"]:
                                    best = {**got, "plan": plan, "engine": graph.get_plan_name_at_index(plan)}
                            except Exception as exc:  # a listed plan that does not run here
                                row.setdefault(f"{name}_plan_errors", []).append(str(exc)[:160])
                        if best is None:
                            raise RuntimeError("no plan ran")
                        err = ((y.float() - expected).norm() / expected.norm()).item()
                        best["rel_err_y"] = round(err, 5)
                        if sums != "none":
                            ref = y.float().sum((2, 3))
                            best["rel_err_sums"] = round(((bufs[1].view(n, channels) - ref).norm()
                                                          / ref.norm()).item(), 5)
                        row[name] = best
                    except Exception as exc:
                        row[name] = {"unsupported": f"{type(exc).__name__}: {exc}"[:400]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"support": support, "rows": rows, "cudnn_backend": cudnn.backend_version()}


def probe_qkv(iters: int) -> dict:
    from gallery_lib.models.sd_parts import build_unet

    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        unet = build_unet("sd15").cuda().to(memory_format=torch.channels_last).train()
        if fused:
            unet.fuse_qkv_projections()
        opt = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-5, fused=True)
        compiled = torch.compile(unet)
        latents = torch.randn(32, 4, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
        t = torch.randint(0, 1000, (32,), device="cuda")
        text = torch.randn(32, 77, 768, device="cuda")

        def step(compiled=compiled, opt=opt):
            with torch.autocast("cuda", torch.bfloat16):
                out = compiled(latents, t, text).sample
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        results["fused_qkv" if fused else "separate_qkv"] = {**timed(step, iters), "first_step_s": round(compile_s, 1),
                                                             "peak_reserved_gib": round(
                                                                 torch.cuda.max_memory_reserved() / 2**30, 2)}
        print(json.dumps(results), flush=True)
        del unet, opt, compiled, step
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return results


def main() -> None:
    from gallery_lib.reports.provenance import result_header

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=("gn_conv", "qkv"))
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    record = {**result_header(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    for name, probe in (("gn_conv", probe_gn_conv), ("qkv", probe_qkv)):
        if args.only in (None, name):
            try:
                record[name] = probe(args.iters)
            except Exception:
                record[name] = {"error": traceback.format_exc()[-1500:]}
                print(record[name]["error"], flush=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
