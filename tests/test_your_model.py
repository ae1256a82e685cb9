"""The accelerations as one call each on a model the user brings (``gallery_lib.accel.on_any_model``): each changes
the module in place, says what it changed, computes the same function, and points at a section RESULTS.md has."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import gallery_lib
from gallery_lib.accel.on_any_model import (Change, accelerate, add_ema, compile_blocks, fuse_attention,
                                            fuse_kernels, repeated_block_type, use_channels_last)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyTransformer(nn.Module):
    """A model no family has: a stem, two repeated blocks, a head."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.stem = nn.Linear(10, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(1))


def _losses(model: nn.Module, steps: int = 3) -> list[float]:
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 5, 10), torch.randint(0, 3, (4,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_calls_are_public_and_documented_with_an_example():
    for name in ("accelerate", "use_channels_last", "fuse_kernels", "fuse_attention", "compile_blocks", "add_ema",
                 "AdamWWithEma"):
        assert name in gallery_lib.__all__
        call = getattr(gallery_lib, name)
        assert call.__doc__ and "    " in call.__doc__ and name in call.__doc__, name  # an indented example


def test_accelerate_on_a_cpu_compiles_the_blocks_and_trains_like_eager():
    """On a CPU, ``accelerate`` compiles the repeated blocks (the rest is GPU code); step by step the losses are
    eager's, and what it did is said in one line each."""
    torch.manual_seed(0)
    eager = TinyTransformer()
    model = copy.deepcopy(eager)
    said: list[str] = []
    changes = accelerate(model, echo=said.append)
    assert [c.name for c in changes] == ["compiled blocks"] and said == [str(c) for c in changes]
    assert changes[0].what.startswith("2 blocks compiled in place (2 Block)")
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model.state_dict().keys() == eager.state_dict().keys()
    torch.testing.assert_close(torch.tensor(_losses(model)), torch.tensor(_losses(eager)), rtol=1e-5, atol=1e-6)


def test_channels_last_counts_the_conv_weights_it_lays_out():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(2, 3, 9, 9)
    expected = model(x)
    change = use_channels_last(model)
    assert change.changed and change.what == "2 conv weights in NHWC layout"
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(model(x.to(memory_format=torch.channels_last)), expected)
    unchanged = use_channels_last(TinyTransformer())
    assert not unchanged.changed and "nothing to change" in unchanged.what


@pytest.fixture(scope="module")
def tiny_unet():
    from gallery_lib.models.sd_parts import build_stable_diffusion

    torch.manual_seed(0)
    return build_stable_diffusion("sd_tiny").unet


def test_fused_kernels_and_attention_on_a_diffusers_unet_keep_its_output(tiny_unet):
    """The GEGLU swap and the attention registry on a diffusers UNet: counted, and the same output (on a CPU the
    fused modules run their PyTorch reference; the GPU kernels are checked against it in the kernel tests)."""
    unet = copy.deepcopy(tiny_unet).eval()
    torch.manual_seed(0)
    latents, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 77, 32)
    with torch.no_grad():
        expected = unet(latents, t, text).sample
    kernels = fuse_kernels(unet, ops=["geglu"])
    assert kernels.changed and kernels.what == "swapped 4: geglu=4", kernels.what
    assert "left alone" in kernels.details and kernels.note.startswith("fused kernels: swapped 4: geglu=4\n")
    attention = fuse_attention(unet)
    assert attention.changed and re.match(r"\d+ diffusers attention layers", attention.what)
    with torch.no_grad():
        torch.testing.assert_close(unet(latents, t, text).sample, expected, rtol=1e-4, atol=1e-5)
    assert not fuse_attention(TinyTransformer()).changed
    nothing = fuse_kernels(TinyTransformer(), ops=["geglu"])
    assert not nothing.changed and nothing.what == "no layer the geglu kernels replace"
    with pytest.raises(ValueError, match="unknown op.*'gelu'"):
        fuse_kernels(unet, ops=["gelu"])


def test_swin_window_attention_goes_through_the_registry_and_keeps_its_output():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=5, img_size=56,
                             depths=(1, 1), num_heads=(2, 4), embed_dim=16).eval()
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        expected = swin(x)
    change = fuse_attention(swin)
    assert change.changed and change.what.startswith("2 Swin window-attention modules"), change.what
    with torch.no_grad():
        torch.testing.assert_close(swin(x), expected, rtol=1e-4, atol=1e-5)


def test_the_repeated_block_is_found_in_models_no_family_has(tiny_unet):
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10)
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    assert repeated_block_type(vit).__name__ == "Block"
    assert repeated_block_type(convnext).__name__ == "ConvNeXtBlock"
    assert repeated_block_type(TinyTransformer()) is Block
    with pytest.raises(ValueError, match="no repeated block"):
        repeated_block_type(nn.Sequential(nn.Linear(2, 2)))
    change = compile_blocks(copy.deepcopy(tiny_unet))  # a gallery family's blocks: the family's choice, not a guess
    assert "BasicTransformerBlock" not in change.what and "Transformer2DModel" in change.what


def test_an_ema_says_how_it_updates_on_this_machine():
    """On a CPU ``auto`` updates with PyTorch's multi-tensor ops; ``fused`` asked for there falls back and says
    why; the average moves by ``1 - decay`` of the distance to the weights (no warm-up ramp)."""
    model = TinyTransformer()
    said: list[str] = []
    ema = add_ema(model, decay=0.9, ratio_warmup=False, echo=said.append)
    assert ema.effective_mode == "foreach" and said == [str(ema.change)]
    assert ema.change.what == "foreach update, decay 0.9"
    ema.update(model)  # the first update copies the weights
    before = model.head.weight.detach().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)  # then each moves 1 - decay of the way
    torch.testing.assert_close(ema.module.head.weight, before + 0.1)
    fused = add_ema(model, mode="fused", echo=None)
    assert fused.effective_mode == "foreach" and "(fused asked, but the EMA lives on cpu)" in fused.change.what


def test_a_public_adamw_takes_the_ema_into_its_pass():
    """``gallery_lib.AdamWWithEma`` is torch's fused AdamW whose step also averages the EMA ``add_ema`` attaches:
    the change says so, and the average follows the weights as a separate EMA would (on a CPU without Triton's
    interpreter the step is torch's, the average its own pass)."""
    model, plain = TinyTransformer(), TinyTransformer()
    plain.load_state_dict(model.state_dict())
    optimizer = gallery_lib.AdamWWithEma(model.parameters(), lr=1e-2)
    ema = add_ema(model, optimizer, decay=0.9, ratio_warmup=False, echo=None)
    assert ema.change.what.startswith("in the fused AdamW's pass") and "adamw-ema" in ema.change.measured
    reference_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    reference = add_ema(plain, decay=0.9, ratio_warmup=False, echo=None)
    tokens = torch.randn(4, 8, 10, generator=torch.Generator().manual_seed(0))
    for net, opt, average in ((model, optimizer, ema), (plain, reference_optimizer, reference)):
        for _ in range(3):
            net(tokens).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            average.update(net)
    torch.testing.assert_close(ema.module.head.weight, reference.module.head.weight)


def test_every_change_points_at_a_section_results_has(tiny_unet):
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', RESULTS.read_text(encoding="utf-8")))
    changes = [use_channels_last(TinyTransformer()), fuse_kernels(copy.deepcopy(tiny_unet), ops=["geglu"]),
               fuse_attention(TinyTransformer()), compile_blocks(TinyTransformer()),
               add_ema(TinyTransformer(), echo=None).change]
    for change in changes:
        assert isinstance(change, Change) and change.why
        assert change.measured.split("#")[1] in anchors, change.measured
        assert str(change) == f"{change.name}: {change.what}. Why: {change.why} ({change.measured})"


@pytest.mark.gpu
def test_gpu_accelerate_a_diffusers_unet_trains_like_eager(tiny_unet):
    """On a GPU, ``accelerate`` lays the UNet out channels_last, fuses its GEGLU and compiles its blocks as CUDA
    graphs; three fp32 training steps give eager's losses."""
    eager = copy.deepcopy(tiny_unet).cuda()
    model = copy.deepcopy(tiny_unet).cuda()
    changes = accelerate(model, echo=None)
    assert [c.name for c in changes] == ["channels_last", "fused kernels", "compiled blocks"]
    assert all(c.changed for c in changes) and "CUDA graphs" in changes[-1].what

    def losses(unet, channels_last):
        torch.manual_seed(1)
        optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
        out = []
        for _ in range(3):
            latents = torch.randn(2, 4, 8, 8, device="cuda")
            if channels_last:
                latents = latents.to(memory_format=torch.channels_last)
            t, text = torch.tensor([10, 500], device="cuda"), torch.randn(2, 77, 32, device="cuda")
            loss = unet(latents, t, text).sample.float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out
    torch.testing.assert_close(torch.tensor(losses(model, True)), torch.tensor(losses(eager, False)),
                               rtol=2e-3, atol=1e-5)
