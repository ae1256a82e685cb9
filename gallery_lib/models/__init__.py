"""Model parts that families and tasks share: the Stable Diffusion parts (``sd_parts``), the offline CLIP tokenizer
(``offline_tokenizer``), FLOP counting (``flops``) and any timm model by name (``create_timm_model``). The families
themselves live in ``gallery_lib.families``.

``build_model(name, **kwargs)`` builds any gallery model by name (its family's builder, through the registry).
"""

from __future__ import annotations

from gallery_lib.config.families import build_model
from gallery_lib.models.timm_models import create_timm_model

__all__ = ["build_model", "create_timm_model"]
