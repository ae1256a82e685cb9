"""Stochastic depth held as tensors (``accel/compile/drop_path.py``): a timm Swin's blocks compiled in place share a
graph per shape whatever their rates, and each path is dropped and scaled as timm's ``drop_path`` does."""

from __future__ import annotations

import pytest
import torch

from gallery_lib.accel.compile.drop_path import KEEP, rates_as_tensors
from gallery_lib.accel.compile.regional import regional_compile

timm = pytest.importorskip("timm")


def small_swin(drop_path_rate: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", embed_dim=24, depths=(2, 4), num_heads=(1, 2),
                             img_size=56, num_classes=10, drop_path_rate=drop_path_rate)


def block_graphs(model: torch.nn.Module) -> int:
    """The graphs Dynamo holds for the model's blocks after one training step."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model(torch.randn(2, 3, 56, 56)).sum().backward()
    block = next(m for m in model.modules() if type(m).__name__ == "SwinTransformerBlock")
    return len(_debug_get_cache_entry_list(type(block).forward.__code__))


def test_blocks_with_their_own_rates_share_a_graph_per_shape():
    """PyTorch bakes each block's float rate into its graph (6 graphs for 6 blocks); held as tensors, the blocks
    keep as few graphs as a model without stochastic depth (one per stage and shift)."""
    from gallery_lib.accel.on_any_model import compile_blocks

    counts = {}
    for name, rate, as_tensors in (("without", 0.0, False), ("timm's", 0.1, False), ("as tensors", 0.1, True)):
        torch._dynamo.reset()
        model = small_swin(rate)
        if as_tensors:
            change = compile_blocks(model, backend="eager")
            assert "10 stochastic-depth rates held as tensors" in change.what
        else:
            regional_compile(model, ("SwinTransformerBlock",), backend="eager")
        counts[name] = block_graphs(model)
    assert counts["timm's"] == 6 and counts["as tensors"] == counts["without"] < 6, counts
    torch._dynamo.reset()


def test_each_path_is_dropped_with_its_rate_and_scaled_as_timms():
    model = small_swin(0.1)
    saved = model.state_dict()
    drop = next(m for m in model.modules() if type(m).__name__ == "DropPath" and m.drop_prob > 0)
    drop.drop_prob = 0.25  # a rate whose draws a few thousand samples pin
    changed, undo = rates_as_tensors(model)
    assert changed == 10 and model.state_dict().keys() == saved.keys()  # the buffers are not saved
    x = torch.randn(4096, 3, 5, requires_grad=True)
    out = drop(x)
    kept = out.detach().flatten(1).ne(0).all(1)
    assert abs(1 - kept.float().mean().item() - 0.25) < 0.035  # 5 standard deviations of 4096 draws
    scale = torch.ones(()) / torch.tensor(0.75)  # timm's random_tensor.div_(keep_prob), in fp32
    assert torch.equal(out[kept], x[kept] * scale) and not out[~kept].any()
    out.sum().backward()
    assert torch.equal(x.grad[kept], torch.full_like(x[kept], scale.item())) and not x.grad[~kept].any()
    drop.eval()
    assert drop(x) is x
    undo()
    assert "forward" not in drop.__dict__ and KEEP not in drop._buffers
    drop.train()
    assert torch.equal(drop(torch.zeros(3, 2)), torch.zeros(3, 2))  # timm's own forward again
