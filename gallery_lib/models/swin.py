"""Swin Transformer models from timm: Swin-T for GPU runs and a micro variant for CPU smoke runs.

Also holds the Swin-specific switch for fused window attention: timm's ``WindowAttention`` can
run ``scaled_dot_product_attention`` with the relative-position bias and shift mask as an additive
mask (timm enables it only with ``TIMM_FUSED_ATTN=2``); we flip it per instance instead of through
the process-wide environment variable.
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


def set_fused_window_attention(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switches every timm ``WindowAttention`` in ``model`` to (or from) the SDPA path; returns how many."""
    from timm.models.swin_transformer import WindowAttention

    count = 0
    for module in model.modules():
        if isinstance(module, WindowAttention):
            module.fused_attn = enabled
            count += 1
    return count
