"""The gallery's own families, in the order ``gallery list`` shows them (the first is the default family). The
registry loads them through the entry point that ``pyproject.toml`` names."""

from __future__ import annotations

from gallery_lib.families import dreambooth, resnet, stable_diffusion, swin

BUILTIN = (swin.FAMILY, stable_diffusion.FAMILY, resnet.FAMILY, dreambooth.FAMILY)
