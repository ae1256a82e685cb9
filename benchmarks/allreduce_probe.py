"""How long the all-reduce of a model's gradients takes on this machine's GPUs, alone (nothing to overlap with):
fp32 and bf16, as DDP sends them (buckets of ``--bucket-mb``) and as one tensor. Gives the floor that DDP's overlap
has to hide behind the backward.

    torchrun --nproc_per_node 2 benchmarks/allreduce_probe.py [--params 860e6] [--bucket-mb 25]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def time_all_reduce(chunks: list[torch.Tensor], repeat: int = 5) -> float:
    """Median ms of all-reducing every chunk once, back to back (after two untimed rounds)."""
    times = []
    for i in range(repeat + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for chunk in chunks:
            dist.all_reduce(chunk)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=860e6)
    parser.add_argument("--bucket-mb", type=float, default=25)
    parser.add_argument("--out")
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n = int(args.params)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(n, device="cuda").to(dtype)
        per_bucket = int(args.bucket_mb * 2**20 // flat.element_size())
        for name, chunks in (("buckets", list(flat.split(per_bucket))), ("one", [flat])):
            ms = time_all_reduce(chunks)
            gbytes = n * flat.element_size() / 1e9
            rows[f"{str(dtype).split('.')[-1]} {name}"] = {"ms": round(ms, 2), "GB": round(gbytes, 2),
                                                           "bus_GB_s": round(gbytes / ms * 1e3, 1),
                                                           "calls": len(chunks)}
        del flat
    if dist.get_rank() == 0:
        for key, row in rows.items():
            print(f"[allreduce] {key}: {row}")
        if args.out:
            with open(args.out, "w") as f:
                from gallery_lib.reports.provenance import result_header

                json.dump({**result_header(), "world_size": dist.get_world_size(), "params": n,
                           "bucket_mb": args.bucket_mb,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
