"""How steady ``accelerate``'s eager timing of the LayerNorm kernel is on a held-out timm Swin: the same
``TrainingStep`` and ``SteadyStepTimer`` it uses (bf16 autocast, forward, loss, backward; the median of the steps
after warm-up), without and with ``fuse_kernels(model, ["layer_norm"])``, alternating in one process, at the
timer's default length and at a longer one. On an H100, Swin-S's kernel timed 83.2 ms against 104.2 without at
96927ad and 121.7 against 105.0 at 65bcd8e, with the kernel's code unchanged (benchmarks/RESULTS.md#your-model).

    python benchmarks/probe_kernel_eager_timing.py [--model NAME] [--batch N] [--pairs N] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="swin_small_patch4_window7_224")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()

    import timm

    from gallery_lib.accel.keep_if_faster import SteadyStepTimer, TrainingStep
    from gallery_lib.accel.on_any_model import fuse_kernels
    from gallery_lib.reports.provenance import write_result

    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=1000).to(device)
    images = torch.randn(args.batch, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    step = TrainingStep(model, images, lambda logits: F.cross_entropy(logits, labels))
    timings = []
    for pair in range(args.pairs):
        for timing_steps in (None, 40):  # the timer's default, then longer
            for kernel in (False, True):
                change = fuse_kernels(model, ["layer_norm"]) if kernel else None
                start = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    ms = SteadyStepTimer(timing_steps=timing_steps)(step, device)
                timings.append({"pair": pair, "timing_steps": timing_steps or "default", "layer_norm_kernel": kernel,
                                "median_ms": round(ms, 2), "timed_in_s": round(time.perf_counter() - start, 2)})
                print(timings[-1], flush=True)
                if change is not None and change.undo is not None:
                    change.undo()
    write_result(args.out, probe="layer_norm kernel, eager timing", model=args.model, batch=args.batch,
                 gpu=torch.cuda.get_device_name(), triton=__import__("triton").__version__, timings=timings)


if __name__ == "__main__":
    main()
