"""ResNet-50 on one GPU, outside the gallery loop: the plain-PyTorch setups, ``optimize(model)``, and the loaders.

    python benchmarks/bench_resnet.py --parts steps,loaders,fed,optimize --data DIR --out RESULT.json

``steps``: the training step alone on synthetic input (timm ``resnet50``, fused Nesterov SGD, bf16 autocast,
label-smoothed cross-entropy, batch 256 at 224 px), each variant on a fresh model: eager NCHW, eager channels_last,
``torch.compile`` + channels_last (the strongest plain setup), and with CUDA graphs or max-autotune; ``--rounds``
runs the list again in the same order, so a gain must hold twice. ``loaders``: images per second of each image
pipeline alone over the JPEG folder (``cpu``: timm's transforms in the workers; ``gpu_augment``; ``gpu_decode``).
``fed``: the compiled channels_last step with CUDA graphs on synthetic input, then fed by each image pipeline.
``optimize``: the plain loop with ``model = gallery_lib.optimize(model)`` - what it tried, chose, and the steady
step after the choice.
Times are CUDA events after warm-up: median with p20 / p80. The JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # name: (channels_last, torch.compile options or None)
    "eager": (False, None),
    "eager_channels_last": (True, None),
    "compile_channels_last": (True, {}),
    "compile_cudagraphs_channels_last": (True, {"mode": "reduce-overhead"}),
    "compile_max_autotune_channels_last": (True, {"mode": "max-autotune-no-cudagraphs"}),
    # Inductor's own switch for 1x1 convolutions as matrix products, with CUDA graphs
    "compile_cudagraphs_conv1x1mm_channels_last": (True, {"options": {"triton.cudagraphs": True,
                                                                      "conv_1x1_as_mm": True}}),
    # Inductor tuning its own reduction and pointwise kernels (the batch-norm statistics), convolutions left to cuDNN
    "compile_cudagraphs_coordinate_descent_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "coordinate_descent_tuning": True}}),
    "compile_cudagraphs_pointwise_autotune_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "max_autotune_pointwise": True}}),
    "compile_cudagraphs_combo_kernels_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "combo_kernels": True}}),
    # Inductor's reduction code generation, for the batch-norm statistics that take half the step's GPU time
    # (RESULTS.md#bench-h100): a persistent and a looped kernel per reduction, the faster chosen at run time; ...
    "compile_cudagraphs_multi_kernel_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "triton.multi_kernel": 1}}),
    # ... reductions split over several programs that synchronize, for the few-channel, many-pixel reductions; ...
    "compile_cudagraphs_cooperative_reductions_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "triton.cooperative_reductions": True}}),
    # ... reductions tiled in two dimensions (channels x pixels) rather than one
    "compile_cudagraphs_nd_tiling_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "triton.prefer_nd_tiling": True, "triton.tile_reductions": True}}),
    "compile_cudagraphs_aggressive_fusion_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "aggressive_fusion": True}}),
    # 1x1 convolutions as matrix products autotuned against Triton templates, which can take the previous norm's
    # scale, shift and ReLU as a prologue (Inductor's `prologue_fusion`), the 3x3 ones left to cuDNN
    "compile_cudagraphs_conv1x1mm_autotune_gemm_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "conv_1x1_as_mm": True, "max_autotune_gemm": True,
        "max_autotune_gemm_backends": "TRITON,ATEN"}}),
    # the two reduction settings that each helped alone, together
    "compile_cudagraphs_coordinate_descent_nd_tiling_channels_last": (True, {"options": {
        "triton.cudagraphs": True, "coordinate_descent_tuning": True, "triton.prefer_nd_tiling": True,
        "triton.tile_reductions": True}}),
    # cuDNN's benchmark tries every convolution algorithm, not its default first 10 (torch.backends.cudnn.benchmark_limit)
    "compile_cudagraphs_cudnn_all_algorithms_channels_last": (True, {"mode": "reduce-overhead"}),
}
CUDNN_ALL_ALGORITHMS = {"compile_cudagraphs_cudnn_all_algorithms_channels_last"}


def inductor_defaults() -> dict[str, object]:
    """Inductor's own values of the options the variants set (a variant equal to the default measures nothing)."""
    import torch._inductor.config as config

    values = {}
    for _, options in VARIANTS.values():
        for key in (options or {}).get("options", {}):
            node = config
            for part in key.split("."):
                node = getattr(node, part, None)
            values[key] = node if isinstance(node, (bool, int, float, str, type(None))) else repr(node)
    return values


def log(msg: str) -> None:
    print(f"[bench_resnet] {msg}", flush=True)


def quantiles(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p20_ms": ms[len(ms) // 5], "p80_ms": ms[(4 * len(ms)) // 5]}


def resnet50(channels_last: bool) -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet50", num_classes=1000).cuda().train()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    from timm.optim import param_groups_weight_decay

    return torch.optim.SGD(param_groups_weight_decay(model, 5e-5), lr=0.1, momentum=0.9, nesterov=True, fused=True)


def train_step(model, opt, images, labels, cuda_graphs: bool = False) -> torch.Tensor:
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # hard labels with smoothing, or the loader's soft (already smoothed) targets
        loss = F.cross_entropy(model(images), labels, label_smoothing=0.1 if labels.dim() == 1 else 0.0)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def time_steps(step, warmup: int, steps: int) -> dict[str, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for begin, end in events:
        begin.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return {**quantiles([b.elapsed_time(e) for b, e in events]), "warmup_s": warmup_s}


def bench_steps(args, record) -> None:
    images = torch.randn(args.batch, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (args.batch,), device="cuda")
    for round_ in range(1, args.rounds + 1):
        for name in args.variants.split(","):
            channels_last, options = VARIANTS[name]
            torch._dynamo.reset()
            torch.backends.cudnn.benchmark_limit = 0 if name in CUDNN_ALL_ALGORITHMS else 10
            model = resnet50(channels_last)
            opt = sgd(model)
            x = images.contiguous(memory_format=torch.channels_last) if channels_last else images
            run = torch.compile(model, **options) if options is not None else model
            graphs = (options or {}).get("mode") == "reduce-overhead" or \
                (options or {}).get("options", {}).get("triton.cudagraphs", False)
            try:
                r = time_steps(lambda: train_step(run, opt, x, labels, graphs), args.warmup, args.steps)
                r["img_per_s"] = args.batch * 1000 / r["median_ms"]
            except Exception as exc:  # noqa: BLE001 - keep the other variants' numbers
                r = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            r["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30  # what must fit (graph pools included)
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            record("steps", f"{name} round {round_}", r)
            del model, opt, run
            torch.cuda.empty_cache()  # then the next variant's reserved peak starts from what it holds itself
            torch.cuda.reset_peak_memory_stats()


def bench_loaders(args, record) -> None:
    from gallery_lib.data.throughput import pipeline_throughput

    for row in pipeline_throughput(args.data, batch_size=args.batch, image_size=224, device="cuda",
                                   num_workers=args.workers, batches=args.loader_batches, warmup=args.loader_warmup):
        record("loaders", row["pipeline"], {**row, "batches": args.loader_batches})


def bench_fed(args, record) -> None:
    """The compiled channels_last step with CUDA graphs, on synthetic input and then fed by each image pipeline."""
    from gallery_lib.data import RobustImageFolder, build_train_loader

    torch._dynamo.reset()
    model = resnet50(True)
    opt = sgd(model)
    run = torch.compile(model, mode="reduce-overhead")
    images = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    targets = torch.full((args.batch, 1000), 0.1 / 1000, device="cuda")
    targets[:, 0] += 0.9
    r = time_steps(lambda: train_step(run, opt, images, targets, True), args.warmup, args.steps)
    record("fed", "synthetic", {**r, "img_per_s": args.batch * 1000 / r["median_ms"]})
    for pipeline in args.pipelines.split(","):
        loader = build_train_loader(RobustImageFolder(args.data), batch_size=args.batch, image_size=224,
                                    device="cuda", color_jitter=0.0, label_smoothing=0.1, channels_last=True,
                                    num_workers=args.workers, pipeline=pipeline, num_classes=1000)
        batches = iter(loader)

        def fed_step():
            x, y = next(batches)
            train_step(run, opt, x, y, True)

        r = time_steps(fed_step, 10, args.steps)
        record("fed", pipeline, {**r, "img_per_s": args.batch * 1000 / r["median_ms"], "workers": args.workers})
        del batches, loader


def bench_optimize(args, record) -> None:
    import gallery_lib

    images = torch.randn(args.batch, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (args.batch,), device="cuda")
    torch._dynamo.reset()
    model = resnet50(False)
    opt = sgd(model)
    lines: list[str] = []
    model = gallery_lib.optimize(model, cache=Path(args.out).with_suffix(".optimize_cache.json"),
                                 log=lambda s: (lines.append(s), log(s)))
    start = time.perf_counter()
    while getattr(model, "gallery_optimize", None) is None:  # the trial steps
        train_step(model, opt, images, labels)
    trials_s = time.perf_counter() - start
    report = model.gallery_optimize
    r = time_steps(lambda: train_step(model, opt, images, labels), 5, args.steps)
    r.update(img_per_s=args.batch * 1000 / r["median_ms"], choice=report.choice, reason=report.reason,
             trial_steps=report.trial_steps, trials_wall_s=trials_s, log=lines,
             candidates=[vars(c) for c in report.candidates])
    record("optimize", "optimize(model)", r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="steps,loaders,optimize")
    parser.add_argument("--variants", default="eager,eager_channels_last,compile_channels_last,"
                                              "compile_cudagraphs_channels_last")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", help="class-folder JPEG dataset (for the loaders)")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--loader-batches", type=int, default=100)
    parser.add_argument("--loader-warmup", type=int, default=30)
    parser.add_argument("--pipelines", default="cpu,gpu_augment,gpu_decode", help="image pipelines for `fed`")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    from gallery_lib.reports.provenance import result_header

    result = {**result_header(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(),
              "batch": args.batch, "image_size": 224, "timing": "CUDA events per step after warm-up; median, p20/p80",
              "inductor_defaults": inductor_defaults(), "results": {}}

    def record(part: str, name: str, values: dict) -> None:
        result["results"].setdefault(part, {})[name] = values
        log(f"{part} | {name}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in values.items() if k not in ("log", "candidates")))
        Path(args.out).write_text(json.dumps(result, indent=1))

    parts = {"steps": bench_steps, "loaders": bench_loaders, "fed": bench_fed, "optimize": bench_optimize}
    for part in args.parts.split(","):
        parts[part](args, record)


if __name__ == "__main__":
    main()
