"""Small views of an acceleration at work, for the notebooks' "mechanism" cells.

Each function takes a module (or a few tensors), runs it once in this process and returns plain numbers or names:
graphs and graph breaks, autograd nodes, bytes saved for the backward, memory layouts. None of them times anything,
so nothing here reads as a speedup on a CPU; each works the same on a GPU with the real model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gallery_lib.recipes import runs_on_gpu


def real_copy(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """A copy of ``module`` (built on ``meta`` or anywhere) with real, small random weights on ``device``: enough to
    run one block of a large model without building the model."""
    twin = copy.deepcopy(module).to_empty(device=device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        for b in twin.buffers():
            b.zero_()
    return twin


def first_of(model: nn.Module, type_name: str) -> nn.Module:
    """The first submodule whose class is named ``type_name`` (e.g. ``"GEGLU"``, ``"Block"``)."""
    for m in model.modules():
        if type(m).__name__ == type_name:
            return m
    raise LookupError(f"{type(model).__name__} has no {type_name}")


def inputs_of(model: nn.Module, block: nn.Module, *args: Any) -> tuple:
    """The positional inputs ``block`` receives when ``model(*args)`` runs (one forward without gradients, in eval
    mode: reading shapes must not move BatchNorm's running statistics, nor fail on one value per channel, as a CNN's
    last stage has for one small image)."""
    seen: list[tuple] = []
    training = [(module, module.training) for module in model.modules()]
    handle = block.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs) if not seen else None)
    try:
        with torch.no_grad():
            model.eval()(*args)
    finally:
        handle.remove()
        for module, mode in training:
            module.training = mode
    return tuple(t.detach() for t in seen[0])


def graphs_and_breaks(block: nn.Module, *args: Any) -> dict[str, Any]:
    """What ``torch.compile`` captures of one call of ``block``: graphs, graph breaks (with their reasons) and the
    ops in the graphs (``torch._dynamo.explain``: it traces, it does not compile or time)."""
    import torch._dynamo

    torch._dynamo.reset()
    found = torch._dynamo.explain(block)(*args)
    torch._dynamo.reset()
    return {"graphs": found.graph_count, "breaks": found.graph_break_count, "ops": found.op_count,
            "reasons": [str(b.reason) for b in found.break_reasons]}


def autograd_nodes(output: torch.Tensor) -> list[str]:
    """The autograd nodes behind ``output``, output first (parameters' ``AccumulateGrad`` left out): what the
    backward replays, one node per op the forward recorded."""
    names, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            names.append(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return names


def saved_bytes(fn: Callable[[], Any], exclude: nn.Module | None = None) -> int:
    """Bytes the autograd graph keeps for the backward while ``fn()`` runs: each tensor saved for backward, counted
    once per storage, without ``exclude``'s parameters (the weights are kept anyway). On any device."""
    skip = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def checkpointing_bytes(block: nn.Module, *args: Any) -> dict[str, int]:
    """Saved-for-backward bytes of one call of ``block``, plain and under gradient checkpointing (the library's own
    ``checkpointed_call``, diffusers' way: the block keeps its inputs and recomputes the rest in the backward)."""
    from gallery_lib.accel.accelerate import checkpointed_call

    args = tuple(a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args)
    plain = saved_bytes(lambda: block(*args), exclude=block)
    checkpointed = saved_bytes(lambda: checkpointed_call(block, *args), exclude=block)  # the inputs, kept
    return {"plain": plain, "checkpointed": checkpointed}


def attention_bytes(batch: int, heads: int, tokens: int, head_dim: int, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Saved-for-backward bytes of one self-attention, written out (``softmax(q k^T) v``: the tokens x tokens matrix
    is kept) and fused (``F.scaled_dot_product_attention``: flash or memory-efficient kernels keep a row statistic)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, generator=generator).to(device, dtype).requires_grad_()
               for _ in range(3))

    def written_out():
        return torch.softmax(q @ k.transpose(-2, -1) * head_dim ** -0.5, dim=-1) @ v

    return {"written out": saved_bytes(written_out),
            "fused": saved_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)),
            "matrix": batch * heads * tokens * tokens * torch.finfo(dtype).bits // 8}


def conv_layout(conv: nn.Conv2d, images: torch.Tensor) -> dict[str, tuple]:
    """The strides of a conv weight and of its output, as they are (NCHW) and after ``channels_last`` (NHWC: the
    channel dimension has stride 1). Shape (N, C, H, W) is the same in both: only the order in memory changes."""
    rows = {"weight shape": tuple(conv.weight.shape), "NCHW weight strides": conv.weight.stride()}
    with torch.no_grad():
        rows["NCHW output strides"] = conv(images).stride()
        twin = copy.deepcopy(conv).to(memory_format=torch.channels_last)
        rows["NHWC weight strides"] = twin.weight.stride()
        rows["NHWC output strides"] = twin(images.to(memory_format=torch.channels_last)).stride()
    return rows


def mib(n: int) -> str:
    """Bytes as MiB with two decimals (KiB below one MiB)."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# One call per notebook: each returns the lines its cell prints.


def device_for(base: Any) -> str:
    """Where a notebook's mechanism cell runs: the GPU when the runs use one, else the CPU."""
    return "cuda" if runs_on_gpu(base) else "cpu"


def _unet(base: Any) -> nn.Module:
    with torch.device("meta"):  # the structure only; each report makes one block real
        return base.model_family.build(base.model, image_size=base.image_size).unet


def geglu_report(base: Any) -> str:
    """diffusers' GEGLU and the gallery's fused one on the UNet's first feed-forward, at the first block's tokens:
    the autograd nodes each records (the backward replays one kernel per node)."""
    from diffusers.models.activations import GEGLU

    from gallery_lib.accel.kernels.modules import FusedGEGLU

    unet, device = _unet(base), device_for(base)
    shape = next(m for m in unet.modules() if type(m).__name__ in ("GEGLU", "FusedGEGLU")).proj.weight.shape
    with torch.device("meta"):
        geglu = GEGLU(shape[1], shape[0] // 2)
    geglu = real_copy(geglu, device)
    x = torch.randn(1, unet.config.sample_size ** 2, shape[1], device=device)
    eager, fused = autograd_nodes(geglu(x)), autograd_nodes(FusedGEGLU.from_module(geglu)(x))
    return (f"diffusers GEGLU, {len(eager)} autograd nodes: {', '.join(eager)}\n"
            f"FusedGEGLU,      {len(fused)} autograd nodes: {', '.join(fused)}\n"
            f"replaced: {', '.join(n for n in eager if n not in fused)} -> "
            f"{', '.join(n for n in fused if n not in eager)}")


def checkpointing_report(base: Any) -> str:
    """Bytes kept for the backward by the UNet's first transformer block, plain and checkpointed, at the run's batch."""
    unet, device = _unet(base), device_for(base)
    block = real_copy(first_of(unet, "BasicTransformerBlock"), device)
    x = torch.randn(base.batch_size, unet.config.sample_size ** 2, block.norm1.normalized_shape[0], device=device)
    context = torch.randn(base.batch_size, 77, unet.config.cross_attention_dim, device=device)
    got = checkpointing_bytes(block, x, None, context)
    return (f"one BasicTransformerBlock, batch {base.batch_size}, {x.shape[1]} tokens, on {device}, "
            "kept for the backward:\n"
            f"  plain:         {mib(got['plain'])}\n  checkpointed:  {mib(got['checkpointed'])} (its inputs; "
            f"the rest is recomputed in the backward: one more forward of the block)")


def attention_report(base: Any) -> str:
    """Bytes kept for the backward by the UNet's first self-attention at one image, written out and fused."""
    unet, device = _unet(base), device_for(base)
    attn = first_of(unet, "Attention")
    got = attention_bytes(1, attn.heads, unet.config.sample_size ** 2, attn.inner_dim // attn.heads, device)
    return (f"one self-attention, {attn.heads} heads x {unet.config.sample_size ** 2} tokens, 1 image, fp32, "
            f"on {device}, kept for the backward:\n  written out (softmax(q k^T) v): {mib(got['written out'])}, "
            f"of which the tokens x tokens matrix {mib(got['matrix'])}\n"
            f"  fused (scaled_dot_product_attention): {mib(got['fused'])}")


def block_graphs_report(model: nn.Module, block_type: str, images: torch.Tensor) -> str:
    """What ``torch.compile`` captures of the model's first ``block_type`` block, on the inputs it gets from
    ``images``: one graph and no break is what regional compilation needs to replay the block."""
    block = first_of(model, block_type)
    inputs = inputs_of(model, block, images)
    got = graphs_and_breaks(copy.deepcopy(block), *inputs)  # a copy: tracing runs it, as training would
    lines = [f"one {block_type}: {got['graphs']} graph(s), {got['breaks']} graph break(s), "
             f"{got['ops']} ops in the graphs"]
    return "\n".join(lines + [f"  break: {r}" for r in got["reasons"]])


def layout_report(conv: nn.Conv2d, images: torch.Tensor) -> str:
    """``conv_layout`` as lines."""
    return "\n".join(f"{k:>20}: {v}" for k, v in conv_layout(conv, images).items())
