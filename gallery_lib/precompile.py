"""Parallel ahead-of-time compilation of a model's repeated blocks, so regional compilation reaches speed sooner.

Regional compilation (``compile.regional_compile``) compiles each distinct block graph once, but one after the other
in the training process: every distinct graph (block class x parameter shapes x input shapes) costs a Dynamo trace,
AOTAutograd's joint graph and Inductor's lowering and code generation, mostly single-threaded Python.
``precompile_blocks`` spreads those distinct graphs over worker processes that compile them at the same time into
Inductor's on-disk caches (AOTAutograd cache, FX graph cache, Triton kernels); when the training process then
compiles the same blocks, it finds every graph there and only traces and loads.

1. record: the caller's forward runs once eagerly (RNG states restored afterwards) with pre-hooks on the blocks; each
   call's inputs are kept as specs (shape, stride, dtype, requires_grad; other arguments by value) with the autocast
   state of the call.
2. group: calls of the same block class, with the same parameter, buffer and input metadata, compile to the same graph:
   one representative each, spread over the workers by parameter count.
3. workers (``python -m gallery_lib.precompile SPEC``): each gets meta-device copies of its blocks (real buffers,
   since index buffers must stay valid), runs forward and backward on random inputs of the recorded specs through
   ``module.compile(**compile_kwargs)``, and exits.

Numerics are unchanged: a cache hit loads the code the training process would have generated itself, and a graph the
workers missed (or a failed worker) is simply compiled by the training process as usual.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

_AUTOCAST_DEVICES = ("cuda", "cpu")
_DONE = "compiled "


@dataclass(frozen=True)
class TensorSpec:
    """What a graph sees of a tensor argument: its metadata, never its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)

    def make(self, device: torch.device) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if t.is_floating_point():
            t.normal_()
        else:
            t.zero_()  # indices and masks: zero is valid wherever an index is
        return t.requires_grad_(self.requires_grad)


@dataclass
class BlockCall:
    """One distinct block graph: the representative block's name and the specs of its call."""

    name: str
    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    training: bool
    cost: int
    module: nn.Module | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PrecompileReport:
    """What ``precompile_blocks`` did, for the run's log and summary."""

    blocks: int
    graphs: int
    workers: int
    seconds: float
    failures: list[str] = field(default_factory=list)
    graph_seconds: dict[str, float] = field(default_factory=dict)
    """Per representative block: seconds its worker spent compiling it (forward and backward)."""

    def describe(self) -> str:
        failed = f"; {len(self.failures)} worker(s) failed, their graphs compile in the run" if self.failures else ""
        return (f"pre-compiled {self.graphs} distinct block graphs (of {self.blocks} blocks) in {self.workers} "
                f"parallel processes in {self.seconds:.1f} s{failed}")


def _spec(value: Any) -> Any:
    return TensorSpec.of(value) if isinstance(value, torch.Tensor) else value


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


def _graph_key(module: nn.Module, call: BlockCall) -> tuple:
    tensors = tuple((n, TensorSpec.of(t)) for n, t in (*module.named_parameters(), *module.named_buffers()))
    return (type(module).__qualname__, repr(module), tensors, repr(call.args), repr(sorted(call.kwargs.items())),
            call.autocast, call.training)


def record_block_calls(model: nn.Module, forward: Callable[[], Any], names: Iterable[str]) -> tuple[list[BlockCall],
                                                                                                     int]:
    """Runs ``forward()`` once eagerly and returns the distinct graphs among the calls of the named blocks, plus the
    number of block calls seen. RNG states are restored, so the run's random stream is unchanged."""
    distinct: dict[tuple, BlockCall] = {}
    seen = 0

    def hook(module: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        nonlocal seen
        seen += 1
        call = BlockCall(name, tree_map(_spec, args), tree_map(_spec, kwargs), _autocast_state(), module.training,
                         cost=sum(p.numel() for p in module.parameters()))
        distinct.setdefault(_graph_key(module, call), call)

    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, k, n=n: hook(m, a, k, n), with_kwargs=True) for n in names]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
            forward()
    finally:
        for h in handles:
            h.remove()
    return list(distinct.values()), seen


def _meta_copy(module: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy of ``module`` with parameters on the meta device (no memory) and its buffers' values on the CPU."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    buffers = {n: b.detach().cpu() for n, b in module.named_buffers()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo), buffers


def _balance(calls: list[BlockCall], workers: int) -> list[list[BlockCall]]:
    """Largest first onto the least-loaded worker; empty shares dropped."""
    shares: list[list[BlockCall]] = [[] for _ in range(max(1, workers))]
    loads = [0] * len(shares)
    for call in sorted(calls, key=lambda c: -c.cost):
        i = loads.index(min(loads))
        shares[i].append(call)
        loads[i] += max(1, call.cost)
    return [s for s in shares if s]


def _backend_flags() -> dict[str, Any]:
    return {"matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def precompile_blocks(model: nn.Module, forward: Callable[[], Any], names: Iterable[str], *, workers: int,
                      compile_kwargs: dict[str, Any], log: Callable[[str], Any] = print,
                      timeout_s: float = 1800.0) -> PrecompileReport:
    """Compiles the distinct graphs of the named blocks in ``workers`` parallel processes into the on-disk caches.

    Args:
        model: the model whose blocks the run will compile with ``module.compile(**compile_kwargs)``.
        forward: runs the model's forward once as the training step does (same batch shape, autocast, train mode).
        names: qualified names of the blocks (``regional_compile``'s return value).
        workers: how many processes compile at the same time (each holds its blocks' weights and one call's
            activations in device memory).
        compile_kwargs: exactly what the run passes to ``module.compile`` (a different option is a different graph).
        timeout_s: a worker still running after this long is stopped; its graphs compile in the run.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} is invalid: expected an integer >= 1.")
    start = time.perf_counter()
    names = list(names)
    calls, seen = record_block_calls(model, forward, names)
    device = next(iter(model.parameters())).device
    shares = _balance(calls, workers)
    failures: list[str] = []
    graph_seconds: dict[str, float] = {}
    # The workers unpickle the blocks: their classes must import there as here (a notebook's or a test's own module).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # Each worker would start a Triton compile pool as large as the machine: share the cores out instead.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // len(shares))))
    with tempfile.TemporaryDirectory(prefix="gallery_precompile_") as tmp:
        procs = []
        for i, share in enumerate(shares):
            for call in share:
                call.module, call.buffers = _meta_copy(model.get_submodule(call.name))
            path = Path(tmp) / f"share{i}.pt"
            torch.save({"calls": share, "compile_kwargs": compile_kwargs, "device": str(device),
                        "flags": _backend_flags()}, path)
            for call in share:
                call.module, call.buffers = None, {}
            log_path = Path(tmp) / f"share{i}.log"
            with open(log_path, "w") as out:
                procs.append((subprocess.Popen([sys.executable, "-m", "gallery_lib.precompile", str(path)],
                                               stdout=out, stderr=subprocess.STDOUT, env=env), log_path))
        deadline = time.monotonic() + timeout_s
        for i, (proc, log_path) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = "timeout"
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith(_DONE):  # "compiled NAME in SECONDS s", written by compile_share
                    name, _, seconds = line[len(_DONE):].rpartition(" in ")
                    graph_seconds[name] = float(seconds.rstrip(" s"))
            if code != 0:
                tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
                failures.append(f"worker {i} ({code}): {tail}"[:500])
    report = PrecompileReport(len(names), len(calls), len(shares), time.perf_counter() - start, failures,
                              graph_seconds)
    log(f"[gallery] {report.describe()}")
    for failure in failures:
        log(f"[gallery]   precompile {failure}")
    return report


def _apply_flags(flags: dict[str, Any]) -> None:
    # Only what differs: even a no-op assignment switches the newer fp32_precision setting from "none" to "ieee",
    # which is part of Inductor's cache key, and every graph would then miss.
    if torch.get_float32_matmul_precision() != flags["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    if torch.backends.cuda.matmul.allow_tf32 != flags["matmul_tf32"]:
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    if torch.backends.cudnn.allow_tf32 != flags["cudnn_tf32"]:
        torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    if torch.backends.cudnn.benchmark != flags["cudnn_benchmark"]:
        torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    if torch.are_deterministic_algorithms_enabled() != flags["deterministic"]:
        torch.use_deterministic_algorithms(flags["deterministic"], warn_only=True)


def _compile_call(call: BlockCall, device: torch.device, compile_kwargs: dict[str, Any]) -> None:
    module = call.module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02) if p.is_floating_point() else p.zero_()
        for name, value in call.buffers.items():
            module.get_buffer(name).copy_(value)
    module.train(call.training)
    module.compile(**compile_kwargs)
    args = tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, call.args)
    kwargs = tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, call.kwargs)
    contexts = [torch.autocast(d, dtype=dtype, enabled=on) for d, on, dtype in call.autocast
                if on and (d != "cuda" or device.type == "cuda")]
    with torch.enable_grad():
        for ctx in contexts:
            ctx.__enter__()
        try:
            out = module(*args, **kwargs)
        finally:
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
        grads_for = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads_for:  # the backward graph is compiled on the first backward, as in the run
            torch.autograd.backward(grads_for, [torch.randn_like(t) for t in grads_for])


def compile_share(path: str) -> None:
    """The worker's job: compile every call of one share file written by ``precompile_blocks``."""
    share = torch.load(path, weights_only=False)
    _apply_flags(share["flags"])
    from gallery_lib.compile import raise_recompile_limit

    raise_recompile_limit()
    device = torch.device(share["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for call in share["calls"]:
        t = time.perf_counter()
        _compile_call(call, device, share["compile_kwargs"])
        print(f"{_DONE}{call.name} in {time.perf_counter() - t:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gallery_lib.precompile SHARE.pt  (written by precompile_blocks)", file=sys.stderr)
        return 2
    # Through the importable module, not __main__: the pickled specs refer to gallery_lib.precompile's classes.
    from gallery_lib.precompile import compile_share as run_share

    run_share(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
