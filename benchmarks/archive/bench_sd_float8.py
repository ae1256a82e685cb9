"""FP8 training of the SD-1.5 UNet's linear layers on Hopper (torchao float8), against the same step in bf16.

    python benchmarks/archive/bench_sd_float8.py --batch 32 --out RESULT.json

One of the levers to measure for the SD step: does converting the transformer blocks' linear layers to torchao's
float8 training (tensorwise dynamic scaling) make the SD training step faster? Both variants are the same plain step
(random SD-1.5 UNet, bf16 autocast, fused AdamW, SDPA, 64x64 latents with 77x768 text states), each transformer and
ResNet block compiled on its own (regional, as the gallery compiles), run in alternating rounds so clock drift hits
both alike. Linear layers whose token count is the text's (cross-attention keys and values) or that are not
16-aligned stay in bf16. The losses of the first steps from the same weights and data are kept to show how far FP8
moves the step's result. Times are CUDA events after warm-up (the loop's ``StepTimer``): median with p20 / p80
(``summarize_times``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def log(msg: str) -> None:
    print(f"[bench_sd_float8] {msg}", flush=True)


def float8_filter(module: torch.nn.Module, fqn: str) -> bool:
    """The transformer blocks' linear layers over image tokens, 16-aligned (what FP8 matmuls need)."""
    if not isinstance(module, torch.nn.Linear) or "transformer_blocks" not in fqn:
        return False
    if fqn.endswith(("attn2.to_k", "attn2.to_v")):  # 77 text tokens: too few rows to win
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def build(variant: str):
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    from gallery_lib.accel.compile.regional import regional_compile
    from gallery_lib.models.sd_parts import build_unet

    torch.manual_seed(0)
    unet = build_unet("sd15").cuda().train()
    converted = 0
    if variant == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        before = sum(isinstance(m, torch.nn.Linear) for m in unet.modules())
        convert_to_float8_training(unet, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=float8_filter)
        converted = before - sum(type(m) is torch.nn.Linear for m in unet.modules())
    # As the gallery compiles the blocks: static shapes, and a recompile limit above SD's distinct block shapes.
    regional_compile(unet, (BasicTransformerBlock, ResnetBlock2D), backend="inductor", dynamic=False)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
    return unet, opt, converted


def make_step(unet, opt, batch: int):
    g = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn(batch, 4, 64, 64, device="cuda", generator=g)
    text = torch.randn(batch, 77, 768, device="cuda", generator=g)
    noise = torch.randn(batch, 4, 64, 64, device="cuda", generator=g)
    timesteps = torch.randint(0, 1000, (batch,), device="cuda", generator=g)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(latents, timesteps, text).sample
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def time_steps(step, steps: int) -> list[float]:
    """ms per step of ``steps`` back-to-back steps, with the training loop's own CUDA-event timer."""
    from gallery_lib.run.timing import StepTimer

    timer = StepTimer(torch.device("cuda"))
    timer.mark()
    for _ in range(steps):
        step()
        timer.mark()
    return timer.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torchao

    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "torchao": torchao.__version__,
              "batch": args.batch, "timing": "CUDA events per step after warm-up; median, p20/p80", "variants": {}}
    runs = {}
    for variant in ("bf16", "float8"):
        unet, opt, converted = build(variant)
        step = make_step(unet, opt, args.batch)
        start = time.perf_counter()
        losses = [step().item() for _ in range(args.warmup)]
        torch.cuda.synchronize()
        runs[variant] = step
        result["variants"][variant] = {"converted_linears": converted, "warmup_s": time.perf_counter() - start,
                                       "first_losses": losses, "times_ms": []}
        log(f"{variant}: {converted} linear layers in float8, warm-up {time.perf_counter() - start:.1f} s, "
            f"losses {[round(v, 5) for v in losses]}")
        Path(args.out).write_text(json.dumps(result, indent=1))  # partial results survive a cut-off call
    for round_ in range(args.rounds):
        for variant, step in runs.items():
            result["variants"][variant]["times_ms"] += time_steps(step, args.steps)
        Path(args.out).write_text(json.dumps(result, indent=1))
    from gallery_lib.run.timing import summarize_times

    for variant, row in result["variants"].items():
        row.update(summarize_times(row["times_ms"]))
        row["img_per_s"] = args.batch * 1000 / row["median_step_time_ms"]
        log(f"{variant}: {row['median_step_time_ms']:.1f} ms [{row['p20_step_time_ms']:.1f}-"
            f"{row['p80_step_time_ms']:.1f}], {row['img_per_s']:.1f} img/s")
    log(f"peak memory of the process (both models): {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    bf16, fp8 = result["variants"]["bf16"], result["variants"]["float8"]
    result["float8_speedup"] = bf16["median_step_time_ms"] / fp8["median_step_time_ms"]
    log(f"float8 / bf16 speed: {result['float8_speedup']:.3f}x")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
