"""What the notebooks' previews say before a run: only what runs on the device in use (no CUDA graphs and no GPU-only
channels_last on a CPU), and any timm model built at a small size, CNNs included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gallery_lib import base_config
from gallery_lib.accel.on_any_model import compile_blocks, fuse_kernels, use_channels_last
from gallery_lib.models import create_timm_model
from gallery_lib.reports.recipe_preview import recipe_changes


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4)

    def forward(self, x):
        return x + self.norm(self.conv(x))


def _convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), _Block(), _Block(), _Block())


def test_compile_blocks_names_cuda_graphs_only_where_they_replay():
    """``mode="reduce-overhead"`` replays CUDA graphs on a GPU only: a CPU model's change does not claim them, a GPU's
    does, and a structure on the meta device (a preview) says they need a GPU."""
    on_cpu = compile_blocks(_convnet(), mode="reduce-overhead")
    assert "3 blocks compiled in place (3 _Block)" in on_cpu.what and "CUDA graphs" not in str(on_cpu)
    with torch.device("meta"):
        meta = _convnet()
    assert "CUDA graphs" not in str(compile_blocks(meta, mode="reduce-overhead", device_type="cpu"))
    with torch.device("meta"):
        meta = _convnet()
    assert "(3 _Block, CUDA graphs)" in compile_blocks(meta, mode="reduce-overhead", device_type="cuda").what
    with torch.device("meta"):
        meta = _convnet()
    assert "CUDA graphs where it runs on a GPU" in compile_blocks(meta, mode="reduce-overhead").what


def test_layout_and_kernels_say_on_a_cpu_that_their_reason_is_a_gpus():
    cpu_layout = use_channels_last(_convnet())
    assert cpu_layout.changed and cpu_layout.what == "4 conv weights in NHWC layout"
    assert cpu_layout.why.startswith("on a GPU, ") and "on a CPU the layout is applied all the same" in cpu_layout.why
    with torch.device("meta"):
        gpu_layout = use_channels_last(_convnet(), device_type="cuda")
    assert gpu_layout.why == "convolutions on tensor cores read NHWC without transposing"
    kernels = fuse_kernels(_convnet(), ops=["group_norm_silu"])
    assert "on a CPU the swapped modules run their PyTorch reference, not a fused kernel" in kernels.why


def _unet(base):
    with torch.device("meta"):
        return base.model_family.build(base.model, image_size=base.image_size).unet


def test_the_recipe_preview_on_a_cpu_shows_what_a_cpu_run_does():
    """Stable Diffusion's accelerated recipe on a CPU: channels_last left out (a GPU-only switch), GEGLU swapped, the
    blocks compiled without graphs: what the recipe table says for that run."""
    base = base_config("smoke", family="stable_diffusion", device="cpu")
    said = []
    changes = recipe_changes(base, _unet(base), echo=said.append)
    assert [c.name for c in changes] == ["channels_last", "fused kernels", "compiled blocks"]
    layout, kernels, blocks = changes
    assert not layout.changed and layout.what.startswith("left out on a CPU")
    assert kernels.what == "swapped 4: geglu=4" and "12 blocks compiled in place" in blocks.what
    assert said == [str(c) for c in changes] and not any("CUDA graphs" in line for line in said)


def test_the_recipe_preview_on_a_gpu_shows_the_gpu_switches(monkeypatch):
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setattr("gallery_lib.reports.recipe_preview.runs_on_gpu", lambda base: True)
    sd = base_config("smoke", family="stable_diffusion")
    layout, _, blocks = recipe_changes(sd, _unet(sd), echo=None)
    assert layout.changed and layout.what.endswith("conv weights in NHWC layout")
    assert blocks.what.split(";")[0].endswith(", CUDA graphs)")  # small steps: the blocks replay as graphs
    dreambooth = base_config("smoke", family="dreambooth")
    whole = recipe_changes(dreambooth, _unet(dreambooth), echo=None)[-1]
    assert whole.name == "compiled model" and "mode reduce-overhead, CUDA graphs" in whole.what
    results = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    assert f'<a id="{whole.measured.split("#")[1]}"></a>' in results


@pytest.mark.parametrize("name", ["resnet10t", "convnext_atto", "vit_tiny_patch16_224"])
def test_any_timm_model_builds_at_a_small_size(name):
    """The your_model notebook's model: ``img_size`` goes only to models sized at build (the ViT: its position
    embeddings), never to CNNs, whose constructors refuse it."""
    torch.manual_seed(0)
    model = create_timm_model(name, image_size=32, num_classes=10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    if name.startswith("vit"):
        assert model.pos_embed.shape[1] == (32 // 16) ** 2 + 1  # built for 32 px, not the default 224
    else:
        import timm

        with pytest.raises(TypeError, match="img_size"):  # what the notebook passed before: every CNN refused it
            timm.create_model(name, pretrained=False, num_classes=10, img_size=32)


@pytest.mark.parametrize("on_cuda", [False, True])
def test_optimize_quotes_its_choice_as_a_speedup_on_a_gpu_only(on_cuda):
    """On a CPU a few timed steps pick the candidate to keep; the reason gives their times, not a ratio."""
    from gallery_lib.accel.optimize import CANDIDATES, CandidateResult, _Chooser, _Trial

    said: list[str] = []
    chooser = _Chooser(nn.Linear(2, 2), "auto", None, 1, 2, None, said.append)
    chooser._on_cuda = on_cuda
    chooser.trials = [_Trial(CANDIDATES["eager"], result=CandidateResult("eager", compile_time_s=0.0, steady_ms=10.0)),
                      _Trial(CANDIDATES["inductor"],
                             result=CandidateResult("inductor", compile_time_s=1.5, steady_ms=5.0))]
    chooser._decide()
    assert chooser.report.choice == "inductor" and said == [f"optimize: chose inductor: {chooser.report.reason}"]
    if on_cuda:
        assert chooser.report.reason.startswith("fastest steady step 5.00 ms, 2.00x eager (10.00 ms)")
    else:
        assert "x eager" not in chooser.report.reason and "vs eager (10.00 ms)" in chooser.report.reason
