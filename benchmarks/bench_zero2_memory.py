"""Peak memory per process of DDP and ZeRO-2 (FSDP2) for the same run, on one and on two processes; one JSON file.

    python benchmarks/bench_zero2_memory.py --model swin_tiny_patch4_window7_224 --batch-size 2 --steps 4 \
        --out benchmarks/results/zero2_memory_cpu.json

Every run goes through the launcher (torchrun; gloo on a CPU, NCCL on GPUs), fp32 (amp_level O0) so that nothing but
the data-parallel mode differs. The summary's ``peak_mem_mb`` is rank 0's: ``torch.cuda.max_memory_allocated`` on a
GPU, the process's peak resident memory on a CPU (which also counts the interpreter, gloo's and FSDP's buffers).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from gallery_lib.recipes.profiles import base_config
from gallery_lib.run.launch import launch
from gallery_lib.app.workflow import prepare
from gallery_lib.reports.provenance import result_header


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--output-dir", default="output/zero2_memory")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    base = base_config("smoke", model=args.model, data_root=args.data_root, output_dir=args.output_dir,
                       batch_size=args.batch_size, steps=args.steps, warmup_steps=1, log_every=args.steps,
                       amp_level="O0", num_workers=0, export_model=False, image_size=224)
    prepare(base, progress=False)
    record = {**result_header(), "torch": torch.__version__, "python": platform.python_version(), "model": args.model,
              "batch_size_per_process": args.batch_size, "peak_mem_kind": None, "rows": []}
    for nproc in (int(n) for n in args.processes.split(",")):
        for mode in ("ddp", "zero2"):
            cfg = base.replace(nproc_per_node=nproc, data_parallel=mode, recipe=f"{mode}-{nproc}proc")
            summary = launch(cfg, echo=None).summary
            record["peak_mem_kind"] = summary["peak_mem_kind"]
            record["rows"].append({"data_parallel": mode, "processes": nproc, "peak_mem_mb": summary["peak_mem_mb"],
                                   "final_loss": summary["final_loss"], "device": summary["device_name"]})
            print(json.dumps(record["rows"][-1]), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
