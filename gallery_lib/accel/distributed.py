"""Process groups, and how the processes of a run share the training: DDP or ZeRO-2 (``RunConfig.data_parallel``).

``init_distributed`` reads torchrun's environment and starts the process group (NCCL on GPUs, gloo on CPUs) when more
than one process runs, and for ZeRO-2 also with one process: FSDP2 needs a device mesh, and a one-process ZeRO-2 run
measures what sharding costs and saves beside DDP's memory on the same GPU.

``ddp``: ``wrap_ddp`` wraps the model in ``DistributedDataParallel`` with its speed switches. Gradients are views
into the all-reduce buckets (``gradient_as_bucket_view``: no copy between them, and no second gradient buffer), the
bucket size is ``ddp_bucket_cap_mb`` (PyTorch's 25 MB by default), and ``ddp_static_graph`` tells DDP that every step
uses the same parameters in the same graph. It is off by default: the training loop's graph is static (every step runs
forward and backward of the whole model), but a model with data-dependent control flow or parameters that some steps
leave unused breaks it (silently wrong reduction order, or an error at the second step), which a recipe cannot know
of an arbitrary model. ``ddp_grad_compression='bf16'`` all-reduces the buckets as bfloat16 (``bf16_compress_hook``:
half the bytes on the wire; the mean comes back into the fp32 gradients, rounded to bf16's 8-bit mantissa). It is
lossy, so it is off unless a family's loss curves were checked against the fp32 all-reduce.

``zero2``: ``apply_zero2`` shards the model with PyTorch's own engine, FSDP2: ``fully_shard(reshard_after_forward=
False)`` on each of the family's repeated blocks (``ModelFamily.block_types``, found as regional compilation finds
them), then on the root. Parameters, gradients and optimizer state are DTensors sharded on dim 0 over the processes.
Before its forward each block all-gathers its weights and keeps them until its backward (ZeRO-2: no second all-gather
in the backward, the whole weights in memory during the step), whose gradients are reduce-scattered to their shards.

What works with ``zero2`` (each tested on CPU processes with gloo, in ``tests/test_distributed.py`` unless said), and
what ``RunConfig`` refuses with a ``ConfigError`` naming the fix:

- Precision: O0 and O1 keep fp32 (sharded) weights and run the math under autocast, as with DDP: the same function.
  FSDP's ``MixedPrecisionPolicy`` stays off (its low-precision all-gather would round the weights that O1 keeps in
  fp32). A float16 GradScaler unscales the DTensor gradients (checked by hand on a CPU). Refused: O2, whose fp32
  master copies are taken from the module's parameters before the wrapper, and FSDP2 replaces those parameters.
- ``torch.compile``: ``compile_scope='blocks'`` compiles each block in place inside its FSDP wrapper (the hooks that
  all-gather and reduce-scatter run around the compiled forward, as torchtitan does it). ``compile_scope='model'``
  compiles the sharded root and trains the same losses (checked by hand, not in the tests: its graphs break at every
  block's hooks and recompile, and it compiles many times slower than DDP's single graph; prefer ``blocks``).
  Refused: the CUDA-graph modes (``reduce-overhead``, ``max-autotune``: the all-gathers, reduce-scatters and their
  stream waits run in hooks outside the captured graphs) and ``precompile_workers`` (the workers compile from copies
  of the blocks, and FSDP2 modules cannot be copied).
- Gradient clipping: ``clip_grad_norm_`` reduces the norm of the DTensor gradients over every shard. The fused AdamW
  steps the shards, its non-finite skip flag included.
- Gradient accumulation: each accumulated batch's gradients are reduce-scattered and added to the sharded gradients
  (``gradient_sync`` says why DDP all-reduces once per step instead, and ZeRO-2 does not).
- Gradient checkpointing: the library's own, as without ZeRO-2 (checked by hand).
- EMA (``ModelEma(template=...)``): sharded like the weights, updated shard by shard.
- Checkpoints: ``torch.distributed.checkpoint`` (``gallery_lib.run.sharded_checkpoint``); they also load on another
  process count.
- Export: ``gather_full_module`` gathers the full weights to rank 0's CPU and loads them into a plain copy of the model
  (``meta_template``, taken before sharding), which the task saves.
- ``channels_last``: FSDP2 shards contiguous parameters only, so the conv weights go back to NCHW before sharding;
  the images and activations stay channels-last.

Peak memory per process (``peak_mem_mb`` in the run summary) compares the two on the same batch.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, NoReturn

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    restarts: int = 0
    """How many times torchrun has restarted the job's workers (``max_restarts``); 0 on the first attempt."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def see_only_own_gpu() -> bool:
    """Lets this process of a multi-process run see only its own GPU (``CUDA_VISIBLE_DEVICES``), as ``cuda:0``.

    The compile caches key each graph on its device, ``cuda:1`` included: without this, every process but the first
    compiles the whole model again on a machine whose caches hold one process's graphs. Called before anything asks
    CUDA for its devices; where something already has, the process keeps the machine's numbering (False)."""
    local_rank, local_procs = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible is not None else [str(i) for i in range(local_procs)]
    if local_procs <= 1 or len(gpus) < local_procs:
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[local_rank]
    if torch.cuda.device_count() == 1:
        return True
    if visible is None:  # no GPU, or CUDA had already listed them all: as before
        del os.environ["CUDA_VISIBLE_DEVICES"]
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return False


def init_distributed(device_type: str, *, zero2: bool = False, own_gpu: bool = False) -> DistInfo:
    """Reads torchrun's environment; starts a process group when more than one process runs, or for ZeRO-2.
    ``own_gpu``: ``see_only_own_gpu`` made this process's GPU ``cuda:0``."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        device = torch.device("cuda", 0 if own_gpu else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if (world_size > 1 or zero2) and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        device_id = {"device_id": device} if device_type == "cuda" else {}
        if "MASTER_ADDR" in os.environ:  # started by torchrun
            dist.init_process_group(backend=backend, **device_id)
        else:  # one process started in-process (``run(cfg)``): a group of one over an in-memory store
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **device_id)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                    restarts=_job_restarts(world_size, device))


def _job_restarts(world_size: int, device: torch.device) -> int:
    """The most restarts any node's torchrun agent has counted. An agent counts the failures of its own workers: on
    several nodes the others start theirs again as the rendezvous changes, and count nothing."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if world_size == 1 or not int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0):
        return restarts  # (a job torchrun never restarts needs no collective at start-up to say so)
    t = torch.tensor([restarts], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def keep_block_graphs_whole_under_ddp() -> None:
    """Blocks compiled in place inside DDP keep the graphs one process compiles.

    Dynamo's DDPOptimizer would split each block's graph at gradient-bucket boundaries, so a multi-process run
    compiled other graphs than a single process (or its precompile workers) left in the caches. The split is for a
    model compiled whole; each compiled block's backward is already an autograd node of its own, after which DDP's
    hooks start the all-reduce of its buckets while the blocks before it run their backward."""
    import torch._dynamo

    torch._dynamo.config.optimize_ddp = False


def wrap_ddp(model: nn.Module, info: DistInfo, *, bucket_cap_mb: int = 25, static_graph: bool = False,
             grad_compression: str = "none") -> nn.Module:
    """``model`` in DDP with gradients as bucket views (the model itself with one process); ``grad_compression``
    ``bf16`` all-reduces the buckets as bfloat16 (PyTorch's ``bf16_compress_hook``)."""
    if info.world_size == 1:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                                              gradient_as_bucket_view=True, static_graph=static_graph)
    if grad_compression == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(state=None, hook=bf16_compress_hook)
    elif grad_compression != "none":
        raise ValueError(f"grad_compression={grad_compression!r}: expected 'none' or 'bf16'")
    return ddp


def apply_zero2(model: nn.Module, block_types: Iterable[str], info: DistInfo) -> tuple[list[str], nn.Module]:
    """Shards ``model`` in place, ZeRO-2 style (module docstring): each block of ``block_types``, then the root.

    Returns the sharded blocks' names and ``meta_template(model)`` taken before sharding.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gallery_lib.accel.compile.regional import block_names

    template = meta_template(model)
    _contiguous_parameters(model)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    try:
        names = block_names(model, tuple(block_types))
    except ValueError:  # no repeated block: one group, the whole model gathered at once
        names = []
    for name in names:
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return names, template


def _contiguous_parameters(model: nn.Module) -> None:
    """FSDP2 shards contiguous parameters only: channels-last conv weights go back to NCHW (the same values; a conv
    with channels-last input still computes channels-last)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()


def meta_template(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its parameters on the meta device (no memory) and its buffers copied: the plain module
    that the EMA and the export rebuild from, since an FSDP2 module cannot be deep-copied."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (a ZeRO-2 model, or an EMA of one)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: nn.Module) -> None:
    """Registers the sharded parameters again after a forward without backward (the attention probe's): with
    ``reshard_after_forward=False`` the whole weights would stay registered until the next backward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_full_module(module: nn.Module, template: nn.Module, info: DistInfo) -> nn.Module | None:
    """A plain copy of a sharded ``module`` (the model or its EMA) with the full weights, on rank 0's CPU; ``None`` on
    the other ranks. Every rank must call it (the weights are gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return None
    plain = copy.deepcopy(template)
    plain.load_state_dict(state, assign=True)
    return plain.cpu()


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return float(t.item())


def mean_over_ranks(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of ``values`` over the processes (each rank's losses of the same steps): no host sync."""
    if info.world_size == 1:
        return values
    total = values.clone()
    dist.all_reduce(total)
    return total / info.world_size


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


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Backward passes inside all-reduce a DDP module's gradients only when ``enabled`` (DDP's ``no_sync``): an
    accumulated step keeps the gradients of its first batches local and reduces their sum with the last one, one
    all-reduce per step instead of one per batch. ZeRO-2 reduce-scatters every batch: skipping it would hold whole
    unsharded gradients until the last batch, the memory ZeRO-2 is there to save."""
    inner = getattr(module, "_orig_mod", module)  # through torch.compile's wrapper
    if enabled or not isinstance(inner, nn.parallel.DistributedDataParallel):
        yield
        return
    with inner.no_sync():
        yield
