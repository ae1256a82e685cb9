"""What one model family is, declared in one place: ``ModelFamily``.

A family module (``families/swin.py``, ``families/stable_diffusion.py``) builds one ``ModelFamily``, which the
registry loads through an entry point; a module outside the library registers its own
(``gallery_lib.families.register_family``). Everything else in the library reads from it: the config (which models
exist, which task and task settings they take), the profiles (run and data sizes), the recipes (the switches that
measured faster for this family, and those of its plain-PyTorch peer), data preparation, regional compilation (the
repeated block types) and the attention backend hook. None of them branches on a family or task name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class ModelSpec:
    """One model of a family."""

    name: str
    """The gallery model name (``--model``)."""
    build: Callable[..., Any]
    """Builds the model with random weights (or from ``pretrained``); its arguments are the family task's."""
    default_image_size: int
    tiny: bool
    """A CPU-sized configuration for smoke runs and tests."""
    description: str
    family: str = ""
    """Filled in by ``register_family``."""
    trained_parameters: int | None = None
    """The parameters its full training updates: with fp32 weights, their gradients, the optimizer's state and an EMA
    they are the memory no setting of the step lowers, the memory plan's floor (``gallery_lib/run/memory_plan.py``).
    ``None``: small enough not to matter."""
    image_size_multiple: int = 1
    """The image sizes it takes are multiples of this (Stable Diffusion: the VAE's downsampling times the UNet's, 64
    for SD-1.5): another size is a config error, and a profile sized for the family's tiny model rounds up to it."""


@dataclass(frozen=True)
class Footprint:
    """The GPU memory one recipe of one model reserved at its peak, measured at some batch sizes per process (one
    process, the family's full image size, the whole run: compilation and CUDA-graph capture included). The memory
    plan reads it (``gallery_lib/run/memory_plan.py``)."""

    model: str
    recipe: str
    """The recipe as named (``accelerated``); with the user's overrides it is another recipe, with no footprint."""
    reserved_gib: Mapping[int, float]
    """Batch size per process -> peak ``torch.cuda.max_memory_reserved``, in GiB."""
    gradient_checkpointing: bool = False
    uncompiled: bool = False
    """Measured with the recipe's ``torch.compile`` turned off (the memory plan's setting where no compiled one
    fits)."""
    ema_offloaded: bool = False
    """Measured with the EMA in the CPU's memory between its updates (``ema_offload``); otherwise on the GPU."""
    samples_per_s: Mapping[int, float] = field(default_factory=dict)
    """Speed at those batch sizes, where it was measured in the same runs."""
    source: str = ""
    """The result file the numbers come from (``benchmarks/results/...``)."""


@dataclass(frozen=True)
class WorkerMemory:
    """The GPU memory of parallel precompilation, measured per process with ``nvidia-smi`` (CUDA contexts included):
    the training process's peak while its workers compile, and one worker's peak."""

    trainer_gib: float
    per_worker_gib: float
    source: str = ""


SPEED_GOAL_CHECKS = ("speedup", "throughput", "ema_cost", "compile_time")


@dataclass(frozen=True)
class SpeedGoal:
    """A speed goal that ``gallery bench`` judges from its own rows (its checks: ``reports/bench_goals.py``)."""

    check: str
    """``speedup`` (``accelerated`` over ``peer`` at a batch size), ``throughput`` (samples/s at the best batch),
    ``ema_cost`` (the EMA's share of the step) or ``compile_time`` (seconds to steady speed)."""
    model: str
    limits: Mapping[str, Any] = field(default_factory=dict)
    """The check's arguments: ``batch_size``, ``min_ratio``, ``max_spread``, ``min_samples_per_s``, ``max_cost``,
    ``caches``, ``max_s``."""

    def __post_init__(self) -> None:
        if self.check not in SPEED_GOAL_CHECKS:
            raise ValueError(f"speed goal check {self.check!r} is not known: choose one of {SPEED_GOAL_CHECKS}")


@dataclass(frozen=True)
class ModelFamily:
    """A model family: its models and everything the library needs to train them."""

    name: str
    """Output folder and notebook name (``output/<name>/<recipe>/``, ``notebooks/<name>.ipynb``)."""
    task: type
    """The ``Task`` class it trains with (``gallery_lib.tasks``); ``task.options`` is the dataclass of the task's
    own settings (e.g. Mixup for classifiers), which a ``RunConfig`` of this family carries."""
    models: tuple[ModelSpec, ...]
    run_profiles: Mapping[str, Mapping[str, Any]]
    """``smoke`` and ``full``: ``RunConfig`` fields (task settings included) that size a run."""
    data_profiles: Mapping[str, Mapping[str, Any]]
    """``smoke`` and ``full``: keyword arguments of ``make_dataset``."""
    dataset: str
    """Folder name of the family's mock data: ``<data_root>/<dataset>_<profile>``."""
    make_dataset: Callable[..., Any]
    """``make_dataset(path, **data_profile, seed=, progress=)`` writes the mock data and returns its path."""
    accelerated: Mapping[str, Any] = field(default_factory=dict)
    """What the ``accelerated`` recipe switches on top of ``compiled`` for this family: only switches that measured
    faster (each kept with a one-line pointer to ``benchmarks/RESULTS.md``)."""
    accelerated_on_gpu: Mapping[str, Any] = field(default_factory=dict)
    """Switches the ``accelerated`` recipe adds to ``accelerated`` only when the run has a GPU (CUDA graphs, say)."""
    block_graphs_below_pixels: int | None = None
    """With ``compile_scope='blocks'`` on a GPU, ``accelerated`` replays the blocks as CUDA graphs while a step's
    images per process hold fewer pixels than this (``batch_size * image_size**2``), where the host launching kernels
    sets the step time. Set where the graphs stop measuring faster: beyond it the GPU sets the step time, and recording
    them only costs a start-up step and memory, so the blocks run without them. ``None``: CUDA graphs at every size."""
    accelerated_on_large_steps: Mapping[str, Any] = field(default_factory=dict)
    """The ``kernel_ops`` the ``accelerated`` recipe runs on a GPU once a step's images per process hold at least
    ``large_step_pixels``: a fused kernel that beats the compiler's code only where the step gives it work enough
    (below that its grid leaves the GPU part idle, or it keeps the compiler from fusing its neighbours). The recipe
    states ``kernel_ops='auto'``, which the step resolves (``gallery_lib/config/step_size.py``)."""
    large_step_pixels: int | None = None
    """Where ``accelerated_on_large_steps`` starts (``batch_size * image_size**2``)."""
    peer: Mapping[str, Any] = field(default_factory=dict)
    """What the ``peer`` recipe switches on top of ``compiled``: what a skilled user adds to ``torch.compile`` in a few
    lines of plain PyTorch for this family (cached latents for diffusion, channels_last for convnets), so that
    ``accelerated`` is measured against the strongest setup a user gets without this library. On a GPU ``peer``
    replays CUDA graphs unless this sets ``compile_mode`` (``"default"`` where graphs slow the plain model down)."""
    block_types: tuple[str, ...] = ()
    """Class names of the repeated blocks that ``compile_scope='blocks'`` compiles in place (outermost match)."""
    block_modules: tuple[str, ...] = ()
    """Modules defining those blocks: precompile workers import them while the run sets up."""
    attention_hook: Callable[[Any], tuple[str, Any]] | None = None
    """``hook(model) -> (note, AttentionHook)``: routes the model's attention through ``gallery_lib.accel.attention``
    (``fused_attention=True``); ``None`` when the family has no hook, and then that switch is a config error."""
    speed_goals: tuple[SpeedGoal, ...] = ()
    """What ``accelerated`` should reach on one GPU, judged by ``gallery bench`` from the rows it measured."""
    memory_footprints: tuple[Footprint, ...] = ()
    """Measured peak memory of the family's recipes by batch size: the memory plan fits a run from them, and probes
    a few steps where none is measured."""
    worker_memory: WorkerMemory | None = None
    """What precompile workers take beside the training process; ``None``: not measured (the plan then leaves
    their number as the recipe set it)."""

    def __post_init__(self) -> None:
        missing = {"smoke", "full"} - set(self.run_profiles) | {"smoke", "full"} - set(self.data_profiles)
        if missing:
            raise ValueError(f"family {self.name!r} needs 'smoke' and 'full' profiles (missing {sorted(missing)})")
        if not dataclasses.is_dataclass(getattr(self.task, "options", None)):
            raise ValueError(f"family {self.name!r}: its task {self.task.__name__} has no `options` dataclass")
        if bool(self.accelerated_on_large_steps) != (self.large_step_pixels is not None):
            raise ValueError(f"family {self.name!r}: accelerated_on_large_steps and large_step_pixels go together")
        if set(self.accelerated_on_large_steps) - {"kernel_ops"}:
            raise ValueError(f"family {self.name!r}: accelerated_on_large_steps switches kernel_ops only (the setting "
                             f"a step resolves from 'auto'), not {sorted(set(self.accelerated_on_large_steps))}")

    @property
    def options(self) -> type:
        """The dataclass of the task's own settings."""
        return self.task.options

    def model_names(self) -> list[str]:
        return [spec.name for spec in self.models]

    def model_spec(self, model: str) -> ModelSpec:
        """The declaration of the family's model ``model``."""
        return next(spec for spec in self.models if spec.name == model)

    def build(self, model: str, **kwargs: Any) -> Any:
        """Builds the family's model ``model`` (the task passes its arguments, e.g. ``num_classes``)."""
        return self.model_spec(model).build(**kwargs)

    def plain_options(self) -> dict[str, Any]:
        """The task settings that ``accelerated`` or ``peer`` switch, at their defaults: what the plain recipes run."""
        defaults = {f.name: f.default for f in dataclasses.fields(self.options)}
        return {name: defaults[name] for name in {**self.accelerated, **self.peer} if name in defaults}
