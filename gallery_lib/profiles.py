"""Profiles: named presets that size a run to the machine.

``smoke`` runs the real code path on a CPU in seconds (a micro Swin at 64 px, a tiny Stable Diffusion at 32 px).
``full`` is the GPU benchmark setting of each model's issue (Swin-T at 224 px, batch 128; SD 1.5 at 512 px, batch 8).
``auto`` picks ``full`` when a CUDA GPU is visible, else ``smoke``. Profiles are kept per model family.
"""

from __future__ import annotations

import os
from typing import Any

from gallery_lib.config import ConfigError, RunConfig

PROFILES = ("auto", "smoke", "full")
DEFAULT_FAMILY = "swin_transformer"

_PROFILE_RUNS: dict[str, dict[str, dict[str, Any]]] = {
    "swin_transformer": {
        "smoke": dict(model="swin_micro", image_size=64, batch_size=8, steps=16, warmup_steps=4, log_every=4,
                      lr=3e-3, lr_warmup_steps=2, num_workers=1),
        "full": dict(model="swin_tiny_patch4_window7_224", image_size=224, batch_size=128, steps=100,
                     warmup_steps=30, log_every=10, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25),
    },
    # diffusers train_text_to_image defaults: AdamW lr 1e-4, weight decay 1e-2, gradient clipping at 1.0, EMA
    # (use_ema). No Mixup or label smoothing: those belong to classification.
    "stable_diffusion": {
        "smoke": dict(model="sd_tiny", image_size=32, batch_size=4, steps=16, warmup_steps=4, log_every=4,
                      lr=1e-3, lr_warmup_steps=2, num_workers=1, weight_decay=1e-2, clip_grad=1.0, ema="foreach",
                      mixup_alpha=0.0, cutmix_alpha=0.0, label_smoothing=0.0),
        "full": dict(model="sd15", image_size=512, batch_size=8, steps=100, warmup_steps=30, log_every=10,
                     lr=1e-4, lr_warmup_steps=10, weight_decay=1e-2, clip_grad=1.0, ema="foreach",
                     mixup_alpha=0.0, cutmix_alpha=0.0, label_smoothing=0.0),
    },
}
_PROFILE_DATA: dict[str, dict[str, dict[str, int]]] = {
    "swin_transformer": {
        "smoke": dict(num_classes=10, train_per_class=24, val_per_class=4, image_size=72),
        "full": dict(num_classes=100, train_per_class=80, val_per_class=10, image_size=256),
    },
    "stable_diffusion": {
        "smoke": dict(num_images=32, image_size=32),
        "full": dict(num_images=512, image_size=512),
    },
}
_DATASET_NAME = {"swin_transformer": "imagenet_like", "stable_diffusion": "captions"}


def resolve_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ConfigError(f"profile={profile!r} is not known: choose one of {', '.join(PROFILES)}.")
    if profile == "auto":
        import torch

        return "full" if torch.cuda.is_available() else "smoke"
    return profile


def resolve_family(family: str | None, model: str | None = None) -> str:
    """The model family: given, else the family of ``model``, else the Swin gallery's."""
    from gallery_lib.models import MODELS

    if family is None:
        family = MODELS[model].family if model in MODELS else DEFAULT_FAMILY
    if family not in _PROFILE_RUNS:
        raise ConfigError(f"family={family!r} is not known: choose one of {', '.join(_PROFILE_RUNS)}.")
    return family


def base_config(profile: str = "auto", *, family: str | None = None, data_root: str = "data",
                **overrides: Any) -> RunConfig:
    """The base config of ``profile`` for a model family, with ``overrides`` (``None`` values mean "keep the
    profile's"). The family defaults to that of ``model`` when one is given, else Swin.

    Unless ``data_dir`` is given, the profile's mock dataset lives in ``<data_root>/<dataset>_<profile>``.
    """
    profile = resolve_profile(profile)
    family = resolve_family(family, overrides.get("model"))
    values: dict[str, Any] = dict(_PROFILE_RUNS[family][profile], profile=profile)
    if profile == "full":
        nproc = overrides.get("nproc_per_node") or 1
        # Decode + RandAugment is CPU-bound past ~3,000 img/s: every core but two (the training process
        # launches kernels, the pin-memory thread copies batches). The same for every recipe, so runs compare.
        values["num_workers"] = max(2, min(14, (os.cpu_count() or 4) // nproc - 2))
    values["data_dir"] = os.path.join(data_root, f"{_DATASET_NAME[family]}_{profile}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in given and "warmup_steps" not in given:
        # Fewer steps than the profile's: keep warm-up to at most a third so timed steps remain.
        values["warmup_steps"] = min(values["warmup_steps"], given["steps"] // 3)
    values.update(given)
    return RunConfig(**values)


def data_spec(profile: str, family: str = DEFAULT_FAMILY, **overrides: Any) -> dict[str, int]:
    """Keyword arguments of the family's mock-data generator for ``profile`` (``None`` overrides are ignored)."""
    spec = _PROFILE_DATA[resolve_family(family)][resolve_profile(profile)]
    return {**spec, **{k: v for k, v in overrides.items() if v is not None}}
