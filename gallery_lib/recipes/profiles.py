"""Profiles: named presets that size a run to the machine, declared by each model family.

``smoke`` runs the real code path on a CPU in seconds (each family's CPU-sized model); ``full`` is the GPU benchmark
setting of each family. ``auto`` picks ``full`` when a CUDA GPU is visible, else ``smoke``. The sizes themselves are
the family's (``ModelFamily.run_profiles`` and ``data_profiles`` in ``gallery_lib/families/<family>.py``).
"""

from __future__ import annotations

import os
from typing import Any

from gallery_lib.config import ConfigError, RunConfig, families
from gallery_lib.run.memory_plan import CAP_ENV, NAMED

PROFILES = ("auto", "smoke", "full")


def resolve_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ConfigError(f"profile={profile!r} is not known: choose one of {', '.join(PROFILES)}.")
    if profile == "auto":
        import torch

        from gallery_lib.config.gpu_check import check_gpu_usable

        check_gpu_usable()  # a GPU torch cannot use is an error, not a quiet smoke run
        return "full" if torch.cuda.is_available() else "smoke"
    return profile


def resolve_family(family: str | None, model: str | None = None):
    """The ``ModelFamily``: the one named, else the family of ``model``, else the first registered."""
    if family is not None:
        return families.get_family(family)
    return families.family_of(model) if model is not None else next(iter(families.FAMILIES.values()))


def base_config(profile: str = "auto", *, family: str | None = None, data_root: str = "data",
                **overrides: Any) -> RunConfig:
    """The base config of ``profile`` for a model family, with ``overrides`` (``None`` values mean "keep the
    profile's"). The family defaults to that of ``model`` when one is given, else the first registered one.

    Unless ``data_dir`` is given, the profile's mock dataset lives in ``<data_root>/<dataset>_<profile>``.
    """
    profile = resolve_profile(profile)
    spec = resolve_family(family, overrides.get("model"))
    values: dict[str, Any] = dict(spec.run_profiles[profile], profile=profile)
    if profile == "full":
        nproc = overrides.get("nproc_per_node") or 1
        # Decode + augmentation is CPU-bound on a fast GPU: every core but two (the training process launches
        # kernels, the pin-memory thread copies batches). The same for every recipe, so runs compare.
        values["num_workers"] = max(2, min(14, (os.cpu_count() or 4) // nproc - 2))
    values["data_dir"] = os.path.join(data_root, f"{spec.dataset}_{profile}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in given and "warmup_steps" not in given:
        # Fewer steps than the profile's: keep warm-up to at most a third so timed steps remain.
        values["warmup_steps"] = min(values["warmup_steps"], given["steps"] // 3)
    values.update(given)
    if "image_size" not in given and values["model"] in spec.model_names():
        # A model named over the profile's tiny one: the profile's image size rounded up to one the model takes.
        multiple = spec.model_spec(values["model"]).image_size_multiple
        values["image_size"] = -(-values["image_size"] // multiple) * multiple
    if values.get("gpu_memory_gib") is None and os.environ.get(CAP_ENV):
        values["gpu_memory_gib"] = _cap_from_environment(os.environ[CAP_ENV])
    values["extra"] = {**values.get("extra", {}), NAMED: sorted(set(given) - {"extra"})}
    return RunConfig(**values)


def _cap_from_environment(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{CAP_ENV}={text!r} is invalid: expected the GiB a run may use on the GPU, e.g. 22 for a "
                          f"24 GB card; unset it to use the GPU's free memory.") from None


def data_spec(profile: str, family: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of the family's mock-data maker for ``profile`` (``None`` overrides are ignored)."""
    spec = resolve_family(family).data_profiles[resolve_profile(profile)]
    return {**spec, **{k: v for k, v in overrides.items() if v is not None}}
