"""What a compiled model holds beside its accumulated gradients: the memory a step's second batch allocates at its
peak, over what it held before, for eager code, a model compiled whole and one compiled block by block.

The memory plan counts one more fp32 copy of the gradients for a model compiled whole under gradient accumulation
(``TrainingState.compiled_copy``): its backward is one graph that hands back every gradient at once, and only then
are they added to those accumulated so far; eager code, and compiled blocks, add each layer's or block's as it comes.
Measured on the CPU with the profiler's allocation events (the mechanism is autograd's, not the device's).

    python benchmarks/probe_compiled_accumulation.py [--backend aot_eager] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

WAYS = ("eager", "whole", "blocks")


def mlp(layers: int = 8, width: int = 512) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[module for _ in range(layers)
                                 for module in (torch.nn.Linear(width, width), torch.nn.ReLU())])


def second_batch_peak_mib(model: torch.nn.Sequential, way: str, backend: str = "aot_eager") -> float:
    """MiB allocated at the peak of a second batch's forward and backward, gradients accumulating, over what was held
    before it; ``way``: ``eager``, ``whole`` (``torch.compile(model)``) or ``blocks`` (each Linear compiled)."""
    if way == "whole":
        run = torch.compile(model, backend=backend)
    else:
        if way == "blocks":
            for module in model:
                if isinstance(module, torch.nn.Linear):
                    module.compile(backend=backend)
        run = model
    batch = torch.randn(4, model[0].in_features)
    run(batch).square().mean().backward()  # the first batch creates the gradients (and compiles)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(batch).square().mean().backward()
    events = sorted((event for event in prof.events() if event.self_cpu_memory_usage),
                    key=lambda event: event.time_range.start)
    held = peak = 0
    for event in events:
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--out")
    args = parser.parse_args()
    from gallery_lib.reports.provenance import write_result

    sizes = [p.numel() * 4 / 2**20 for p in mlp().parameters()]
    runs = [(way, args.backend) for way in WAYS] + ([("whole", "inductor")] if args.backend != "inductor" else [])
    rows = []
    for way, backend in runs:  # each on a fresh model: "blocks" compiles its layers in place
        rows.append({"way": way, "backend": None if way == "eager" else backend,
                     "second_batch_peak_mib": round(second_batch_peak_mib(mlp(), way, backend), 2),
                     "gradients_mib": round(sum(sizes), 2), "largest_gradient_mib": round(max(sizes), 2)})
        print(json.dumps(rows[-1]))
    write_result(args.out, model="8 x Linear(512, 512) + ReLU, batch 4", rows=rows)


if __name__ == "__main__":
    main()
