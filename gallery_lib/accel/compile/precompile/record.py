"""Steps 1-2 of precompilation: record the distinct graphs among a model's block calls, as specs that pickle
(``TensorSpec``, ``BlockCall``), and run one of them compiled (``compile_call``: a worker's job, and this process's
when it loads a graph) or eagerly (``run_eagerly``: its kernels' first use)."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from gallery_lib.accel.side_forward import side_forward

_AUTOCAST_DEVICES = ("cuda", "cpu")


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
    cost: tuple[int, int]
    """How long the graph likely takes to compile: (submodules, parameters) of the block (``largest_first``)."""
    module: nn.Module | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    graph_key: str = ""
    """A digest of what the graph depends on (``_graph_key``): equal calls compile to the same graph."""


def _spec(value: Any) -> Any:
    return TensorSpec.of(value) if isinstance(value, torch.Tensor) else value


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


_PLAIN = (bool, int, float, str, type(None))


def _plain_attributes(module: nn.Module) -> tuple:
    """The public scalar attributes of ``module`` and its children: Dynamo specializes a graph on their values."""
    found = []
    for prefix, m in module.named_modules():
        for name, value in sorted(vars(m).items()):
            if name.startswith("_"):
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, (tuple, list))
                                             and all(isinstance(v, _PLAIN) for v in value)):
                found.append((prefix, name, repr(value)))
    return tuple(found)


def _graph_key(module: nn.Module, call: BlockCall) -> tuple:
    tensors = tuple((n, TensorSpec.of(t)) for n, t in (*module.named_parameters(), *module.named_buffers()))
    return (type(module).__qualname__, repr(module), _plain_attributes(module), tensors, repr(call.args),
            repr(sorted(call.kwargs.items())), call.autocast, call.training)


def _as_leaf(value: Any) -> Any:
    return value.detach().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value


def _cut_autograd_graph(module: nn.Module, args: tuple, output: Any) -> Any:
    """A block's outputs as leaves with the same ``requires_grad``: what later blocks see is unchanged, and each block's
    saved activations are freed when it returns, so the recording forward holds about one block's activations (an
    eager forward of the SD UNet at batch 64 keeping all of them does not fit on an 80 GB GPU)."""
    return tree_map(_as_leaf, output)


def record_block_calls(model: nn.Module, forward: Callable[[], Any], names: Iterable[str]) -> tuple[list[BlockCall],
                                                                                                     int]:
    """Runs ``forward()`` once eagerly and returns the distinct graphs among the calls of the named blocks, plus the
    number of block calls seen. RNG states and buffers (BatchNorm's statistics) are restored (``side_forward``), so
    the run is unchanged. The forward's autograd graph is cut after every block (``_cut_autograd_graph``): it is only
    ever read, never differentiated."""
    distinct: dict[tuple, BlockCall] = {}
    seen = 0

    def hook(module: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        nonlocal seen
        seen += 1
        call = BlockCall(name, tree_map(_spec, args), tree_map(_spec, kwargs), _autocast_state(), module.training,
                         cost=compile_cost(module))
        key = _graph_key(module, call)
        call.graph_key = hashlib.sha256(repr(key).encode()).hexdigest()
        distinct.setdefault(key, call)

    names = list(names)
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, k, n=n: hook(m, a, k, n), with_kwargs=True) for n in names]
    handles += [model.get_submodule(n).register_forward_hook(_cut_autograd_graph) for n in names]
    try:
        with side_forward(model):
            forward()
    finally:
        for h in handles:
            h.remove()
    return list(distinct.values()), seen


def meta_copy(module: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy of ``module`` with parameters on the meta device (no memory) and its buffers' values on the CPU."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    buffers = {n: b.detach().cpu() for n, b in module.named_buffers()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo), buffers


def compile_cost(block: nn.Module) -> tuple[int, int]:
    """What ``largest_first`` orders by: the block's submodule count, then its parameter count."""
    return sum(1 for _ in block.modules()), sum(p.numel() for p in block.parameters())


def largest_first(calls: list[BlockCall]) -> list[BlockCall]:
    """The queue's order, longest compile first: by submodule count, which tracks the size of a block's graph and so
    its compile time better than its parameter count (benchmarks/RESULTS.md#precompile-order), parameters breaking
    ties."""
    return sorted(calls, key=lambda c: c.cost, reverse=True)


def backend_flags() -> dict[str, Any]:
    """The process-wide settings that shape the compiled code, for the workers to copy (and the warm-start key): a
    worker's graph must be the one the run would compile. They are the settings Inductor's cache key reads, copied
    exactly: a process that set fp32 matmul precision to "high" and back to "highest" keys its graphs apart from a
    fresh one (``fp32_precision`` "ieee" against "none"), so the legacy switches alone are not enough.
    ``cpp_simdlen`` is the run's CPU code width (``gallery_lib.accel.compile.cpu_codegen``); ``graphsafe_rng`` how
    checkpointed graphs keep their RNG state (``CompilePlan.cache_checkpointed_graphs``)."""
    from torch._functorch import config as functorch
    from torch._inductor import config as inductor

    matmul = torch.backends.cuda.matmul
    return {"matmul_tf32": matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "matmul_fp32_precision": getattr(matmul, "fp32_precision", None),
            "matmul_reduced_precision": (matmul.allow_fp16_reduced_precision_reduction,
                                         matmul.allow_bf16_reduced_precision_reduction),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "default_dtype": str(torch.get_default_dtype()), "cpp_simdlen": inductor.cpp.simdlen,
            "graphsafe_rng": functorch.graphsafe_rng_functionalization}


def apply_flags(flags: dict[str, Any]) -> None:
    from torch._functorch import config as functorch
    from torch._inductor import config as inductor

    from gallery_lib.accel import torch_switches

    torch_switches.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch_switches.set_tf32(matmul=flags["matmul_tf32"], cudnn=flags["cudnn_tf32"])
    matmul = torch.backends.cuda.matmul
    if flags["matmul_fp32_precision"] is not None and matmul.fp32_precision != flags["matmul_fp32_precision"]:
        matmul.fp32_precision = flags["matmul_fp32_precision"]  # after the legacy switches, which set it too
    fp16, bf16 = flags["matmul_reduced_precision"]
    if matmul.allow_fp16_reduced_precision_reduction != fp16:
        matmul.allow_fp16_reduced_precision_reduction = fp16
    if matmul.allow_bf16_reduced_precision_reduction != bf16:
        matmul.allow_bf16_reduced_precision_reduction = bf16
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            flags["deterministic"], flags["deterministic_warn_only"]):
        torch.use_deterministic_algorithms(flags["deterministic"], warn_only=flags["deterministic_warn_only"])
    torch.set_default_dtype(getattr(torch, flags["default_dtype"].removeprefix("torch.")))
    inductor.cpp.simdlen = flags["cpp_simdlen"]
    functorch.graphsafe_rng_functionalization = flags["graphsafe_rng"]


def compile_call(call: BlockCall, device: torch.device, compile_kwargs: dict[str, Any]) -> None:
    """Compiles ``call``'s graph, forward and backward, on a copy of its block with random weights and inputs."""
    module = _materialize(call, device)
    module.compile(**compile_kwargs)
    _forward_backward(module, call, device)


def run_eagerly(call: BlockCall, device: torch.device) -> None:
    """Runs ``call``'s block once, forward and backward, uncompiled, on a copy with random weights and inputs, then
    frees the copy's memory: the first use of each of its library kernels, which cuDNN compiles for the GPU on a
    machine that never ran them (benchmarks/RESULTS.md#precompile-loading). The copy stays usable by
    ``compile_call``."""
    module = _materialize(call, device)
    _forward_backward(module, call, device)
    for p in module.parameters():
        p.grad = None
    module.to_empty(device="meta")


def _materialize(call: BlockCall, device: torch.device) -> nn.Module:
    module = call.module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02) if p.is_floating_point() else p.zero_()
        for name, value in call.buffers.items():
            module.get_buffer(name).copy_(value)
    return module.train(call.training)


def _forward_backward(module: nn.Module, call: BlockCall, device: torch.device) -> None:
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
