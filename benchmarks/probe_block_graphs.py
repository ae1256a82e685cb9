"""How many graphs Dynamo keeps for a timm Swin's blocks compiled in place (``compile_blocks``), by the model's
stochastic depth, and how they add up as ``accelerate`` times one state after another in one process.

timm builds Swin with ``drop_path_rate=0.1`` by default: each block's ``DropPath`` gets its own rate, a float that
Dynamo bakes into the block's graph, so every block compiles its own graph where blocks of one shape would share
one. Graphs of the states ``accelerate`` times stay in the one code object's cache, which holds 64
(``raise_recompile_limit``): past it, further blocks run eagerly. A held-out Swin-S (24 blocks) on an H100 reached
the limit in its third state (benchmarks/RESULTS.md#your-model). Measured on the CPU with a small Swin (12 blocks)
and the ``eager`` backend: the count is Dynamo's, not the device's.

    python benchmarks/probe_block_graphs.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch


def block_graphs(drop_path_rate: float) -> dict[str, int]:
    """The graphs held for the blocks' ``forward`` after each state: compiled with the LayerNorm kernel and the
    window-attention hook, then without the hook, then with it and without the kernel."""
    import timm
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from gallery_lib.accel.attention import hook_swin_attention
    from gallery_lib.accel.on_any_model import compile_blocks, fuse_kernels

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", embed_dim=24, num_heads=(1, 2, 3, 4), img_size=112,
                              num_classes=10, drop_path_rate=drop_path_rate)
    batch = torch.randn(2, 3, 112, 112)
    block = next(module for module in model.modules() if type(module).__name__ == "SwinTransformerBlock")

    def step_then_count() -> int:
        model(batch).sum().backward()
        return len(_debug_get_cache_entry_list(type(block).forward.__code__))

    kernels = fuse_kernels(model, ops=("layer_norm",), device_type="cpu")
    hook = hook_swin_attention(model, backend="window")  # "auto" on a CPU leaves timm's attention to the compiler
    compile_blocks(model, backend="eager")
    counts = {"compiled, with both": step_then_count()}
    hook.remove()
    counts["without the attention hook"] = step_then_count()
    hook = hook_swin_attention(model, backend="window")
    kernels.undo()
    counts["without the LayerNorm kernel"] = step_then_count()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    from gallery_lib.reports.provenance import write_result

    rows = []
    for rate in (0.0, 0.1):
        rows.append({"drop_path_rate": rate, "graphs_after_each_state": block_graphs(rate)})
        print(json.dumps(rows[-1]))
    write_result(args.out, model="timm swin_tiny_patch4_window7_224 at embed_dim 24, 112 px: 12 blocks in 4 stages, "
                 "batch 2", rows=rows)


if __name__ == "__main__":
    main()
