"""``torch.compile(model, backend="gallery")``: the gallery's graph passes and compiler settings as a Dynamo backend.

The spelling of the PAI-Blade article (``torch.compile(model, backend="blade")``): two lines in any training
script, no other change. The backend is registered through the ``torch_dynamo_backends`` entry point of this
package, so the name works once ``gallery-lib`` is installed, without importing it first.

What it does with each graph Dynamo captures:

1. the graph passes: every ``a * gelu(gate)`` over the two halves of one tensor (diffusers' GEGLU, the feed-forward
   of every SD transformer block) becomes one call of the fused GEGLU kernel (``gallery::geglu_fwd``, whose
   backward is fused too), the kernel the accelerated recipe keeps for its measured gain
   (``benchmarks/RESULTS.md#kernels``);
2. Inductor compiles the rest, with CUDA graphs when the graph runs on a GPU (``mode="reduce-overhead"``): at the
   small batches of DreamBooth, launching kernels is what bounds the step.

What a Dynamo backend cannot do: it sees one captured graph of tensor operations, not the modules, the optimizer or
the EMA. The fused EMA, cached latents, regional compilation and the attention backend choice come with the
``accelerated`` recipe or ``gallery_lib.optimize``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

_GELU = (torch._C._nn.gelu, F.gelu)


def gallery_backend(gm: torch.fx.GraphModule, example_inputs):
    """The Dynamo backend: the gallery's passes on ``gm``, then Inductor (CUDA graphs on a GPU)."""
    from torch._inductor.compile_fx import compile_fx

    from gallery_lib.accel.compile.cpu_codegen import use_safe_cpu_codegen

    fuse_geglu(gm)
    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    if not on_gpu:
        use_safe_cpu_codegen()
    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": on_gpu})


def fuse_geglu(gm: torch.fx.GraphModule) -> int:
    """Rewrites each ``h.chunk(2, dim=-1)`` whose halves feed only ``first * gelu(second)`` (exact GELU) into
    ``gallery::geglu_fwd(h)``; returns how many were rewritten."""
    import gallery_lib.accel.kernels.geglu  # noqa: F401  (defines gallery::geglu_fwd)

    rewritten = 0
    for mul in list(gm.graph.nodes):
        halves = _geglu_halves(mul)
        if halves is None:
            continue
        chunk, gelu = halves
        with gm.graph.inserting_before(mul):
            fused = gm.graph.call_function(torch.ops.gallery.geglu_fwd.default, (chunk.args[0],))
        mul.replace_all_uses_with(fused)
        for node in (mul, gelu, *list(chunk.users), chunk):  # each now has no user left
            gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _geglu_halves(mul: torch.fx.Node):
    """``(chunk, gelu)`` when ``mul`` is ``first_half * gelu(second_half)`` of one ``chunk(2, dim=-1)``."""
    if mul.op != "call_function" or mul.target is not operator.mul or len(mul.args) != 2 or mul.kwargs:
        return None
    for a, gelu in (mul.args, mul.args[::-1]):
        if not (isinstance(gelu, torch.fx.Node) and gelu.op == "call_function" and gelu.target in _GELU
                and len(gelu.args) == 1 and gelu.kwargs.get("approximate", "none") == "none"
                and len(gelu.users) == 1):
            continue
        first, second = a, gelu.args[0]
        if not all(_is_half(node) for node in (first, second)):
            continue
        chunk = first.args[0]
        if (second.args[0] is chunk and (first.args[1], second.args[1]) == (0, 1) and _splits_last_in_two(chunk)
                and len(chunk.users) == 2 and len(first.users) == 1 and len(second.users) == 1):
            return chunk, gelu
    return None


def _is_half(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node))


def _splits_last_in_two(chunk: torch.fx.Node) -> bool:
    """``h.chunk(2, dim=-1)`` or ``torch.chunk(h, 2, -1)``."""
    if not ((chunk.op == "call_method" and chunk.target == "chunk")
            or (chunk.op == "call_function" and chunk.target is torch.chunk)):
        return False
    args = chunk.args[1:]
    chunks = args[0] if args else chunk.kwargs.get("chunks")
    dim = args[1] if len(args) > 1 else chunk.kwargs.get("dim", 0)
    return chunks == 2 and dim == -1
