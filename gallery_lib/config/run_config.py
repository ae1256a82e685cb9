"""RunConfig: the one typed, frozen description of a training run.

Every run (any model, any recipe) is fully described by a ``RunConfig``. Recipes are
``dataclasses.replace`` of a base config (see ``gallery_lib.recipes``), the resolved config is saved as
``config.json`` beside the run's metrics, and the training subprocess reads it back from there.

Each field declares what it accepts next to its default (``setting``: type, choices, range; see ``settings.py``),
and ``__post_init__`` checks them all in one place, plus the few rules that tie fields together, so a typo fails
before any data is prepared or any model is built. The settings of the model's task (Mixup for classifiers, cached
latents for diffusion models) live with the task, in ``cfg.options`` (the family's ``task.options`` dataclass);
they read and write like the other fields: ``cfg.mixup_alpha``, ``RunConfig(mixup_alpha=0)``, ``--set
mixup_alpha=0``, one flat ``config.json``. Checks that depend on the machine (GPU count, CUDA-only options) live in
``machine.validate_for_machine``, the ``--set`` parser in ``overrides.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gallery_lib.config import families
from gallery_lib.config.settings import ConfigError, check_settings, setting

AMP_LEVELS = ("O0", "O1", "O2")
AMP_DTYPES = ("auto", "float16", "bfloat16")
DEVICES = ("auto", "cuda", "cpu")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
EMA_MODES = ("off", "loop", "foreach", "fused", "stream")
OPTIMIZERS = ("adamw", "sgd")
DATA_PARALLEL_MODES = ("ddp", "zero2")
DDP_GRAD_COMPRESSION = ("none", "bf16")
REPORT_TO = ("none", "tensorboard")
TRITON_KERNEL_OPS = ("group_norm_silu", "layer_norm", "geglu")
KERNEL_OPS = TRITON_KERNEL_OPS + ("conv_bn_relu",)  # cuDNN's fused conv + batch norm: float16 only, so never "all"
# Compile modes that capture CUDA graphs: only meaningful with a GPU.
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")

__all__ = ["ConfigError", "RunConfig", "core_field_names", "task_setting_names"]


@dataclass(frozen=True, kw_only=True, init=False)
class RunConfig:
    """A complete, validated description of one training run.

    ``RunConfig(**fields)`` takes every field flat, the task's settings included (see the module docstring).
    """

    model: str
    """Gallery model name, e.g. ``swin_tiny_patch4_window7_224`` or the CPU-sized ``swin_micro``."""
    recipe: str = setting("baseline", kind=str)
    """Name of the recipe this config was resolved from (``baseline``, ``compiled``, ``accelerated``...)."""
    profile: str = setting("custom", kind=str)
    """Profile the defaults came from (``smoke`` on a CPU, ``full`` on a GPU); informative only."""

    data_dir: str = setting("data/imagenet_like", kind=str)
    """Training data: an ImageNet-style folder with ``train/<class>/*`` images for classifiers, an imagefolder with
    ``train/metadata.jsonl`` (``file_name``, ``text``) for text-to-image models."""
    pretrained: str | None = setting(None, kind=str, optional=True)
    """Start from these weights instead of a random init: a local folder (a timm checkpoint file for classifiers; the
    diffusers layout ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/`` for Stable Diffusion) or a hub id when
    the machine has network."""
    output_dir: str = setting("output", kind=str)
    """Root of the output tree; this run writes to ``<output_dir>/<model family>/<recipe>/``."""
    image_size: int = setting(224, kind=int, minimum=16)
    """Training crop size in pixels."""

    batch_size: int = setting(128, kind=int, minimum=1)
    """Images per process per step (the global batch is ``batch_size * nproc_per_node``)."""
    find_batch_size: bool = setting(False, kind=bool)
    """Search for the largest batch that fits: ``batch_size`` is then the largest size tried (rounded down to even),
    backed off x0.9 on out-of-memory. Each trial runs 3 real training steps of this config (compiled when the recipe
    compiles: compilation and autotuning change peak memory). The run then trains from scratch at the chosen size,
    which its summary (``batch_size_search``) and ``config.json`` record. With ``lr=None`` the learning rate scales
    with the chosen batch. Single-process only (``nproc_per_node=1``), and not with ``resume``."""
    steps: int = setting(50, kind=int, minimum=1)
    """Optimizer steps to run."""
    warmup_steps: int = setting(10, kind=int, minimum=0)
    """First steps excluded from the speed figures (compilation, autotuning, allocator warm-up)."""
    log_every: int = setting(10, kind=int, minimum=1)
    """Steps between host syncs: losses and timings are read back and written in batches of this size."""

    optimizer: str = setting("adamw", choices=OPTIMIZERS)
    """``adamw`` (betas 0.9 / 0.999) or ``sgd`` (momentum 0.9, Nesterov: the torchvision / NVIDIA ResNet recipe)."""
    lr: float | None = setting(None, kind=float, above=0, optional=True)
    """Peak learning rate; ``None`` scales a reference rule to the global batch: AdamW 5e-4 per 512 (Swin), SGD 0.1
    per 256 (Goyal et al.)."""
    weight_decay: float = setting(0.05, kind=float, minimum=0)
    """Weight decay (norms, biases and position tables are excluded, as in the Swin reference)."""
    lr_warmup_steps: int = setting(5, kind=int, minimum=0)
    """Linear learning-rate warm-up before the cosine decay."""
    clip_grad: float | None = setting(5.0, kind=float, above=0, optional=True)
    """Gradient-norm clipping threshold (the Swin reference uses 5.0); ``None`` disables it."""
    fused_optimizer: bool = setting(False, kind=bool)
    """Use ``torch.optim.AdamW(fused=True)``: one kernel for the whole update."""

    amp_level: str = setting("O1", choices=AMP_LEVELS)
    """``O0`` fp32, ``O1`` autocast mixed precision, ``O2`` low-precision weights with fp32 master copies."""
    amp_dtype: str = setting("auto", choices=AMP_DTYPES)
    """Low-precision dtype: ``auto`` is float16 (with a GradScaler) on a GPU for O1 and bfloat16 otherwise."""
    compile: bool = setting(False, kind=bool)
    """Wrap the model in ``torch.compile``."""
    compile_mode: str = setting("default", choices=COMPILE_MODES)
    """``torch.compile`` mode (``max-autotune-no-cudagraphs`` autotunes matmuls without CUDA graphs)."""
    compile_scope: str = setting("model", choices=COMPILE_SCOPES)
    """What ``compile`` compiles: ``model`` (the whole model, one graph) or ``blocks`` (each repeated block in place,
    ``accel/compile/regional.py``: blocks of one shape share a graph, so there is less to compile; with a CUDA-graph
    ``compile_mode`` each block replays as CUDA graphs)."""
    coordinate_descent_tuning: bool = setting(False, kind=bool)
    """With ``compile``: Inductor tunes the block sizes of the Triton kernels it generates, one parameter at a time
    (its ``coordinate_descent_tuning``). Faster steps for a much longer first compile: +3.2% after a 300 s warm-up for
    ResNet-50 on an H100 (benchmarks/RESULTS.md#resnet50), so no recipe turns it on; worth it for runs of hours."""
    tiled_reductions: bool = setting(False, kind=bool)
    """With ``compile``: Inductor tiles its reduction kernels over two dimensions (its ``triton.prefer_nd_tiling`` and
    ``triton.tile_reductions``), for the batch-norm statistics of channels_last convnets. ResNet-50's accelerated step:
    +0.5% on an H100, for a first compile of 126 s instead of 33 s (benchmarks/RESULTS.md#resnet50), so off by
    default."""
    channels_last_graphs: bool = setting(False, kind=bool)
    """With ``compile``: Inductor lays out the convolutions' tensors channels_last in every graph it compiles, the
    backward graphs' gradients included (its ``force_layout_optimization``). Its heuristic leaves every backward graph
    (and forward graphs with narrowing convolutions, as in SD's UNet) in the traced strides, and cuDNN then copies each
    gradient to the weights' channels_last layout: 12.5 ms of the SD-1.5 step at batch 32 on an H100
    (benchmarks/RESULTS.md#sd15-layout)."""
    precompile_workers: int = setting(0, kind=int, minimum=0)
    """With ``compile_scope='blocks'``: compile the distinct block graphs in this many parallel processes before the
    first step (``gallery_lib.accel.compile.precompile``), so the warm-up steps only load them. 0 compiles them in the
    warm-up steps, one after another."""
    precompile_overlap: bool = setting(True, kind=bool)
    """With ``precompile_workers``: once a worker has exited (its cores are free), the training process loads the
    block graphs compiled so far, then each as it lands (step 4 of ``gallery_lib.accel.compile.precompile``), so that
    the first steps find them traced, loaded and run once (on by default: benchmarks/RESULTS.md#sd15-compile-time).
    ``False`` leaves all the loading to the first steps."""
    precompile_first_use: bool = setting(True, kind=bool)
    """With ``precompile_workers`` on a GPU: while the workers compile, the training process runs each distinct block
    once uncompiled, so that the libraries build their kernels for this GPU before loading needs them (cuDNN compiles
    its attention and convolution kernels on a machine's first use; on by default:
    benchmarks/RESULTS.md#precompile-loading)."""
    kernels: bool = setting(False, kind=bool)
    """Swap in the fused Triton kernels of ``gallery_lib.accel.kernels`` where they apply (``--kernel-opt``)."""
    kernel_ops: str = setting("all", kind=str)
    """Which kernels ``kernels=True`` swaps in: ``all`` (the Triton kernels) or a comma list of ``group_norm_silu``,
    ``layer_norm``, ``geglu``, ``conv_bn_relu`` (recipes keep only those that measured faster than torch.compile's own
    code). ``conv_bn_relu`` folds a ResNet bottleneck's batch norms into cuDNN's fused convolutions; on a GPU it needs
    ``amp_dtype='float16'`` and the ``nvidia-cudnn-frontend`` package (``ci/setup_env.sh`` installs it on a GPU)."""
    fused_attention: bool = setting(False, kind=bool)
    """Run window/self attention through ``scaled_dot_product_attention`` instead of explicit matmuls."""
    channels_last: bool = setting(False, kind=bool)
    """Keep image tensors (and conv weights) in channels-last memory format."""
    gradient_accumulation_steps: int = setting(1, kind=int, minimum=1)
    """Batches whose gradients add up before each optimizer step: an effective batch of ``batch_size`` times this
    per process, in the memory of one batch. Each batch's loss is divided by it, so the step follows the mean loss.
    With DDP the gradients are all-reduced once per step, with the last batch (``no_sync`` before it); ZeRO-2
    reduce-scatters each batch's, so that no process holds whole gradients."""
    gradient_checkpointing: bool = setting(False, kind=bool)
    """Recompute the activations of the model's blocks in the backward pass instead of keeping them (diffusers'
    ``enable_gradient_checkpointing``, timm's ``set_grad_checkpointing``, transformers'
    ``gradient_checkpointing_enable``): less memory for more compute, the same function."""

    nproc_per_node: int = setting(1, kind=int, minimum=1)
    """Processes (one per GPU, or CPU processes with gloo) started by torchrun."""
    data_parallel: str = setting("ddp", choices=DATA_PARALLEL_MODES)
    """How the processes share the training: ``ddp`` (DistributedDataParallel: each process holds all the gradients
    and the whole optimizer state) or ``zero2`` (ZeRO-2 through FSDP2's ``fully_shard`` with
    ``reshard_after_forward=False``: the weights stay whole between forward and backward, the gradients and the
    optimizer state are sharded over the processes; see ``gallery_lib.accel.distributed``)."""
    ddp_bucket_cap_mb: int = setting(25, kind=int, minimum=1)
    """DDP only: the size in MB of the gradient buckets DDP all-reduces while the backward still runs (PyTorch's
    default, 25). Larger buckets mean fewer, longer all-reduces; smaller ones start overlapping sooner."""
    ddp_static_graph: bool = setting(False, kind=bool)
    """DDP only: promise DDP that every step uses the same parameters in the same graph, so it can skip its per-step
    bookkeeping after the first step. Off by default: a model whose steps use different parameters (data-dependent
    branches) breaks the promise (see ``gallery_lib.accel.distributed``)."""
    ddp_grad_compression: str = setting("none", choices=DDP_GRAD_COMPRESSION)
    """DDP only: ``bf16`` all-reduces the gradient buckets as bfloat16 (PyTorch's ``bf16_compress_hook``: each bucket
    rounded to bf16, divided by the process count and summed in bf16, half the bytes) and writes the mean back to the
    fp32 gradients; ``none`` all-reduces them in their own dtype. Lossy (bf16's 8-bit mantissa), and slower for SD-1.5
    on two H200s (benchmarks/RESULTS.md#two-gpus)."""
    device: str = setting("auto", choices=DEVICES)
    """``auto`` picks CUDA when present, else CPU."""
    num_workers: int = setting(4, kind=int, minimum=0)
    """Data-loader worker processes per training process."""
    seed: int = setting(0, kind=int, minimum=0)
    """Seed for model init, data order and augmentation."""
    sdpa_math: bool = setting(False, kind=bool)
    """Force PyTorch's ``math`` attention kernel (flash, memory-efficient and cuDNN attention switched off): attention
    as explicit matmuls and a softmax, with its memory, as before PyTorch 2's fused kernels (the NVIDIA talk's
    baseline; the optimization ladder's first rungs)."""
    deterministic: bool = setting(False, kind=bool)
    """Ask PyTorch for deterministic algorithms (slower; for exact comparisons)."""
    reuse_batch: bool = setting(False, kind=bool)
    """Train on the first batch over and over: times the model step alone, without the data pipeline
    (as timm's ``benchmark.py`` does with random inputs). For benchmarks only: the model learns nothing useful."""
    profile_steps: int = setting(0, kind=int, minimum=0)
    """Run this many steps after warm-up under ``torch.profiler`` and write the kernel time per step by kind to
    ``<run_dir>/profile.json`` (0: off). Profiled steps run slower: profile in a run of its own
    (``gallery_lib/run/profiling.py``)."""

    ema: str = setting("off", choices=EMA_MODES)
    """EMA of the trained weights and how its update runs: ``off``, ``loop`` (a kernel per tensor, the diffusers
    default), ``foreach`` (multi-tensor), ``fused`` (one Triton kernel), ``stream`` (fused, on a side CUDA stream
    beside the next step's forward).
    ``fused``/``stream`` fall back to ``foreach`` on a CPU. See ``gallery_lib/accel/ema.py``."""
    ema_stream_programs: int = setting(0, kind=int, minimum=0, hint="0: half the GPU's SMs")
    """With ``ema=stream``: the side-stream update as this many persistent programs, which share the GPU with the
    next forward (0: half the GPU's SMs, the width that measured fastest: benchmarks/RESULTS.md#ema)."""
    ema_decay: float = setting(0.9999, kind=float, above=0, below=1, hint="e.g. 0.9999")
    """EMA decay, reached through diffusers' default warm-up ``min(decay, (1 + step) / (10 + step))``."""
    export_model: bool = setting(True, kind=bool)
    """Save the trained model at the end of the run (Stable Diffusion: a diffusers pipeline folder in
    ``<run_dir>/pipeline`` with the EMA UNet when ``ema`` is on)."""

    checkpoint_every: int = setting(0, kind=int, minimum=0, hint="0 disables checkpoints")
    """Steps between checkpoints in ``<run_dir>/checkpoints/`` (0 disables periodic checkpoints). A run stopped
    for non-finite losses saves one whatever this value is."""
    keep_checkpoints: int = setting(2, kind=int, minimum=1)
    """Newest checkpoints kept on disk; older ones are deleted (never the one ``latest`` names)."""
    resume: bool = setting(False, kind=bool)
    """Continue from ``<run_dir>/checkpoints/latest`` (model, optimizer, scheduler, scaler, RNG, data position);
    an error if there is no checkpoint to resume from."""
    resume_from: str | None = setting(None, kind=str, optional=True)
    """A checkpoint to continue from instead of the run's own latest: a ``step_<N>.pt`` file, a ``checkpoints``
    folder or a run folder (the checkpoint its ``latest`` names), e.g. another run's. Implies ``resume``; the state
    must fit the run as with ``resume``. The run writes its metrics afresh and its checkpoints to its own folder.
    diffusers' ``--resume_from_checkpoint PATH``."""
    max_nonfinite_steps: int = setting(5, kind=int, minimum=0, hint="0 disables the check")
    """Stop (with a checkpoint) after this many non-finite losses in a row; each such step is skipped. 0 turns
    the check off, which also removes its per-step host sync (see ``train.py``)."""
    max_bad_fraction: float = setting(0.1, kind=float, above=0, maximum=1, hint="1 never stops for bad files")
    """Stop with an error when more than this share of the image loads so far failed (judged every ``log_every``
    steps, once 50 images were read); each bad file is skipped, logged with its path and counted. In (0, 1]."""
    max_restarts: int = setting(0, kind=int, minimum=0, hint="0 disables restarts")
    """Times torchrun restarts the workers after a failure (``--max-restarts``); a restarted run resumes from the
    latest checkpoint on its own, so set ``checkpoint_every`` too."""
    report_to: str = setting("none", choices=REPORT_TO)
    """Where the metrics go besides ``metrics.jsonl`` (which stays the record): ``none``, or ``tensorboard`` (step
    scalars and the summary in ``<run_dir>/tensorboard/``, the reports' figure beside the runs; needs the
    ``tensorboard`` package, the ``tracking`` extra). diffusers' ``--report_to``."""
    verbose: bool = setting(False, kind=bool)
    """Log every detail (each module a kernel swap left alone); by default one line per kind of thing."""

    options: Any = None
    """The task's own settings: an instance of the model family's ``task.options`` dataclass (built from the flat
    fields given to ``RunConfig``)."""
    extra: dict[str, Any] = setting(default_factory=dict)
    """Free-form notes carried into ``config.json`` (e.g. which profile filled which field)."""

    def __init__(self, **values: Any) -> None:
        if "model" not in values:
            raise ConfigError("model is missing: name a gallery model (see `gallery list`).")
        family = families.family_of(values["model"])
        own = {f.name for f in dataclasses.fields(family.options)}
        task_values = {name: values.pop(name) for name in list(values) if name in own}
        _check_known(values, family)
        options = values.pop("options", None)
        if options is None or isinstance(options, dict):
            options = family.options(**{**(options or {}), **task_values})
        elif not isinstance(options, family.options):
            raise ConfigError(f"model={values['model']!r} trains with {family.options.__name__}, not "
                              f"{type(options).__name__}: build a config of another family with base_config.")
        else:
            options = dataclasses.replace(options, **task_values)
        for f in dataclasses.fields(self):
            if f.name in values:
                value = values[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "options", options)
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """The task's settings read like fields: ``cfg.mixup_alpha`` is ``cfg.options.mixup_alpha``."""
        if name.startswith("__") or name == "options":
            raise AttributeError(name)
        try:
            return getattr(self.options, name)
        except AttributeError:
            raise AttributeError(f"RunConfig of {self.model!r} has no field {name!r}") from None

    def __post_init__(self) -> None:
        """Every field against its declared rule, then the rules that tie fields together."""
        check_settings(self)
        check_settings(self.options)
        if self.warmup_steps > self.steps - 1:
            raise ConfigError(f"warmup_steps={self.warmup_steps} is invalid: expected an integer in [0, "
                              f"{self.steps - 1}] (leave at least one timed step after warm-up).")
        if not self.kernel_op_names or any(op not in KERNEL_OPS for op in self.kernel_op_names):
            raise ConfigError(f"kernel_ops={self.kernel_ops!r} is invalid: expected 'all' or a comma list of "
                              f"{', '.join(KERNEL_OPS)}.")
        if self.find_batch_size and self.nproc_per_node > 1:
            # Ranks would have to agree on an OOM raised mid-collective (Lightning's finder has the same limit).
            raise ConfigError(f"find_batch_size=True is invalid with nproc_per_node={self.nproc_per_node}: run the "
                              "search with nproc_per_node=1, then set batch_size to the size it chose.")
        if self.find_batch_size and (self.resume or self.resume_from):
            raise ConfigError("find_batch_size=True is invalid with resume=True: a resumed run keeps the batch size "
                              "of its checkpoint. Drop find_batch_size and set batch_size to the saved run's value.")
        if self.precompile_workers and not (self.compile and self.compile_scope == "blocks"):
            raise ConfigError(f"precompile_workers={self.precompile_workers} needs compile=True and "
                              f"compile_scope='blocks' (got compile={self.compile}, compile_scope="
                              f"{self.compile_scope!r}): set both, or precompile_workers=0.")
        for name in ("coordinate_descent_tuning", "tiled_reductions", "channels_last_graphs"):
            if getattr(self, name) and not self.compile:
                raise ConfigError(f"{name}=True changes the kernels torch.compile generates: set compile=True too, "
                                  f"or drop {name}.")
        if self.ema_stream_programs and self.ema != "stream":
            raise ConfigError(f"ema_stream_programs={self.ema_stream_programs} sizes the side-stream EMA update, but "
                              f"ema={self.ema!r}: set ema='stream' too, or drop ema_stream_programs.")
        if self.amp_level == "O2" and self.amp_dtype == "float16":
            raise ConfigError("amp_level='O2' with amp_dtype='float16' is not supported: O2 keeps bfloat16 weights "
                              "(no loss scaling needed). Use amp_dtype='bfloat16' or 'auto', or amp_level='O1'.")
        if not self.recipe:
            raise ConfigError(f"recipe={self.recipe!r} is invalid: expected a recipe name.")
        if self.gradient_checkpointing and self.compile and self.compile_mode in CUDA_GRAPH_COMPILE_MODES:
            # The backward recomputes each checkpointed block, which would record CUDA graphs inside the backward.
            raise ConfigError(f"gradient_checkpointing=True cannot run with compile_mode={self.compile_mode!r}: a block "
                              "recomputed in the backward pass cannot replay as a CUDA graph. Use "
                              "compile_mode='default' (or 'max-autotune-no-cudagraphs'), or drop the checkpointing.")
        if self.sdpa_math and self.fused_attention:
            raise ConfigError("sdpa_math=True and fused_attention=True contradict each other: the attention registry "
                              "picks its own kernels. Keep one of them.")
        if self.data_parallel == "zero2" and self.compile and self.compile_mode in CUDA_GRAPH_COMPILE_MODES:
            raise ConfigError(f"compile_mode={self.compile_mode!r} captures CUDA graphs, and data_parallel='zero2' "
                              "all-gathers and reduce-scatters in hooks outside them: use compile_mode='default' or "
                              "'max-autotune-no-cudagraphs' with zero2, or data_parallel='ddp'.")
        if self.data_parallel == "zero2" and self.amp_level == "O2":
            raise ConfigError("amp_level='O2' is invalid with data_parallel='zero2': O2's fp32 master copies are taken "
                              "from the parameters that ZeRO-2 replaces by sharded ones. Use amp_level='O1' (fp32 "
                              "sharded weights, autocast math) or data_parallel='ddp'.")
        if self.data_parallel == "zero2" and self.precompile_workers:
            raise ConfigError(f"precompile_workers={self.precompile_workers} is invalid with data_parallel='zero2': "
                              "the workers compile copies of the blocks, and sharded blocks cannot be copied. Set "
                              "precompile_workers=0 (the blocks then compile in the first steps) or "
                              "data_parallel='ddp'.")
        if self.fused_attention and self.model_family.attention_hook is None:
            raise ConfigError(f"fused_attention=True is invalid for {self.model!r}: its family "
                              f"({self.family}) has no attention hook. Set fused_attention=false.")
        self.options.check(self)

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
    def kernel_op_names(self) -> tuple[str, ...]:
        """``kernel_ops`` as names: every op for ``all``."""
        if self.kernel_ops == "all":
            return TRITON_KERNEL_OPS
        return tuple(op.strip() for op in self.kernel_ops.split(",") if op.strip())

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
        """Every field flat, the task's settings in place of ``options`` (the layout of ``config.json``)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        extra = values.pop("extra")
        return {**values, **dataclasses.asdict(self.options), "extra": extra}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        """Reads ``config.json``; files written before the task settings moved to the tasks still load (their
        settings of other tasks, all at their off values then, are dropped)."""
        values = json.loads(Path(path).read_text(encoding="utf-8"))
        if "model" in values:
            own = {f.name for f in dataclasses.fields(families.family_of(values["model"]).options)}
            values = {k: v for k, v in values.items() if k in own or k not in task_setting_names()}
        return cls(**values)

    def replace(self, **changes: Any) -> RunConfig:
        """``dataclasses.replace`` for flat fields, the task's settings included, with a clear error for misspelled
        ones."""
        return type(self)(**{**self.to_dict(), **changes})


def core_field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(RunConfig)}


def task_setting_names() -> dict[str, str]:
    """Every task setting of every registered family -> the names of the tasks that have it ("a and b")."""
    tasks: dict[str, list[str]] = {}
    for family in families.FAMILIES.values():
        for f in dataclasses.fields(family.options):
            names = tasks.setdefault(f.name, [])
            if family.task.name not in names:
                names.append(family.task.name)
    return {name: " and ".join(names) for name, names in tasks.items()}


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
