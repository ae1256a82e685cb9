"""Model parts that families and tasks share: the Stable Diffusion parts (``sd_parts``), the offline CLIP tokenizer
(``offline_tokenizer``) and FLOP counting (``flops``). The families themselves live in ``gallery_lib.families``.

``build_model(name, **kwargs)`` builds any gallery model by name (its family's builder, through the registry).
"""

from __future__ import annotations

from gallery_lib.config.families import build_model

__all__ = ["build_model"]
