"""gallery_lib.reports.mechanism: the notebooks' mechanism cells measure what they say, on tiny modules."""

from __future__ import annotations

import torch
from torch import nn

from gallery_lib.reports import mechanism as mech


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))


def test_checkpointing_keeps_only_the_inputs():
    block, x = _mlp(), torch.randn(64, 32)
    got = mech.checkpointing_bytes(block, x)
    assert got["checkpointed"] == x.untyped_storage().nbytes()  # the input, nothing from inside the block
    assert got["plain"] > 3 * got["checkpointed"]  # x, and every hidden activation and GELU input


def test_saved_bytes_leaves_out_the_weights_and_counts_a_storage_once():
    lin = nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    assert mech.saved_bytes(lambda: lin(x), exclude=lin) == x.untyped_storage().nbytes()
    assert mech.saved_bytes(lambda: lin(x)) == x.untyped_storage().nbytes() + lin.weight.untyped_storage().nbytes()


def test_fused_attention_does_not_keep_the_attention_matrix():
    got = mech.attention_bytes(1, 2, 256, 16)
    assert got["matrix"] == 2 * 256 * 256 * 4
    assert got["written out"] >= got["matrix"] > got["fused"]


def test_a_block_compiles_as_one_graph_without_breaks_and_a_break_is_counted():
    block = _mlp()
    got = mech.graphs_and_breaks(block, torch.randn(4, 32))
    assert (got["graphs"], got["breaks"], got["ops"]) == (1, 0, 5)

    class Breaks(nn.Module):
        def forward(self, x):
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

    got = mech.graphs_and_breaks(Breaks(), torch.randn(4))
    assert (got["graphs"], got["breaks"]) == (2, 1) and got["reasons"]


def test_the_inputs_a_block_receives():
    model = _mlp()
    (x,) = mech.inputs_of(model, model[2], torch.randn(3, 32))
    assert x.shape == (3, 128) and (x >= -0.2).all()  # after the GELU


def test_reading_a_cnns_block_inputs_leaves_its_batchnorm_alone_and_takes_one_small_image():
    """One 32 px image leaves resnet18's last stage one value per channel, which BatchNorm refuses in training; the
    report reads the inputs in eval mode, restores each module's mode and moves no running statistic."""
    import timm

    model = timm.create_model("resnet18", num_classes=10).train()
    model.layer2[0].eval()  # a mode of the user's own, kept
    before = {name: t.clone() for name, t in model.state_dict().items()}
    text = mech.block_graphs_report(model, "BasicBlock", torch.randn(1, 3, 32, 32))
    assert text.startswith("one BasicBlock: 1 graph(s), 0 graph break(s)")
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert model.training and model.layer4[1].bn2.training and not model.layer2[0].training


def test_the_fused_geglu_replaces_three_autograd_nodes_by_one():
    from diffusers.models.activations import GEGLU

    from gallery_lib.accel.kernels.modules import FusedGEGLU

    geglu, x = GEGLU(8, 16), torch.randn(2, 5, 8)
    eager, fused = mech.autograd_nodes(geglu(x)), mech.autograd_nodes(FusedGEGLU.from_module(geglu)(x))
    assert {"MulBackward0", "SplitBackward0", "GeluBackward0"} <= set(eager)
    assert set(eager) - set(fused) == {"MulBackward0", "SplitBackward0", "GeluBackward0"}
    assert set(fused) - set(eager) == {"_GegluFunctionBackward"}
    torch.testing.assert_close(FusedGEGLU.from_module(geglu)(x), geglu(x))


def test_real_copy_of_a_meta_module_runs():
    with torch.device("meta"):
        block = _mlp()
    twin = mech.real_copy(block)
    assert all(p.device.type == "cpu" and p.abs().sum() > 0 for p in twin.parameters())
    assert torch.isfinite(twin(torch.randn(2, 32))).all()
    assert mech.first_of(twin, "GELU") is twin[1]


def test_channels_last_gives_the_channels_stride_one():
    conv = nn.Conv2d(3, 8, 3)
    got = mech.conv_layout(conv, torch.randn(2, 3, 10, 10))
    assert got["NCHW weight strides"] == (27, 9, 3, 1) and got["NHWC weight strides"] == (27, 1, 9, 3)
    assert got["NCHW output strides"][1] == 64 and got["NHWC output strides"][1] == 1
    assert conv.weight.is_contiguous()  # the model's own conv is left as it was


def test_mib():
    assert mech.mib(3 * 2**20) == "3.00 MiB" and mech.mib(2048) == "2.0 KiB"


def test_the_notebooks_reports_on_the_smoke_unet(tmp_path):
    """The SD, DreamBooth and ladder notebooks' mechanism cells, on the smoke UNet (built on meta, one block made
    real)."""
    from gallery_lib.recipes.profiles import base_config

    base = base_config("smoke", family="dreambooth", data_root=str(tmp_path), output_dir=str(tmp_path))
    geglu = mech.geglu_report(base)
    assert "replaced: MulBackward0, SplitBackward0, GeluBackward0 -> _GegluFunctionBackward" in geglu
    checkpointing = mech.checkpointing_report(base)
    assert f"batch {base.batch_size}" in checkpointing and "checkpointed:" in checkpointing
    attention = mech.attention_report(base)
    assert "of which the tokens x tokens matrix" in attention and "fused (scaled_dot_product_attention)" in attention
