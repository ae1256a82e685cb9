"""Any timm model by name, at an image size, whether its input size is fixed when it is built (ViTs, Swin) or not
(convolutional networks): what ``gallery bench --timm-model`` and the ``your_model`` notebook train."""

from __future__ import annotations

from typing import Any

from torch import nn


def create_timm_model(name: str, *, image_size: int | None = None, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **kwargs)`` at ``image_size``, for any timm model. The size is
    passed (as ``img_size``) only to the models whose input size is fixed when they are built (ViTs, Swin: their
    position embeddings and windows are sized by it); convolutional networks (ResNet, ConvNeXt, EfficientNet) take
    any image size as built and have no such argument.

        model = create_timm_model("resnet18", image_size=32, num_classes=1000)
    """
    import timm

    kwargs.setdefault("pretrained", False)
    if image_size is None or _takes_any_size(name):
        return timm.create_model(name, **kwargs)
    try:
        return timm.create_model(name, img_size=image_size, **kwargs)
    except TypeError as exc:  # a model without the argument that its pretrained config does not describe
        if "img_size" not in str(exc):
            raise
        return timm.create_model(name, **kwargs)


def _takes_any_size(name: str) -> bool:
    """Whether timm's pretrained config of ``name`` says its input size is not fixed (a convolutional network)."""
    from timm.models import get_pretrained_cfg

    try:
        cfg = get_pretrained_cfg(name)
    except Exception:  # a name with no pretrained config: let the model's own signature decide
        return False
    return cfg is not None and not getattr(cfg, "fixed_input_size", True)
