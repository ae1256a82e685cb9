"""``RunConfig``'s sections, in torchtitan's manner: one frozen dataclass per concern, each field declared with its
rules (``setting``) and docstring, each section's ``check()`` holding the rules that involve only its fields (a
``Section`` checks its fields, then them, as it is built).

A field keeps one name in every spelling: flat (``lr``, as ``cfg.lr``, ``RunConfig(lr=...)``, ``--set lr=...`` and
the config.json files written before the sections) or dotted (``optimizer.lr``, as ``--set optimizer.lr=...`` and
the sections of config.json). ``SECTION_OF`` is the alias table, flat name -> section name, built from the sections'
fields; the task's own settings (``options``) are the one section that depends on the model, so ``RunConfig``
handles it.
"""

# No ``from __future__ import annotations`` here: ``Sections``' field types are the section classes themselves.
import dataclasses
from dataclasses import dataclass
from typing import Any

from gallery_lib.config.sections.acceleration import Compile, Kernels, Parallel
from gallery_lib.config.sections.job import Checkpoint, Data, Job, Metrics
from gallery_lib.config.sections.training import EMA, Optimizer, Precision, Training
from gallery_lib.config.settings import ConfigError


@dataclass(frozen=True, kw_only=True)
class Sections:
    """Every section of a run but the task's (``cfg.sections.optimizer.lr``), in config.json's order."""

    job: Job
    data: Data
    training: Training
    optimizer: Optimizer
    precision: Precision
    compile: Compile
    kernels: Kernels
    parallel: Parallel
    ema: EMA
    checkpoint: Checkpoint
    metrics: Metrics


SECTION_TYPES: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Sections)}
SECTION_OF: dict[str, str] = {f.name: section for section, cls in SECTION_TYPES.items()
                              for f in dataclasses.fields(cls)}
"""The alias table: every section field's flat name -> its section's name (``"lr": "optimizer"``)."""
TASK_SECTION = "options"
"""The task's settings in dotted names and in config.json (``options.mixup_alpha``)."""


def build_sections(values: dict[str, Any]) -> Sections:
    """``Sections`` from flat values (those not given keep their defaults); each section checks itself as it is
    built, in config.json's order."""
    return Sections(**{section: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                       for section, cls in SECTION_TYPES.items()})


def dotted_name(name: str) -> str:
    """``lr`` -> ``optimizer.lr``; a task setting -> ``options.<name>``."""
    return f"{SECTION_OF.get(name, TASK_SECTION)}.{name}"


def flat_values(values: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """``values`` with every field under its flat name, whichever way it came: flat (``lr``), dotted
    (``optimizer.lr``) or nested in its section (``{"optimizer": {"lr": ...}}``, config.json's layout).

    A section's field named elsewhere (``training.lr``) or given twice is a ``ConfigError``; ``strict=False`` reads
    any config.json without checking its names (the reports read runs of any family or version).
    """
    flat: dict[str, Any] = {}

    def put(section: str | None, name: str, value: Any) -> None:
        if strict and section is not None and section not in SECTION_TYPES and section != TASK_SECTION:
            raise ConfigError(f"{section}.{name}={value!r}: there is no section {section!r}; the sections are "
                              f"{', '.join([*SECTION_TYPES, TASK_SECTION])}.")
        if strict and section is not None and SECTION_OF.get(name, TASK_SECTION) != section:
            where = f"{name} is {dotted_name(name)}" if name in SECTION_OF else f"{section} has no field {name!r}"
            raise ConfigError(f"{section}.{name}={value!r}: {where}.")
        if strict and name in flat and flat[name] != value:
            raise ConfigError(f"{name} is given twice ({flat[name]!r} and {value!r}): give it once.")
        flat[name] = value

    for key, value in values.items():
        section, dot, name = key.partition(".")
        if dot:
            put(section, name, value)
        elif (key in SECTION_TYPES or key == TASK_SECTION) and isinstance(value, dict):
            for name, inner in value.items():
                put(key, name, inner)
        else:
            put(None, key, value)
    return flat


__all__ = ["EMA", "SECTION_OF", "SECTION_TYPES", "TASK_SECTION", "Checkpoint", "Compile", "Data", "Job", "Kernels",
           "Metrics", "Optimizer", "Parallel", "Precision", "Sections", "Training", "build_sections", "dotted_name",
           "flat_values"]
