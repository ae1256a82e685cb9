"""The sections of the step's math: ``training`` (batch, steps, memory for compute), ``optimizer``, ``precision``
and ``ema``."""

from __future__ import annotations

from dataclasses import dataclass

from gallery_lib.config.settings import ConfigError, Section, setting

OPTIMIZERS = ("adamw", "sgd")
AMP_LEVELS = ("O0", "O1", "O2")
AMP_DTYPES = ("auto", "float16", "bfloat16")
EMA_MODES = ("off", "loop", "foreach", "fused", "stream")
MEMORY_PLANS = ("auto", "off")


@dataclass(frozen=True, kw_only=True)
class Training(Section):
    """``training``: the batch, the steps, and what each step keeps in memory."""

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
    gradient_accumulation_steps: int = setting(1, kind=int, minimum=1)
    """Batches whose gradients add up before each optimizer step: an effective batch of ``batch_size`` times this
    per process, in the memory of one batch. Each batch's loss is divided by it, so the step follows the mean loss.
    With DDP the gradients are all-reduced once per step, with the last batch (``no_sync`` before it); ZeRO-2
    reduce-scatters each batch's, so that no process holds whole gradients."""
    gradient_checkpointing: bool = setting(False, kind=bool)
    """Recompute the activations of the model's blocks in the backward pass instead of keeping them (diffusers'
    ``enable_gradient_checkpointing``, timm's ``set_grad_checkpointing``, transformers'
    ``gradient_checkpointing_enable``): less memory for more compute, the same function."""
    memory_plan: str = setting("auto", choices=MEMORY_PLANS)
    """``auto``: on one GPU, fit the step into the memory the run may use (``gpu_memory_gib``, else the GPU's free
    memory) at the same global batch, picking the batch per step, the gradient accumulation and the checkpointing
    from the family's measured footprints, or from a short probe where none is measured
    (``gallery_lib/run/memory_plan.py``). A batch size, accumulation or checkpointing the user names stays. ``off``:
    run as configured."""
    gpu_memory_gib: float | None = setting(None, kind=float, above=0, optional=True,
                                           hint="GiB, e.g. 22 for a 24 GB card")
    """The GPU memory this run may use, in GiB: its process and its precompile workers are capped to it together
    (``torch.cuda.set_per_process_memory_fraction``; each process's CUDA context, about 1 GiB, comes on top), and
    the memory plan fits the run into it, or into the GPU's free memory where less is free. ``None``: the GPU's free
    memory at the start. The environment variable ``GALLERY_GPU_MEMORY_GIB`` sets it for every run that does not
    name it."""
    max_nonfinite_steps: int = setting(5, kind=int, minimum=0, hint="0 disables the check")
    """Stop (with a checkpoint) after this many non-finite losses in a row; each such step is skipped. 0 turns
    the check off, which also removes its per-step host sync (see ``train.py``)."""

    def check(self) -> None:
        if self.warmup_steps > self.steps - 1:
            raise ConfigError(f"warmup_steps={self.warmup_steps} is invalid: expected an integer in [0, "
                              f"{self.steps - 1}] (leave at least one timed step after warm-up).")


@dataclass(frozen=True, kw_only=True)
class Optimizer(Section):
    """``optimizer``: the optimizer, its learning-rate schedule, weight decay and clipping."""

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
    foreach_optimizer: bool = setting(True, kind=bool)
    """Without ``fused_optimizer``: PyTorch's default multi-tensor (foreach) update on a GPU, whose AdamW holds a
    temporary fp32 copy of every parameter at its peak; ``False`` updates one tensor at a time (slower; the memory
    plan's setting where that copy does not fit)."""
    clip_in_optimizer: bool = setting(False, kind=bool)
    """Fold gradient clipping into the fused optimizer's pass: it divides each gradient by the clip factor as it reads
    it, instead of a pass that scales every gradient in place first. The same update, one pass over the gradients
    fewer. Without a fused optimizer, with a GradScaler or with sharded gradients, clipping runs as its own pass."""



@dataclass(frozen=True, kw_only=True)
class Precision(Section):
    """``precision``: the dtypes of the weights and the math, and deterministic algorithms."""

    amp_level: str = setting("O1", choices=AMP_LEVELS)
    """``O0`` fp32, ``O1`` autocast mixed precision, ``O2`` low-precision weights with fp32 master copies."""
    amp_dtype: str = setting("auto", choices=AMP_DTYPES)
    """Low-precision dtype: ``auto`` is float16 (with a GradScaler) on a GPU for O1 and bfloat16 otherwise."""
    deterministic: bool = setting(False, kind=bool)
    """Ask PyTorch for deterministic algorithms (slower; for exact comparisons)."""

    def check(self) -> None:
        if self.amp_level == "O2" and self.amp_dtype == "float16":
            raise ConfigError("amp_level='O2' with amp_dtype='float16' is not supported: O2 keeps bfloat16 weights "
                              "(no loss scaling needed). Use amp_dtype='bfloat16' or 'auto', or amp_level='O1'.")


@dataclass(frozen=True, kw_only=True)
class EMA(Section):
    """``ema``: the exponential moving average of the trained weights."""

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
    ema_in_optimizer: bool = setting(False, kind=bool)
    """Average in the fused AdamW's pass: one kernel applies AdamW and the EMA's update, reading each weight once
    instead of twice (``gallery_lib/accel/adamw_ema.py``). With SGD, without a fused optimizer, with O2, float16 or
    ZeRO-2, and on a CPU without Triton, the EMA updates in its own pass, as ``ema`` says. DreamBooth's GPU recipe
    takes it; SD-1.5's, with the EMA on a side stream, gains nothing from it (benchmarks/RESULTS.md#adamw-ema)."""

    ema_offload: bool = setting(False, kind=bool)
    """Keep the EMA's weights in the CPU's pinned memory between its updates, as diffusers' ``--offload_ema`` does:
    each update, after the gradients are freed, copies them to the GPU, averages there (``foreach``, on the main
    stream) and copies them back. The GPU then holds no EMA during the forward and backward passes (SD-1.5: 3.2
    GiB), at the cost of two copies of it per step. The memory plan turns it on where the training state does not fit
    the GPU with the EMA on it."""

    def check(self) -> None:
        if self.ema_offload and self.ema == "off":
            raise ConfigError("ema_offload=True keeps the EMA in the CPU's memory, but ema='off' keeps none: set ema "
                              "(e.g. ema='foreach'), or drop ema_offload.")
        if self.ema_stream_programs and self.ema != "stream":
            raise ConfigError(f"ema_stream_programs={self.ema_stream_programs} sizes the side-stream EMA update, but "
                              f"ema={self.ema!r}: set ema='stream' too, or drop ema_stream_programs.")
