"""GPU benchmark: EMA modes, compile strategies and attention backends, written as one JSON file.

    python benchmarks/bench_ema_compile_attention.py --out benchmarks/results/ema_compile_attention_h100.json
    python benchmarks/bench_ema_compile_attention.py --parts ema,attention --quick --out /tmp/quick.json

Parts:
- ``ema``: ms per update of each mode on the SD-1.5 UNet's 860M fp32 parameters, then the SD UNet training step
  (bf16 autocast, fused AdamW, 64x64 latents, 77x768 text states) with EMA off and with each mode, interleaved
  in rounds so that clock drift hits every variant alike.
- ``compile``: eager vs whole-model ``torch.compile`` vs regional compile of the same UNet step: compile time
  (warm-up beyond steady cost) apart from the steady ms/step. Inductor's cache goes to a fresh folder unless
  ``--warm-cache``, so compile times are cold.
- ``attention``: forward+backward ms of every eligible backend for SD shapes (batch 8, 8 heads) and Swin-T window
  shapes (with the additive bias), what ``auto`` picked, and what plain SDPA (PyTorch choosing) costs and picks.

The whole script stays under 8 minutes on one H100/H200 (about 3 with ``--quick``); it prints progress as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--parts", default="ema,compile,attention", help="comma list of ema, compile, attention")
    p.add_argument("--quick", action="store_true", help="batch 8 and fewer steps (default: batch 32)")
    p.add_argument("--batch", type=int, default=None, help="UNet batch size (default: 32, or 8 with --quick)")
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (default: a fresh one)")
    return p.parse_args()


def build_sd15_unet(device):
    from diffusers import UNet2DConditionModel

    # SD-1.5's UNet config (random weights): 859.5M parameters
    return UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    ).to(device)


def make_step(torch, batch, device, opt):
    latents = torch.randn(batch, 4, 64, 64, device=device)
    text = torch.randn(batch, 77, 768, device=device)
    timesteps = torch.randint(0, 1000, (batch,), device=device)
    target = torch.randn_like(latents)

    def step(model):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(latents, timesteps, encoder_hidden_states=text).sample
        torch.nn.functional.mse_loss(pred.float(), target).backward()
        opt.step()

    return step


def cuda_ms(torch, fn, reps):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    return {"median_ms": statistics.median(ms), "p20_ms": ms[len(ms) // 5], "p80_ms": ms[(4 * len(ms)) // 5],
            "n": reps}


def bench_ema(torch, args, device, batch):
    from gallery_lib.accel.ema import ModelEma

    unet = build_sd15_unet(device)
    n_params = sum(p.numel() for p in unet.parameters())
    log(f"ema: SD-1.5 UNet with {n_params / 1e6:.1f}M params")
    variants = {  # name -> ModelEma kwargs
        "loop": dict(mode="loop"), "foreach": dict(mode="foreach"), "fused": dict(mode="fused"),
        "stream": dict(mode="stream"), "stream-narrow": dict(mode="stream", stream_programs=32),
    }
    emas = {name: ModelEma(unet, decay=0.9999, **kw) for name, kw in variants.items()}
    res = {"params_m": n_params / 1e6, "bytes_per_update_gb": 3 * 4 * n_params / 1e9, "update": {}, "step": {}}
    reps = 10 if args.quick else 30
    for name, ema in emas.items():
        ema.update(unet)  # warm-up (Triton compile, pointer tables)

        def update(ema=ema):
            ema.update(unet)
            ema.wait()  # stream modes: the main stream waits, so the time covers the whole update
        torch.cuda.synchronize()
        r = cuda_ms(torch, update, reps)
        r["achieved_tb_s"] = res["bytes_per_update_gb"] / r["median_ms"]
        res["update"][name] = r
        log(f"ema: update {name:<14} {r['median_ms']:7.2f} ms  ({r['achieved_tb_s']:.2f} TB/s of 3 passes)")

    opt = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
    step = make_step(torch, batch, device, opt)
    for ema in emas.values():
        if ema.effective_mode == "stream":
            ema.attach_optimizer(opt)
    configs = ["off", *variants]
    times = {c: [] for c in configs}
    rounds, per_round = (2, 3) if args.quick else (4, 4)
    log(f"ema: SD UNet train step, batch {batch}, {rounds} rounds x {per_round} steps per config")
    for _ in range(2):
        step(unet)
    for r in range(rounds):
        for c in configs:
            def one(c=c):
                step(unet)
                if c != "off":
                    emas[c].update(unet)
            one()  # settle after switching variants
            torch.cuda.synchronize()
            times[c].extend([cuda_ms(torch, one, 1)["median_ms"] for _ in range(per_round)])
        log(f"ema: round {r + 1}/{rounds} done")
    off = statistics.median(times["off"])
    for c in configs:
        med = statistics.median(times[c])
        res["step"][c] = {"median_ms": med, "all_ms": times[c], "slowdown_pct": 100 * (med / off - 1)}
        log(f"ema: step with EMA {c:<14} {med:8.2f} ms  ({100 * (med / off - 1):+.2f}% vs off)")
    res["step"]["batch"] = batch
    del emas, opt, unet
    torch.cuda.empty_cache()
    return res


def bench_compile(torch, args, device, batch):
    from gallery_lib.accel.compile.regional import regional_compile

    res = {"batch": batch}
    warm, timed = (2, 3) if args.quick else (3, 5)
    for variant in ("eager", "whole", "regional"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        unet = build_sd15_unet(device)
        opt = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
        step = make_step(torch, batch, device, opt)
        log(f"compile: {variant} ...")
        try:
            model = torch.compile(unet) if variant == "whole" else unet
            regional = regional_compile(unet) if variant == "regional" else []
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(warm):
                step(model)
            torch.cuda.synchronize()
            warmup_s = time.perf_counter() - t
            steady = cuda_ms(torch, lambda: step(model), timed)["median_ms"]
            res[variant] = {"compile_time_s": max(0.0, warmup_s - warm * steady / 1000), "steady_ms": steady,
                            "warmup_time_s": warmup_s, "regional_modules": len(regional)}
        except Exception as e:  # noqa: BLE001 - keep the other parts' numbers
            res[variant] = {"error": f"{type(e).__name__}: {e}"[:500]}
        log(f"compile: {variant}: {res[variant]}")
        del unet, opt, step
        torch.cuda.empty_cache()
    return res


def bench_attention(torch, args, device, out_dir):
    from gallery_lib.accel import attention as A

    sel = A.BackendSelector(cache_path=os.path.join(out_dir, "attention_choices.json.tmpcache"))
    sel.cache = {}
    bf16 = torch.bfloat16
    shapes = [  # (label, q_shape, kv_shape, has_bias)
        ("sd self 4096x40", (8, 8, 4096, 40), (8, 8, 4096, 40), False),
        ("sd self 1024x80", (8, 8, 1024, 80), (8, 8, 1024, 80), False),
        ("sd self 256x160", (8, 8, 256, 160), (8, 8, 256, 160), False),
        ("sd self 64x160", (8, 8, 64, 160), (8, 8, 64, 160), False),
        ("sd cross 4096x40 kv77", (8, 8, 4096, 40), (8, 8, 77, 40), False),
        ("sd cross 256x160 kv77", (8, 8, 256, 160), (8, 8, 77, 160), False),
        ("swin-t stage1 bs128 (8192 windows, 3 heads, 49x32, bias)", (8192, 3, 49, 32), (8192, 3, 49, 32), True),
        ("swin-t stage3 bs128 (512 windows, 12 heads, 49x32, bias)", (512, 12, 49, 32), (512, 12, 49, 32), True),
    ]
    if args.quick:
        shapes = shapes[:3] + shapes[6:7]
    cap = torch.cuda.get_device_capability(device)
    res = {"backends_installed": {n: b.installed for n, b in A.BACKENDS.items()}, "shapes": []}
    for label, q_shape, kv_shape, has_bias in shapes:
        row = {"label": label, "q_shape": q_shape, "kv_shape": kv_shape, "bias": has_bias, "ms": {}, "skipped": {}}
        for name, b in A.BACKENDS.items():
            why = b.why_not(q_shape, bf16, "cuda", has_bias, cap)
            if why:
                row["skipped"][name] = why
                continue
            try:
                row["ms"][name] = A.benchmark_backend(b, q_shape, kv_shape, bf16, device, has_bias, reps=20)
            except Exception as e:  # noqa: BLE001
                row["skipped"][name] = f"{type(e).__name__}: {str(e)[:200]}"
        row["auto"] = sel.select(q_shape, bf16, device, has_bias, kv_shape)
        row["sdpa_default"] = _sdpa_default(torch, A, q_shape, kv_shape, bf16, device, has_bias)
        res["shapes"].append(row)
        times = ", ".join(f"{n} {ms:.3f}" for n, ms in sorted(row["ms"].items(), key=lambda x: x[1]))
        default = row["sdpa_default"]
        log(f"attention: {label}: auto={row['auto']}  ({times} ms); plain SDPA picks {default.get('picks')} "
            f"({default.get('ms', float('nan')):.3f} ms)")
    res["describe"] = A.describe(sel)
    os.remove(sel.cache_path)
    return res


def _sdpa_default(torch, A, q_shape, kv_shape, dtype, device, has_bias) -> dict:
    """What a diffusers or timm model gets without our hook: plain ``scaled_dot_product_attention``, PyTorch choosing
    the kernel. Its time, and the kernel it picks (``gallery_lib.accel.attention.sdpa_choice``)."""
    import types

    import torch.nn.functional as F

    plain = types.SimpleNamespace(run=lambda q, k, v, bias, scale: F.scaled_dot_product_attention(q, k, v, bias))
    out = {}
    try:
        out["ms"] = A.benchmark_backend(plain, q_shape, kv_shape, dtype, device, has_bias, reps=20)
        q = torch.randn(*q_shape, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(*kv_shape, device=device, dtype=dtype, requires_grad=True)
        bias = torch.zeros(q_shape[0], q_shape[1], q_shape[2], kv_shape[2], device=device, dtype=dtype) \
            if has_bias else None
        out["picks"] = A.sdpa_choice(q, k, k, bias)
    except Exception as e:  # noqa: BLE001 - a record, not a requirement
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> None:
    args = parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"ema", "compile", "attention"}:
        sys.exit(f"--parts takes ema, compile, attention; got {args.parts}")
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_cold_")
    import torch  # after the cache folder is set

    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    batch = args.batch or (8 if args.quick else 32)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    from gallery_lib.reports.provenance import result_header

    result = {**result_header(), "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "quick": args.quick,
              "cold_inductor_cache": not args.warm_cache}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    log(f"{result['device']}, torch {torch.__version__}, parts {sorted(parts)}, batch {batch}")

    def save():
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)

    if "attention" in parts:
        result["attention"] = bench_attention(torch, args, device, out_dir)
        save()
    if "ema" in parts:
        result["ema"] = bench_ema(torch, args, device, batch)
        save()
    if "compile" in parts:
        result["compile"] = bench_compile(torch, args, device, batch)
        save()
    result["total_s"] = time.time() - T0
    save()
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
