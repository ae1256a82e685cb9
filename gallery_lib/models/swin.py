"""Swin Transformer models from timm: Swin-T for GPU runs and a micro variant for CPU smoke runs.

Fused window attention (``fused_attention=True``) is `gallery_lib.attention.hook_swin_attention`, not timm's own
SDPA switch (``TIMM_FUSED_ATTN=2``): with the bias as a mask, plain SDPA picks cuDNN on an H100, 1.8-3.4x slower
than the memory-efficient kernel the registry picks (``benchmarks/results/attention_h100.json``).
"""

from __future__ import annotations

import torch


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
