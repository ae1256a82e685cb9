"""RunConfig: the one typed, frozen description of a training run, in sections.

Every run (any model, any recipe) is fully described by a ``RunConfig``. Recipes are ``replace`` of a base config
(see ``gallery_lib.recipes``), the resolved config is saved as ``config.json`` beside the run's metrics, and the
training subprocess reads it back from there.

The fields live in sections, in torchtitan's manner (``sections/``: job, data, training, optimizer, precision,
compile, kernels, parallel, ema, checkpoint, metrics), each field declaring what it accepts next to its default
(``setting``: type, choices, range; see ``settings.py``) and each section checking its own rules as it is built. The
task's settings (Mixup for classifiers, cached latents for diffusion models) are the section ``options``, the model
family's ``task.options`` dataclass. Every field reads and writes under its flat name, the sections' alias table
(``SECTION_OF``) finding its section: ``cfg.lr``, ``cfg.mixup_alpha``, ``RunConfig(lr=1e-3)``, ``cfg.replace(lr=...)``,
``--set lr=...``; its dotted name works wherever a name is written (``--set optimizer.lr=...``, ``RunConfig(**{
"optimizer.lr": ...})``); ``cfg.sections.optimizer`` is the section itself. Two settings also take an intent,
``auto`` (``compile_mode``, ``kernel_ops``: what the recipes choose by the size of the step), which the config
resolves for its own step wherever it is read (``resolved_compile_mode``, ``cuda_graphs``, ``kernel_op_names``;
``step_size.py``). ``config.json`` holds the sections nested; flat files, written before the sections, load too.
The rules that tie sections together are ``_check_across``; checks that depend on the machine (GPU count, CUDA-only
options) live in ``machine.validate_for_machine``, the ``--set`` parser in ``overrides.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gallery_lib.config import families, step_size
from gallery_lib.config.sections import SECTION_OF, SECTION_TYPES, TASK_SECTION, Sections, build_sections, flat_values
from gallery_lib.config.sections.acceleration import (AUTO, COMPILE_MODES, COMPILE_SCOPES, CUDA_GRAPH_COMPILE_MODES,
                                                      DATA_PARALLEL_MODES, DDP_GRAD_COMPRESSION, KERNEL_OPS,
                                                      TRITON_KERNEL_OPS, kernel_ops_as_names)
from gallery_lib.config.sections.job import DEVICES, REPORT_TO
from gallery_lib.config.sections.training import AMP_DTYPES, AMP_LEVELS, EMA_MODES, OPTIMIZERS
from gallery_lib.config.settings import ConfigError, check_settings, setting

__all__ = ["AMP_DTYPES", "AMP_LEVELS", "COMPILE_MODES", "COMPILE_SCOPES", "CUDA_GRAPH_COMPILE_MODES",
           "DATA_PARALLEL_MODES", "DDP_GRAD_COMPRESSION", "DEVICES", "EMA_MODES", "KERNEL_OPS", "OPTIMIZERS",
           "REPORT_TO", "TRITON_KERNEL_OPS", "ConfigError", "RunConfig", "core_field_names", "flat_config",
           "task_setting_names"]


@dataclass(frozen=True, init=False)
class RunConfig:
    """A complete, validated description of one training run.

    ``RunConfig(**fields)`` takes every field flat or dotted, the task's settings included (see the module docstring);
    ``cfg.<field>`` reads any field flat.
    """

    sections: Sections
    """The sections of the run (``cfg.sections.optimizer.lr``), each checked as it was built."""
    options: Any = None
    """The task's own settings: an instance of the model family's ``task.options`` dataclass (built from the flat
    fields given to ``RunConfig``)."""
    extra: dict[str, Any] = setting(default_factory=dict)
    """Free-form notes carried into ``config.json`` (e.g. which profile filled which field)."""

    def __init__(self, **values: Any) -> None:
        sections = values.pop("sections", None)  # from dataclasses.replace: the fields not changed
        values = flat_values(values)
        if sections is not None:
            values = {**{name: getattr(getattr(sections, section), name) for name, section in SECTION_OF.items()},
                      **values}
        if "model" not in values:
            raise ConfigError("model is missing: name a gallery model (see `gallery list`).")
        family = families.family_of(values["model"])
        own = {f.name for f in dataclasses.fields(family.options)}
        task_values = {name: values.pop(name) for name in list(values) if name in own}
        _check_known(values, family)
        options = values.pop("options", None)
        if options is None:
            options = family.options(**task_values)
        elif not isinstance(options, family.options):
            raise ConfigError(f"model={values['model']!r} trains with {family.options.__name__}, not "
                              f"{type(options).__name__}: build a config of another family with base_config.")
        else:
            options = dataclasses.replace(options, **task_values)
        object.__setattr__(self, "sections", build_sections(values))
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "extra", values.get("extra", {}))
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """Every field reads flat: ``cfg.lr`` is ``cfg.sections.optimizer.lr``, ``cfg.mixup_alpha`` is
        ``cfg.options.mixup_alpha``."""
        if name.startswith("__") or name in ("sections", "options"):
            raise AttributeError(name)
        if name in SECTION_OF:
            return getattr(getattr(self.sections, SECTION_OF[name]), name)
        try:
            return getattr(self.options, name)
        except AttributeError:
            raise AttributeError(f"RunConfig of {self.model!r} has no field {name!r}") from None

    def __post_init__(self) -> None:
        """The sections checked themselves as they were built: here the task's settings, then the rules that tie
        sections together."""
        check_settings(self)
        check_settings(self.options)
        self._check_across()
        self.options.check(training=self.sections.training)

    def _check_across(self) -> None:
        """The rules that involve more than one section."""
        if self.find_batch_size and self.nproc_per_node > 1:
            # Ranks would have to agree on an OOM raised mid-collective (Lightning's finder has the same limit).
            raise ConfigError(f"find_batch_size=True is invalid with nproc_per_node={self.nproc_per_node}: run the "
                              "search with nproc_per_node=1, then set batch_size to the size it chose.")
        if self.find_batch_size and (self.resume or self.resume_from):
            raise ConfigError("find_batch_size=True is invalid with resume=True: a resumed run keeps the batch size "
                              "of its checkpoint. Drop find_batch_size and set batch_size to the saved run's value.")
        cuda_graphs = self.cuda_graphs
        if self.gradient_checkpointing and cuda_graphs:
            # The backward recomputes each checkpointed block, which would record CUDA graphs inside the backward.
            raise ConfigError(f"gradient_checkpointing=True cannot run with compile_mode={self.compile_mode!r}: a "
                              "block recomputed in the backward pass cannot replay as a CUDA graph. Use "
                              "compile_mode='default' (or 'max-autotune-no-cudagraphs'), or drop the checkpointing.")
        if self.gradient_accumulation_steps > 1 and cuda_graphs:
            # CUDA-graph trees hand the gradients out of the graphs' pool: the next batch's replay overwrites them.
            raise ConfigError(f"gradient_accumulation_steps={self.gradient_accumulation_steps} cannot run with "
                              f"compile_mode={self.compile_mode!r}: the next batch's CUDA-graph replay overwrites the "
                              "gradients the batches add up. Use compile_mode='default', or accumulate 1 step.")
        if self.data_parallel == "zero2" and cuda_graphs:
            raise ConfigError(f"compile_mode={self.compile_mode!r} captures CUDA graphs, and data_parallel='zero2' "
                              "all-gathers and reduce-scatters in hooks outside them: use compile_mode='default' or "
                              "'max-autotune-no-cudagraphs' with zero2, or data_parallel='ddp'.")
        if self.data_parallel == "zero2" and self.amp_level == "O2":
            raise ConfigError("amp_level='O2' is invalid with data_parallel='zero2': O2's fp32 master copies are taken "
                              "from the parameters that ZeRO-2 replaces by sharded ones. Use amp_level='O1' (fp32 "
                              "sharded weights, autocast math) or data_parallel='ddp'.")
        if self.data_parallel == "zero2" and self.ema_offload:
            raise ConfigError("ema_offload=True is invalid with data_parallel='zero2': ZeRO-2 already shards the EMA "
                              "over the processes. Drop ema_offload, or use data_parallel='ddp'.")
        if self.data_parallel == "zero2" and self.precompile_workers:
            raise ConfigError(f"precompile_workers={self.precompile_workers} is invalid with data_parallel='zero2': "
                              "the workers compile copies of the blocks, and sharded blocks cannot be copied. Set "
                              "precompile_workers=0 (the blocks then compile in the first steps) or "
                              "data_parallel='ddp'.")
        multiple = self.model_family.model_spec(self.model).image_size_multiple
        if self.image_size % multiple:
            fits = max(multiple, round(self.image_size / multiple) * multiple)
            raise ConfigError(f"image_size={self.image_size} does not fit {self.model!r}: its image sizes are "
                              f"multiples of {multiple}. Set image_size={fits} (--image_size {fits}).")
        if self.fused_attention and self.model_family.attention_hook is None:
            raise ConfigError(f"fused_attention=True is invalid for {self.model!r}: its family "
                              f"({self.family}) has no attention hook. Set fused_attention=false.")

    # ----- derived values -------------------------------------------------------------
    @property
    def model_family(self):
        """The model's ``ModelFamily`` (``families``): its task, profiles, switches, blocks, hooks."""
        return families.family_of(self.model)

    @property
    def task(self) -> str:
        """What the model learns, e.g. ``classification`` or ``text-to-image`` (the family task's name)."""
        return self.model_family.task.name

    @property
    def family(self) -> str:
        """Model family: the folder name under ``output_dir`` and the notebook's name."""
        return self.model_family.name

    @property
    def run_dir(self) -> Path:
        """Where this run writes ``config.json``, ``metrics.jsonl`` and ``logs/``."""
        return Path(self.output_dir) / self.family / self.recipe

    @property
    def step_pixels(self) -> int:
        """The pixels of a step's images per process (``batch_size * image_size**2``): what the family's thresholds
        of CUDA graphs and large-step kernels are in."""
        return step_size.step_pixels(self.batch_size, self.image_size)

    @property
    def graphs_can_replay(self) -> bool:
        """Whether CUDA graphs can replay this run's step: not with checkpointing, ZeRO-2 or accumulation
        (``step_size.graphs_can_replay``)."""
        return step_size.graphs_can_replay(gradient_checkpointing=self.gradient_checkpointing,
                                           data_parallel=self.data_parallel,
                                           gradient_accumulation_steps=self.gradient_accumulation_steps)

    @property
    def resolved_compile_mode(self) -> str:
        """The ``torch.compile`` mode this run compiles with: ``compile_mode``, ``auto`` resolved for its step
        (``step_size.resolved_compile_mode``). What the run, its log and the reports read."""
        return step_size.resolved_compile_mode(self.compile_mode, self.model_family, self.step_pixels,
                                               self.graphs_can_replay)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled model replays as CUDA graphs (a resolved ``compile_mode`` that captures them)."""
        return self.compile and self.resolved_compile_mode in CUDA_GRAPH_COMPILE_MODES

    @property
    def resolved_kernel_ops(self) -> str:
        """The kernels ``kernels=True`` swaps in for this run: ``kernel_ops``, ``auto`` resolved for its step
        (``step_size.resolved_kernel_ops``)."""
        return step_size.resolved_kernel_ops(self.kernel_ops, self.model_family, self.step_pixels)

    @property
    def kernel_op_names(self) -> tuple[str, ...]:
        """``resolved_kernel_ops`` as names: every op for ``all``."""
        return kernel_ops_as_names(self.resolved_kernel_ops)

    @property
    def compile_whole_types(self) -> tuple[str, ...]:
        """``compile_whole`` as class names."""
        return self.sections.compile.compile_whole_types

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, over every process and accumulated batch."""
        return self.batch_size * self.nproc_per_node * self.gradient_accumulation_steps

    @property
    def peak_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 0.1 * self.global_batch_size / 256 if self.optimizer == "sgd" else 5e-4 * self.global_batch_size / 512

    # ----- (de)serialization ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field flat, the task's settings in place of ``options`` (what ``replace`` and config diffs read)."""
        values = {name: getattr(self, name) for name in SECTION_OF}
        return {**values, **dataclasses.asdict(self.options), "extra": self.extra}

    def to_sections(self) -> dict[str, Any]:
        """Every field in its section, the task's settings in ``options`` (the layout of ``config.json``)."""
        nested = {name: dataclasses.asdict(getattr(self.sections, name)) for name in SECTION_TYPES}
        return {**nested, TASK_SECTION: dataclasses.asdict(self.options), "extra": self.extra}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file of this writer's own: the launchers of several nodes write the same config.json at once.
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(self.to_sections(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """From ``to_dict`` or ``to_sections`` (flat, dotted and nested names mix)."""
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        """Reads ``config.json``, in sections or flat as written before the sections; flat files written before the
        task settings moved to the tasks still load (their settings of other tasks, all at their off values then,
        are dropped), and so do files written while the recipes noted in ``extra`` which settings they had chosen by
        the step's size (those settings load as the intent they were, ``auto``)."""
        values = flat_values(json.loads(Path(path).read_text(encoding="utf-8")))
        if "model" in values:
            own = {f.name for f in dataclasses.fields(families.family_of(values["model"]).options)}
            values = {k: v for k, v in values.items() if k in own or k not in task_setting_names()}
        return cls(**_intents_of_step_notes(values))

    def replace(self, **changes: Any) -> RunConfig:
        """``dataclasses.replace`` for flat (or dotted) fields, the task's settings included, with a clear error for
        misspelled ones."""
        return type(self)(**{**self.to_dict(), **flat_values(changes)})


def flat_config(values: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with every field under its flat name, whether it was written in sections or flat,
    without checking them: for the reports, which read the runs of any family or version."""
    return flat_values(values, strict=False)


def core_field_names() -> set[str]:
    """Every field's flat name but the task's settings, ``options`` and ``extra`` included."""
    return set(SECTION_OF) | {f.name for f in dataclasses.fields(RunConfig) if f.name != "sections"}


def task_setting_names() -> dict[str, str]:
    """Every task setting of every registered family -> the names of the tasks that have it ("a and b")."""
    tasks: dict[str, list[str]] = {}
    for family in families.FAMILIES.values():
        for f in dataclasses.fields(family.options):
            names = tasks.setdefault(f.name, [])
            if family.task.name not in names:
                names.append(family.task.name)
    return {name: " and ".join(names) for name, names in tasks.items()}


# Notes in ``extra`` of files written before the recipes stated intent: ``compile_mode`` chosen by the step's size,
# and the family's large-step switches (each to its value below them).
_STEP_NOTES = ("block_graphs_by_batch", "small_step_switches")


def _intents_of_step_notes(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the settings that an old file's step notes name set to ``auto``, and the notes dropped."""
    extra = values.get("extra") or {}
    if not set(_STEP_NOTES) & set(extra):
        return values
    intents = {"compile_mode": AUTO} if extra.get("block_graphs_by_batch") else {}
    intents.update((name, AUTO) for name in extra.get("small_step_switches") or {})
    return {**values, **intents, "extra": {k: v for k, v in extra.items() if k not in _STEP_NOTES}}


def _check_known(values: dict[str, Any], family) -> None:
    """Fails on misspelled fields, and on settings of another task (``cache_latents`` for a classifier)."""
    core = core_field_names()
    other_tasks = task_setting_names()
    for name in values:
        if name not in core and name in other_tasks:
            raise ConfigError(f"{name}={values[name]!r} applies to {other_tasks[name]} models, not to "
                              f"{values['model']!r} ({family.task.name}): drop it.")
    unknown = sorted(set(values) - core)
    if unknown:
        allowed = sorted(core - {"options"} | {f.name for f in dataclasses.fields(family.options)})
        raise ConfigError(f"unknown config field(s) {unknown}: allowed fields are {allowed}.")
