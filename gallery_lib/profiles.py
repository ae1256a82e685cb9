"""Profiles: named presets that size a run to the machine.

``smoke`` runs the real code path on a CPU in seconds (a micro Swin at 64 px, tiny data).
``full`` is the GPU benchmark setting from the issue (Swin-T at 224 px, batch 128).
``auto`` picks ``full`` when a CUDA GPU is visible, else ``smoke``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gallery_lib.config import ConfigError, RunConfig

PROFILES = ("auto", "smoke", "full")


@dataclass(frozen=True)
class DataSpec:
    """Size of the mock ImageNet-like dataset that a profile prepares."""

    num_classes: int
    train_per_class: int
    val_per_class: int
    image_size: int


_PROFILE_RUNS: dict[str, dict[str, Any]] = {
    "smoke": dict(model="swin_micro", image_size=64, batch_size=8, steps=16, warmup_steps=4, log_every=4,
                  lr=3e-3, lr_warmup_steps=2, num_workers=1),
    "full": dict(model="swin_tiny_patch4_window7_224", image_size=224, batch_size=128, steps=100, warmup_steps=30,
                 log_every=10, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25),
}
_PROFILE_DATA: dict[str, DataSpec] = {
    "smoke": DataSpec(num_classes=10, train_per_class=24, val_per_class=4, image_size=72),
    "full": DataSpec(num_classes=100, train_per_class=80, val_per_class=10, image_size=256),
}


def resolve_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ConfigError(f"profile={profile!r} is not known: choose one of {', '.join(PROFILES)}.")
    if profile == "auto":
        import torch

        return "full" if torch.cuda.is_available() else "smoke"
    return profile


def base_config(profile: str = "auto", *, data_root: str = "data", **overrides: Any) -> RunConfig:
    """The base config of ``profile`` with ``overrides`` (``None`` values mean "keep the profile's").

    Unless ``data_dir`` is given, the profile's mock dataset lives in ``<data_root>/imagenet_like_<profile>``.
    """
    profile = resolve_profile(profile)
    values: dict[str, Any] = dict(_PROFILE_RUNS[profile], profile=profile)
    if profile == "full":
        nproc = overrides.get("nproc_per_node") or 1
        # Decode + RandAugment is CPU-bound past ~3,000 img/s: every core but two (the training process
        # launches kernels, the pin-memory thread copies batches). The same for every recipe, so runs compare.
        values["num_workers"] = max(2, min(14, (os.cpu_count() or 4) // nproc - 2))
    values["data_dir"] = os.path.join(data_root, f"imagenet_like_{profile}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in given and "warmup_steps" not in given:
        # Fewer steps than the profile's: keep warm-up to at most a third so timed steps remain.
        values["warmup_steps"] = min(values["warmup_steps"], given["steps"] // 3)
    values.update(given)
    return RunConfig(**values)


def data_spec(profile: str, **overrides: Any) -> DataSpec:
    spec = _PROFILE_DATA[resolve_profile(profile)]
    return DataSpec(**{**spec.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
