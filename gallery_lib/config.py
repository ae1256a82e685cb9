"""RunConfig: the one typed, frozen description of a training run.

Every run (any model, any recipe) is fully described by a ``RunConfig``. Recipes are
``dataclasses.replace`` of a base config (see ``recipes.py``), the resolved config is saved as
``config.json`` beside the run's metrics, and the training subprocess reads it back from there.
Field values are checked when the config is built, so a typo fails before any data is prepared
or any model is built; checks that depend on the machine (GPU count, CUDA-only options) live in
``validate_for_machine``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AMP_LEVELS = ("O0", "O1", "O2")
AMP_DTYPES = ("auto", "float16", "bfloat16")
DEVICES = ("auto", "cuda", "cpu")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
EMA_MODES = ("off", "loop", "foreach", "fused", "stream")
PREDICTION_TYPES = ("epsilon", "v_prediction")
KERNEL_OPS = ("group_norm_silu", "layer_norm", "geglu")
# Compile modes that capture CUDA graphs: only meaningful with a GPU.
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


class ConfigError(ValueError):
    """An invalid run configuration: the message names the field, the value and what is allowed."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A complete, validated description of one training run."""

    model: str
    """Gallery model name, e.g. ``swin_tiny_patch4_window7_224`` or the CPU-sized ``swin_micro``."""
    recipe: str = "baseline"
    """Name of the recipe this config was resolved from (``baseline``, ``compiled``, ``accelerated``...)."""
    profile: str = "custom"
    """Profile the defaults came from (``smoke`` on a CPU, ``full`` on a GPU); informative only."""

    data_dir: str = "data/imagenet_like"
    """Training data: an ImageNet-style folder with ``train/<class>/*`` images for classifiers, an imagefolder with
    ``train/metadata.jsonl`` (``file_name``, ``text``) for text-to-image models."""
    pretrained: str | None = None
    """Start from these weights instead of a random init: a local folder (a timm checkpoint file for classifiers; the
    diffusers layout ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/`` for Stable Diffusion) or a hub id when
    the machine has network."""
    output_dir: str = "output"
    """Root of the output tree; this run writes to ``<output_dir>/<model family>/<recipe>/``."""
    image_size: int = 224
    """Training crop size in pixels."""

    batch_size: int = 128
    """Images per process per step (the global batch is ``batch_size * nproc_per_node``)."""
    find_batch_size: bool = False
    """Search for the largest batch that fits: ``batch_size`` is then the largest size tried (rounded down to even),
    backed off x0.9 on out-of-memory. Each trial runs 3 real training steps of this config (compiled when the recipe
    compiles: compilation and autotuning change peak memory). The run then trains from scratch at the chosen size,
    which its summary (``batch_size_search``) and ``config.json`` record. With ``lr=None`` the learning rate scales
    with the chosen batch. Single-process only (``nproc_per_node=1``), and not with ``resume``."""
    steps: int = 50
    """Optimizer steps to run."""
    warmup_steps: int = 10
    """First steps excluded from the speed figures (compilation, autotuning, allocator warm-up)."""
    log_every: int = 10
    """Steps between host syncs: losses and timings are read back and written in batches of this size."""

    lr: float | None = None
    """Peak learning rate; ``None`` scales the Swin reference rule 5e-4 * global_batch / 512 (profiles of other
    models set it)."""
    weight_decay: float = 0.05
    """AdamW weight decay (norms, biases and position tables are excluded, as in the Swin reference)."""
    lr_warmup_steps: int = 5
    """Linear learning-rate warm-up before the cosine decay."""
    clip_grad: float | None = 5.0
    """Gradient-norm clipping threshold (the Swin reference uses 5.0); ``None`` disables it."""
    fused_optimizer: bool = False
    """Use ``torch.optim.AdamW(fused=True)``: one kernel for the whole update."""

    amp_level: str = "O1"
    """``O0`` fp32, ``O1`` autocast mixed precision, ``O2`` low-precision weights with fp32 master copies."""
    amp_dtype: str = "auto"
    """Low-precision dtype: ``auto`` is float16 (with a GradScaler) on a GPU for O1 and bfloat16 otherwise."""
    compile: bool = False
    """Wrap the model in ``torch.compile``."""
    compile_mode: str = "default"
    """``torch.compile`` mode (``max-autotune-no-cudagraphs`` autotunes matmuls without CUDA graphs)."""
    compile_scope: str = "model"
    """What ``compile`` compiles: ``model`` (the whole model, one graph) or ``blocks`` (each repeated block in place,
    ``gallery_lib.compile.regional_compile``: blocks of one shape share a graph, so there is less to compile; with a
    CUDA-graph ``compile_mode`` each block replays as CUDA graphs)."""
    precompile_workers: int = 0
    """With ``compile_scope='blocks'``: compile the distinct block graphs in this many parallel processes before the
    first step (``gallery_lib.precompile``), so the warm-up steps only load them. 0 compiles them in the warm-up
    steps, one after another."""
    precompile_overlap: bool = True
    """With ``precompile_workers``: once a worker has exited (its cores are free), the training process loads the
    block graphs compiled so far, then each as it lands (step 4 of ``gallery_lib.precompile``), so that the first
    steps find them traced, loaded and run once. SD-1.5 at batch 8 on H200s, cold caches, three runs each, not a
    machine's first (sd15_precompile_loading_h200/): 34.9, 41.7 and 49.1 s to steady speed with it against 43.6,
    54.6 and 48.4 s without; the warm-up steps 4.8-5.6 s against 15.5-19.4 s, peak memory 17.3 against 21.0 GiB,
    per-step losses within the spread of runs without it. ``False`` leaves all the loading to the first steps."""
    kernels: bool = False
    """Swap in the fused Triton kernels of ``gallery_lib.kernels`` where they apply (``--kernel-opt``)."""
    kernel_ops: str = "all"
    """Which kernels ``kernels=True`` swaps in: ``all`` or a comma list of ``group_norm_silu``, ``layer_norm``,
    ``geglu`` (recipes keep only those that measured faster than torch.compile's own code)."""
    fused_attention: bool = False
    """Run window/self attention through ``scaled_dot_product_attention`` instead of explicit matmuls."""
    channels_last: bool = False
    """Keep image tensors (and conv weights) in channels-last memory format."""

    nproc_per_node: int = 1
    """Processes (one per GPU, or CPU processes with gloo) started by torchrun."""
    device: str = "auto"
    """``auto`` picks CUDA when present, else CPU."""
    num_workers: int = 4
    """Data-loader worker processes per training process."""
    seed: int = 0
    """Seed for model init, data order and augmentation."""
    deterministic: bool = False
    """Ask PyTorch for deterministic algorithms (slower; for exact comparisons)."""
    reuse_batch: bool = False
    """Train on the first batch over and over: times the model step alone, without the data pipeline
    (as timm's ``benchmark.py`` does with random inputs). For benchmarks only: the model learns nothing useful."""

    auto_augment: str | None = None
    """timm auto-augment policy, e.g. ``rand-m9-mstd0.5-inc1`` (the Swin reference)."""
    re_prob: float = 0.0
    """Random-erasing probability."""
    mixup_alpha: float = 0.8
    """Mixup alpha (0 disables)."""
    cutmix_alpha: float = 1.0
    """CutMix alpha (0 disables)."""
    label_smoothing: float = 0.1
    """Label smoothing applied to the (mixed) targets."""

    ema: str = "off"
    """EMA of the trained weights and how its update runs: ``off``, ``loop`` (a kernel per tensor, the diffusers
    default), ``foreach`` (multi-tensor), ``fused`` (one Triton kernel), ``stream`` (fused, on a side CUDA stream).
    ``fused``/``stream`` fall back to ``foreach`` on a CPU. See ``gallery_lib/ema.py``."""
    ema_decay: float = 0.9999
    """EMA decay, reached through diffusers' default warm-up ``min(decay, (1 + step) / (10 + step))``."""
    prediction_type: str = "epsilon"
    """Diffusion models: what the network predicts, ``epsilon`` (the noise; SD 1.x) or ``v_prediction``."""
    cache_latents: bool = False
    """Diffusion models: encode every image with the frozen VAE and every caption with the frozen text encoder once,
    before training, and train from the cached latent distributions and embeddings (same function: a fresh latent
    sample is drawn from the cached distribution every step). Images are center-cropped, not flipped."""
    export_model: bool = True
    """Save the trained model at the end of the run (Stable Diffusion: a diffusers pipeline folder in
    ``<run_dir>/pipeline`` with the EMA UNet when ``ema`` is on)."""

    checkpoint_every: int = 0
    """Steps between checkpoints in ``<run_dir>/checkpoints/`` (0 disables periodic checkpoints). A run stopped
    for non-finite losses saves one whatever this value is."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk; older ones are deleted (never the one ``latest`` names)."""
    resume: bool = False
    """Continue from ``<run_dir>/checkpoints/latest`` (model, optimizer, scheduler, scaler, RNG, data position);
    an error if there is no checkpoint to resume from."""
    max_nonfinite_steps: int = 5
    """Stop (with a checkpoint) after this many non-finite losses in a row; each such step is skipped. 0 turns
    the check off, which also removes its per-step host sync (see ``train.py``)."""
    max_bad_fraction: float = 0.1
    """Stop with an error when more than this share of the image loads so far failed (judged every ``log_every``
    steps, once 50 images were read); each bad file is skipped, logged with its path and counted. In (0, 1]."""
    max_restarts: int = 0
    """Times torchrun restarts the workers after a failure (``--max-restarts``); a restarted run resumes from the
    latest checkpoint on its own, so set ``checkpoint_every`` too."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes carried into ``config.json`` (e.g. which profile filled which field)."""

    def __post_init__(self) -> None:
        from gallery_lib.models import MODELS  # local import: models import torch/timm lazily

        _check_choice("model", self.model, tuple(MODELS))
        _check_positive_int("image_size", self.image_size, minimum=16)
        _check_positive_int("batch_size", self.batch_size)
        _check_positive_int("steps", self.steps)
        _check_positive_int("log_every", self.log_every)
        _check_positive_int("nproc_per_node", self.nproc_per_node)
        _check_int_range("warmup_steps", self.warmup_steps, 0, self.steps - 1,
                         hint="leave at least one timed step after warm-up")
        _check_int_range("lr_warmup_steps", self.lr_warmup_steps, 0, None)
        _check_int_range("num_workers", self.num_workers, 0, None)
        _check_int_range("seed", self.seed, 0, None)
        _check_int_range("checkpoint_every", self.checkpoint_every, 0, None, hint="0 disables checkpoints")
        _check_positive_int("keep_checkpoints", self.keep_checkpoints)
        _check_int_range("max_nonfinite_steps", self.max_nonfinite_steps, 0, None, hint="0 disables the check")
        _check_int_range("max_restarts", self.max_restarts, 0, None, hint="0 disables restarts")
        if isinstance(self.max_bad_fraction, bool) or not (
                isinstance(self.max_bad_fraction, (int, float)) and 0 < self.max_bad_fraction <= 1):
            raise ConfigError(f"max_bad_fraction={self.max_bad_fraction!r} is invalid: expected a number in (0, 1] "
                              "(1 never stops for bad files).")
        if not isinstance(self.kernel_ops, str) or not self.kernel_op_names or any(
                op not in KERNEL_OPS for op in self.kernel_op_names):
            raise ConfigError(f"kernel_ops={self.kernel_ops!r} is invalid: expected 'all' or a comma list of "
                              f"{', '.join(KERNEL_OPS)}.")
        if not isinstance(self.resume, bool):
            raise ConfigError(f"resume={self.resume!r} is invalid: expected true or false.")
        if not isinstance(self.find_batch_size, bool):
            raise ConfigError(f"find_batch_size={self.find_batch_size!r} is invalid: expected true or false.")
        if self.find_batch_size and self.nproc_per_node > 1:
            # Ranks would have to agree on an OOM raised mid-collective (Lightning's batch-size finder has the
            # same limit).
            raise ConfigError(f"find_batch_size=True is invalid with nproc_per_node={self.nproc_per_node}: run the "
                              "search with nproc_per_node=1, then set batch_size to the size it chose.")
        if self.find_batch_size and self.resume:
            raise ConfigError("find_batch_size=True is invalid with resume=True: a resumed run keeps the batch size "
                              "of its checkpoint. Drop find_batch_size and set batch_size to the saved run's value.")
        _check_choice("amp_level", self.amp_level, AMP_LEVELS)
        _check_choice("amp_dtype", self.amp_dtype, AMP_DTYPES)
        _check_choice("compile_mode", self.compile_mode, COMPILE_MODES)
        _check_choice("compile_scope", self.compile_scope, COMPILE_SCOPES)
        _check_positive_int("precompile_workers", self.precompile_workers, minimum=0)
        if self.precompile_workers and not (self.compile and self.compile_scope == "blocks"):
            raise ConfigError(f"precompile_workers={self.precompile_workers} needs compile=True and "
                              f"compile_scope='blocks' (got compile={self.compile}, compile_scope="
                              f"{self.compile_scope!r}): set both, or precompile_workers=0.")
        _check_choice("device", self.device, DEVICES)
        _check_choice("ema", self.ema, EMA_MODES)
        _check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        if isinstance(self.ema_decay, bool) or not (isinstance(self.ema_decay, (int, float)) and
                                                    0 < self.ema_decay < 1):
            raise ConfigError(f"ema_decay={self.ema_decay!r} is invalid: expected a number in (0, 1), e.g. 0.9999.")
        for name in ("cache_latents", "export_model", "precompile_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: expected true or false.")
        if self.cache_latents and self.task != "text_to_image":
            raise ConfigError(f"cache_latents=True applies to text-to-image models, not to {self.model!r}: "
                              "set cache_latents=False.")
        if self.amp_level == "O2" and self.amp_dtype == "float16":
            raise ConfigError("amp_level='O2' with amp_dtype='float16' is not supported: O2 keeps bfloat16 weights "
                              "(no loss scaling needed). Use amp_dtype='bfloat16' or 'auto', or amp_level='O1'.")
        for name in ("lr", "clip_grad"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"{name}={value!r} is invalid: expected a positive number or None.")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay!r} is invalid: expected a number >= 0.")
        for name in ("mixup_alpha", "cutmix_alpha"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: expected a number >= 0 (0 disables it).")
        for name in ("label_smoothing", "re_prob"):
            if not (isinstance(getattr(self, name), (int, float)) and 0 <= getattr(self, name) < 1):
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: expected a number in [0, 1).")
        if self.uses_mixup and self.batch_size % 2:
            raise ConfigError(f"batch_size={self.batch_size} is invalid with Mixup/CutMix, which pair images "
                              "within a batch: use an even batch size, or set mixup_alpha=0 and cutmix_alpha=0.")
        if not self.recipe or not isinstance(self.recipe, str):
            raise ConfigError(f"recipe={self.recipe!r} is invalid: expected a recipe name.")

    # ----- derived values -------------------------------------------------------------
    @property
    def task(self) -> str:
        """What the model learns: ``classification`` or ``text_to_image`` (picks the task in ``gallery_lib.tasks``)."""
        from gallery_lib.models import MODELS

        return MODELS[self.model].task

    @property
    def family(self) -> str:
        """Model family: the folder name under ``output_dir`` and the notebook's name."""
        from gallery_lib.models import MODELS

        return MODELS[self.model].family

    @property
    def run_dir(self) -> Path:
        """Where this run writes ``config.json``, ``metrics.jsonl`` and ``logs/``."""
        return Path(self.output_dir) / self.family / self.recipe

    @property
    def kernel_op_names(self) -> tuple[str, ...]:
        """``kernel_ops`` as names: every op for ``all``."""
        if self.kernel_ops == "all":
            return KERNEL_OPS
        return tuple(op.strip() for op in self.kernel_ops.split(",") if op.strip())

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.nproc_per_node

    @property
    def uses_mixup(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else 5e-4 * self.global_batch_size / 512

    # ----- (de)serialization ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}: allowed fields are {sorted(known)}.")
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def replace(self, **changes: Any) -> RunConfig:
        """``dataclasses.replace`` with a clear error for misspelled fields."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}: allowed fields are {sorted(known)}.")
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not known: choose one of {', '.join(allowed)}.")


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= {minimum}.")


def _check_int_range(name: str, value: Any, low: int, high: int | None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise ConfigError(f"{name}={value!r} is invalid: expected {allowed}" + (f" ({hint})." if hint else "."))


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """``["fused_attention=true", "lr=1e-3"]`` -> ``{"fused_attention": True, "lr": 0.001}`` (for ``--set``)."""
    known = {f.name for f in dataclasses.fields(RunConfig)}
    overrides: dict[str, Any] = {}
    for item in assignments:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or key not in known:
            raise ConfigError(f"--set {item!r} is invalid: expected FIELD=VALUE with FIELD one of {sorted(known)}.")
        overrides[key] = _parse_value(text)
    return overrides


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str, cuda_devices: int) -> str:
    """``cuda`` or ``cpu`` for a ``RunConfig.device`` value: ``auto`` takes the GPU when one is visible."""
    return requested if requested != "auto" else ("cuda" if cuda_devices else "cpu")


def validate_for_machine(cfg: RunConfig, *, cuda_devices: int | None = None, cpu_count: int | None = None) -> str:
    """Checks the options that depend on this machine and returns the resolved device (``cuda``/``cpu``).

    Raises ``ConfigError`` naming the fix when a GPU-only option is asked for on a CPU machine, or
    when more processes are asked for than the machine has devices for.
    """
    if cuda_devices is None:
        cuda_devices = visible_cuda_devices()
    cpu_count = cpu_count or os.cpu_count() or 1
    device = resolve_device(cfg.device, cuda_devices)
    if device == "cuda":
        if cuda_devices == 0:
            raise ConfigError("device='cuda' was asked for but no CUDA GPU is visible: use device='auto' or 'cpu' "
                              "(or the smoke profile) on this machine.")
        if cfg.nproc_per_node > cuda_devices:
            raise ConfigError(f"nproc_per_node={cfg.nproc_per_node} but only {cuda_devices} GPU(s) are visible: "
                              f"use nproc_per_node <= {cuda_devices}.")
    else:
        if cfg.compile and cfg.compile_mode in CUDA_GRAPH_COMPILE_MODES:
            raise ConfigError(f"compile_mode={cfg.compile_mode!r} captures CUDA graphs and needs a GPU: use "
                              "compile_mode='default' on a CPU.")
        if cfg.nproc_per_node > cpu_count:
            raise ConfigError(f"nproc_per_node={cfg.nproc_per_node} but this machine has {cpu_count} CPU core(s): "
                              f"use nproc_per_node <= {cpu_count}.")
    return device
