"""Process-group setup for runs started by torchrun (NCCL on GPUs, gloo on CPUs) and the DDP wrapper."""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Reads torchrun's environment; starts a process group when more than one process runs."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                device_id=device if device_type == "cuda" else None)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def wrap_ddp(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    if info.world_size == 1:
        return model
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return float(t.item())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Ends a torchrun worker: runs the ``atexit`` handlers and flushes output, then exits without Python's
    interpreter finalization.

    ``destroy_process_group()`` does not free a gloo group that DDP has used (pytorch/pytorch#107298), so its
    worker threads outlive ``shutdown()``. A worker thread that drops its last reference to a finished collective
    while the interpreter is finalizing needs the GIL, cannot take it, and aborts the process: a finished run then
    exits with SIGABRT (seen in CI, on a loaded 2-core machine). Finalization has no other work left to do here.
    """
    try:
        atexit._run_exitfuncs()  # multiprocessing reaps loader workers, logging flushes its handlers
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
