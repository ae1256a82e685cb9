"""apply_kernels: what it swaps, outputs and grads unchanged, state_dict strict round trips, undo restores exactly."""

import pickle

import pytest
import torch
from compile_testing import aot_graphs
from torch import nn

from gallery_lib.accel.kernels.modules import FusedGEGLU, FusedGroupNorm, FusedLayerNorm
from gallery_lib.accel.kernels.patch import apply_kernels, revert_kernels

diffusers = pytest.importorskip("diffusers")
swin = pytest.importorskip("timm.models.swin_transformer")


def tiny_unet():
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=4, sample_size=16, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def tiny_swin():
    torch.manual_seed(0)
    return swin.SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=24, depths=(2, 2),
                                num_heads=(2, 4), num_classes=10, drop_path_rate=0.0)


def unet_inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, 16, 16, generator=gen), torch.tensor([3, 500]), torch.randn(2, 5, 32, generator=gen)


def forward_and_grads(model, run):
    model.zero_grad()
    out = run(model)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_function(model, patched_run, baseline):
    out, grads = forward_and_grads(model, patched_run)
    torch.testing.assert_close(out, baseline[0], atol=1e-5, rtol=1e-5)
    assert grads.keys() == baseline[1].keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, baseline[1][name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_unet_swap_report_state_dict_and_undo():
    unet = tiny_unet()
    run = lambda m: m(*unet_inputs()).sample  # noqa: E731
    baseline = forward_and_grads(unet, run)
    originals = dict(unet.named_modules())
    keys = list(unet.state_dict())
    resnets = [m for m in unet.modules() if type(m).__name__ == "ResnetBlock2D"]
    n_group_norms = sum(type(m) is nn.GroupNorm for m in unet.modules())
    n_layer_norms = sum(type(m) is nn.LayerNorm for m in unet.modules())

    report = apply_kernels(unet)

    counts = report.counts
    # norm1 and norm2 of every ResnetBlock2D ("default" time embedding) plus conv_norm_out are fused with SiLU.
    assert counts["group_norm_silu"] == 2 * len(resnets) + 1 and counts["silu_folded"] == 1
    assert counts["group_norm_silu"] + counts.get("group_norm", 0) == n_group_norms
    assert counts["layer_norm"] == n_layer_norms and counts["geglu"] == 2 * 2  # 2 attention blocks per cross stage
    assert not any(type(m) in (nn.GroupNorm, nn.LayerNorm) for m in unet.modules())
    assert all(isinstance(r.norm1, FusedGroupNorm) and r.norm1.activation == "silu" for r in resnets)
    assert all("forward" in vars(r) for r in resnets)
    assert ("conv_norm_out", "group_norm_silu") in report.swapped and "swapped" in report.summary()
    assert isinstance(unet.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0], FusedGEGLU)
    assert unet.conv_norm_out.weight is originals["conv_norm_out"].weight  # parameters are shared, not copied
    assert list(unet.state_dict()) == keys
    assert_same_function(unet, run, baseline)
    # The patched blocks survive pickling (precompile workers load them so; whole-module torch.save too).
    copied = pickle.loads(pickle.dumps(unet))
    torch.testing.assert_close(run(copied), baseline[0], atol=1e-5, rtol=1e-5)

    fresh = tiny_unet()
    fresh.load_state_dict(unet.state_dict(), strict=True)  # patched checkpoint -> baseline model
    apply_kernels(fresh).undo()
    unet.load_state_dict(fresh.state_dict(), strict=True)  # baseline checkpoint -> patched model

    revert_kernels(unet, report)
    assert report.undone and dict(unet.named_modules()).keys() == originals.keys()
    assert all(unet.get_submodule(n) is m for n, m in originals.items())
    assert not any("forward" in vars(r) for r in resnets)
    assert_same_function(unet, run, baseline)


def test_swin_layer_norms_swapped_and_restored():
    model = tiny_swin()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    baseline = forward_and_grads(model, lambda m: m(x))
    n_layer_norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    keys = list(model.state_dict())
    report = apply_kernels(model)
    assert report.counts == {"layer_norm": n_layer_norms} and n_layer_norms > 0
    assert list(model.state_dict()) == keys
    assert_same_function(model, lambda m: m(x), baseline)
    report.undo()
    assert sum(isinstance(m, FusedLayerNorm) for m in model.modules()) == 0
    assert_same_function(model, lambda m: m(x), baseline)


def test_flags_and_reasons_for_what_is_left_alone():
    class MyGroupNorm(nn.GroupNorm):
        pass

    shared = nn.LayerNorm(8)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8), MyGroupNorm(2, 8), nn.SiLU(),
                          nn.Flatten(2), nn.LayerNorm((8, 8)), shared, nn.Sequential(shared))
    report = apply_kernels(model, layer_norm=False)
    assert report.counts == {"group_norm": 1}
    reasons = dict(report.skipped)
    assert "MyGroupNorm" in reasons["2"] and reasons["5"] == "layer_norm=False"
    # The log has one line per reason, however many modules share it.
    lines = report.summary().splitlines()
    assert len(lines) == 1 + len(set(reasons.values()))
    assert any(line.strip().startswith("left alone") and "(layer_norm=False)" in line for line in lines[1:])
    assert len(report.summary(verbose=True).splitlines()) == 1 + len(reasons)  # verbose: every module
    report.undo()
    report = apply_kernels(model)
    assert "not the last dim" in dict(report.skipped)["5"]
    # A module attached at two places is swapped at both (and restored at both).
    assert model[6] is model[7][0] and isinstance(model[6], FusedLayerNorm)
    report.undo()
    assert model[6] is shared and model[7][0] is shared


def test_resnet_block_scale_shift_keeps_norm2_unfused():
    torch.manual_seed(0)
    block = diffusers.models.resnet.ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=12, groups=4,
                                                  time_embedding_norm="scale_shift")
    x, temb = torch.randn(2, 8, 6, 6), torch.randn(2, 12)
    expected = block(x, temb)
    report = apply_kernels(block)
    assert report.counts == {"group_norm_silu": 1, "group_norm": 1} and block.norm2.activation is None
    torch.testing.assert_close(block(x, temb), expected, atol=1e-5, rtol=1e-5)


def test_rejects_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        apply_kernels(lambda x: x)


def test_config_kernel_ops_choose_what_the_run_swaps():
    from gallery_lib.accel.accelerate import apply_accelerations
    from gallery_lib.config import ConfigError, RunConfig
    from gallery_lib.accel.distributed import DistInfo
    from gallery_lib.accel.precision import Precision

    cfg = RunConfig(model="sd_tiny", device="cpu", amp_level="O0", kernels=True, kernel_ops="geglu")
    assert cfg.kernel_op_names == ("geglu",)
    model = tiny_unet()
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    notes = apply_accelerations(model, cfg, Precision.from_settings(cfg.sections.precision, "cpu"), dist).notes
    kinds = {type(m) for m in model.modules()}
    assert FusedGEGLU in kinds and FusedGroupNorm not in kinds and FusedLayerNorm not in kinds
    assert any("geglu=" in note and "group_norm" not in note.split("\n")[0] for note in notes), notes
    assert RunConfig(model="sd_tiny").kernel_op_names == ("group_norm_silu", "layer_norm", "geglu")
    for bad in ("", "geglu,softmax", 3):
        with pytest.raises(ConfigError, match="kernel_ops"):
            RunConfig(model="sd_tiny", kernel_ops=bad)


@pytest.mark.isa
def test_on_a_cpu_the_fused_layers_compile_to_the_graphs_of_the_layers_they_replace():
    """Traced on a CPU, the fused layers hand the compiler the replaced layers' own ops, touched in the same order, so
    that a patched model and a plain one share compiled graphs (the CPU ladder's block rungs load one set)."""
    plain, fused = tiny_unet(), tiny_unet()
    assert {"group_norm_silu", "layer_norm", "geglu"} <= set(apply_kernels(fused).counts)
    gen = torch.Generator().manual_seed(2)
    x, temb, text = torch.randn(2, 32, 8, 8, generator=gen), torch.randn(2, 128, generator=gen), torch.randn(
        2, 5, 32, generator=gen)
    calls = {"resnet block": lambda unet: lambda: unet.down_blocks[0].resnets[0](x, temb),
             "transformer": lambda unet: lambda: unet.down_blocks[0].attentions[0](x, text, return_dict=False)[0]}
    for name, call in calls.items():
        plain_graphs, fused_graphs = aot_graphs(call(plain)), aot_graphs(call(fused))
        assert len(fused_graphs) == 2, name  # one forward, one backward
        assert fused_graphs == plain_graphs, name  # node for node, inputs in the same order


def test_the_config_offers_exactly_the_ops_of_the_swap_table():
    from gallery_lib.accel.kernels.patch import KERNEL_OPS as TABLE_OPS
    from gallery_lib.config import KERNEL_OPS

    assert set(KERNEL_OPS) == set(TABLE_OPS)
