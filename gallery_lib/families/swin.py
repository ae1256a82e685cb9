"""The Swin Transformer family: timm's Swin-T for GPU runs and a micro variant for CPU smoke runs."""

from __future__ import annotations

import torch

from gallery_lib.config.family import Footprint, ModelFamily, ModelSpec, SpeedGoal
from gallery_lib.tasks.classification import ClassificationTask


def build_swin_tiny(*, num_classes: int, image_size: int = 224, pretrained_file: str | None = None) -> torch.nn.Module:
    import timm

    kwargs = {"num_classes": num_classes, "img_size": image_size}
    if pretrained_file:
        # timm loads a local checkpoint through pretrained_cfg_overlay; the head is re-sized for num_classes.
        return timm.create_model("swin_tiny_patch4_window7_224", pretrained=True,
                                 pretrained_cfg_overlay={"file": pretrained_file}, **kwargs)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **kwargs)


def build_swin_micro(*, num_classes: int, image_size: int = 64, pretrained_file: str | None = None) -> torch.nn.Module:
    """Two stages of shifted-window blocks at 64 px: 16x16 then 8x8 tokens in 4x4 windows."""
    from timm.models.swin_transformer import SwinTransformer

    if pretrained_file:
        raise ValueError("swin_micro is a CPU smoke-test model with no pretrained weights; drop pretrained_file.")
    return SwinTransformer(img_size=image_size, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2),
                           num_heads=(2, 4), num_classes=num_classes, drop_path_rate=0.0)


def hook_window_attention(model: torch.nn.Module):
    """Window attention through ``gallery_lib.accel.attention`` (not timm's own SDPA switch, whose bias-as-mask call
    makes PyTorch pick a slower kernel: benchmarks/RESULTS.md#attention), by the call a model of the user's takes."""
    from gallery_lib.accel.on_any_model import fuse_attention
    from gallery_lib.config.settings import ConfigError

    try:
        change = fuse_attention(model)
    except ValueError as exc:  # attention dropout the kernels do not apply
        raise ConfigError(f"fused_attention=True cannot apply to {type(model).__name__}: {exc}; "
                          "run without it (--set fused_attention=false)") from exc
    if change.handle is None:
        raise ConfigError(f"fused_attention=True cannot apply to {type(model).__name__}: it has no timm "
                          "WindowAttention; run without it (--set fused_attention=false)")
    return change.note, change.handle


def _make_dataset(path, **spec):
    from data_prep.imagenet_like import make_imagenet_like

    return make_imagenet_like(path, **spec)


FAMILY = ModelFamily(
    name="swin_transformer",
    task=ClassificationTask,
    models=(
        ModelSpec("swin_tiny_patch4_window7_224", build_swin_tiny, 224, False,
                  "Swin-T (timm), 28M parameters, 4.5 GFLOP/image forward at 224 px"),
        ModelSpec("swin_micro", build_swin_micro, 64, True,
                  "a 2-stage Swin with the same blocks (shifted windows, relative position bias) for CPU smoke runs"),
    ),
    run_profiles={
        "smoke": dict(model="swin_micro", image_size=64, batch_size=8, steps=16, warmup_steps=4, log_every=4,
                      lr=3e-3, lr_warmup_steps=2, num_workers=1),
        "full": dict(model="swin_tiny_patch4_window7_224", image_size=224, batch_size=128, steps=100,
                     warmup_steps=30, log_every=10, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25),
    },
    data_profiles={
        "smoke": dict(num_classes=10, train_per_class=24, val_per_class=4, image_size=72),
        "full": dict(num_classes=100, train_per_class=80, val_per_class=10, image_size=256),
    },
    dataset="imagenet_like",
    make_dataset=_make_dataset,
    # kept: window attention through the registry, 1.18x compiled on an H100 (benchmarks/RESULTS.md#swin); CUDA
    # graphs, which end the bimodal step times (benchmarks/RESULTS.md#bench-h100); channels_last images, which the
    # patch-embedding convolution reads without cuDNN's conversion (benchmarks/RESULTS.md#swin-channels-last)
    accelerated={"fused_attention": True},
    accelerated_on_gpu={"compile_mode": "reduce-overhead", "channels_last": True},
    # timm's train.py offers --channels-last: the peer's step is 4% faster with it (#swin-peer-channels-last)
    peer={"channels_last": True},
    block_types=("SwinTransformerBlock",),
    block_modules=("gallery_lib.families.swin",),
    attention_hook=hook_window_attention,
    # against the fair peer (channels_last, CUDA graphs) at batch 128, steady steps included (benchmarks/RESULTS.md#head)
    speed_goals=(SpeedGoal("speedup", "swin_tiny_patch4_window7_224",
                           dict(batch_size=128, min_ratio=1.4, max_spread=1.05)),),
    # one H200, the larger of the runs each (#window-attention-sweep, #memory-plan)
    memory_footprints=(
        Footprint("swin_tiny_patch4_window7_224", "accelerated", {128: 7.45}, samples_per_s={128: 6105.2},
                  source="memory_plan_h200/caps_swin_22.json"),
        Footprint("swin_tiny_patch4_window7_224", "peer", {128: 8.43}, samples_per_s={128: 4528.3},
                  source="swin_window_sweep_h200/bench_swin_wa.json"),
        Footprint("swin_tiny_patch4_window7_224", "compiled", {128: 8.22}, samples_per_s={128: 4088.3},
                  source="memory_plan_h200/caps_swin_22.json"),
        Footprint("swin_tiny_patch4_window7_224", "baseline", {128: 9.63}, samples_per_s={128: 1761.3},
                  source="memory_plan_h200/caps_swin_22.json"),
    ),
)
