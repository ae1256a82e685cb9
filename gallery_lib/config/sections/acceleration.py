"""The accelerations' sections: ``compile`` (``torch.compile`` and its precompile workers), ``kernels`` (fused
kernels, attention kernels, memory layout) and ``parallel`` (processes and how they share the training)."""

from __future__ import annotations

from dataclasses import dataclass

from gallery_lib.config.settings import ConfigError, Section, setting

AUTO = "auto"
"""A setting's intent, resolved for the size of the step as it is read (``gallery_lib/config/step_size.py``)."""
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", AUTO)
COMPILE_SCOPES = ("model", "blocks")
# Compile modes that capture CUDA graphs: only meaningful with a GPU.
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")
TRITON_KERNEL_OPS = ("group_norm_silu", "layer_norm", "geglu")
KERNEL_OPS = TRITON_KERNEL_OPS + ("conv_bn_relu",)  # cuDNN's fused conv + batch norm: float16 only, so never "all"
DATA_PARALLEL_MODES = ("ddp", "zero2")
DDP_GRAD_COMPRESSION = ("none", "bf16")


def _comma_list(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def kernel_ops_as_names(kernel_ops: str) -> tuple[str, ...]:
    """A concrete ``kernel_ops`` as names: every op for ``all``."""
    return TRITON_KERNEL_OPS if kernel_ops == "all" else _comma_list(kernel_ops)


@dataclass(frozen=True, kw_only=True)
class Compile(Section):
    """``compile``: whether and how ``torch.compile`` compiles the model, and the Inductor switches beside it."""

    compile: bool = setting(False, kind=bool)
    """Wrap the model in ``torch.compile``."""
    compile_mode: str = setting("default", choices=COMPILE_MODES)
    """``torch.compile`` mode (``max-autotune-no-cudagraphs`` autotunes matmuls without CUDA graphs), or ``auto``,
    what the GPU recipes state: CUDA graphs where they pay, resolved for the step as it is read
    (``RunConfig.resolved_compile_mode``): ``reduce-overhead`` while a step's images per process hold fewer pixels
    than the family's ``block_graphs_below_pixels`` and the graphs can replay (no gradient checkpointing, ZeRO-2 or
    accumulation), else ``default``. A mode named explicitly runs at every batch size."""
    compile_scope: str = setting("model", choices=COMPILE_SCOPES)
    """What ``compile`` compiles: ``model`` (the whole model, one graph) or ``blocks`` (each repeated block in place,
    ``accel/compile/regional.py``: blocks of one shape share a graph, so there is less to compile; with a CUDA-graph
    ``compile_mode`` each block replays as CUDA graphs)."""
    compile_whole: str = setting("", kind=str)
    """With ``compile_scope='blocks'``: a comma list of class names compiled whole in place of the blocks inside them
    (e.g. ``CrossAttnUpBlock2D,UpBlock2D``, SD's up blocks), so that the code between those blocks (a skip
    connection's ``torch.cat``, an upsampler) runs in the graph too, not eagerly with its outputs copied into the next
    block's CUDA graph. Fewer, larger graphs: each takes longer to compile (benchmarks/RESULTS.md#sd15-up-blocks)."""
    coordinate_descent_tuning: bool = setting(False, kind=bool)
    """With ``compile``: Inductor tunes the block sizes of the Triton kernels it generates, one parameter at a time
    (its ``coordinate_descent_tuning``). Slightly faster steps for a much longer first compile, so no recipe turns it
    on; worth it for runs of hours (benchmarks/RESULTS.md#resnet50)."""
    tiled_reductions: bool = setting(False, kind=bool)
    """With ``compile``: Inductor tiles its reduction kernels over two dimensions (its ``triton.prefer_nd_tiling`` and
    ``triton.tile_reductions``), for the batch-norm statistics of channels_last convnets: a slightly faster step
    for a much longer first compile, so off by default (benchmarks/RESULTS.md#resnet50)."""
    channels_last_graphs: bool = setting(False, kind=bool)
    """With ``compile``: Inductor lays out the convolutions' tensors channels_last in every graph it compiles, the
    backward graphs' gradients included (its ``force_layout_optimization``). Its heuristic leaves every backward graph
    (and forward graphs with narrowing convolutions, as in SD's UNet) in the traced strides, and cuDNN then copies each
    gradient to the weights' channels_last layout (benchmarks/RESULTS.md#sd15-layout)."""
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

    def check(self) -> None:
        if self.precompile_workers and not (self.compile and self.compile_scope == "blocks"):
            raise ConfigError(f"precompile_workers={self.precompile_workers} needs compile=True and "
                              f"compile_scope='blocks' (got compile={self.compile}, compile_scope="
                              f"{self.compile_scope!r}): set both, or precompile_workers=0.")
        if self.compile_whole and not (self.compile and self.compile_scope == "blocks"):
            raise ConfigError(f"compile_whole={self.compile_whole!r} names classes compiled in place of their blocks: "
                              f"it needs compile=True and compile_scope='blocks' (got compile={self.compile}, "
                              f"compile_scope={self.compile_scope!r}). Set both, or drop compile_whole.")
        for name in ("coordinate_descent_tuning", "tiled_reductions", "channels_last_graphs"):
            if getattr(self, name) and not self.compile:
                raise ConfigError(f"{name}=True changes the kernels torch.compile generates: set compile=True too, "
                                  f"or drop {name}.")

    @property
    def compile_whole_types(self) -> tuple[str, ...]:
        """``compile_whole`` as class names."""
        return _comma_list(self.compile_whole)


@dataclass(frozen=True, kw_only=True)
class Kernels(Section):
    """``kernels``: the fused kernels swapped in, the attention kernels and the memory layout."""

    kernels: bool = setting(False, kind=bool)
    """Swap in the fused Triton kernels of ``gallery_lib.accel.kernels`` where they apply (``--kernel-opt``)."""
    kernel_ops: str = setting("all", kind=str)
    """Which kernels ``kernels=True`` swaps in: ``all`` (the Triton kernels) or a comma list of ``group_norm_silu``,
    ``layer_norm``, ``geglu``, ``conv_bn_relu`` (recipes keep only those that measured faster than torch.compile's own
    code). ``conv_bn_relu`` folds a ResNet bottleneck's batch norms into cuDNN's fused convolutions; on a GPU it needs
    ``amp_dtype='float16'`` and the ``nvidia-cudnn-frontend`` package (``ci/setup_env.sh`` installs it on a GPU).
    ``auto``, what ``accelerated`` states on a GPU where its family's kernels depend on the step's size, is resolved
    for the step as it is read (``RunConfig.kernel_op_names``): the family's ``accelerated_on_large_steps`` kernels
    once a step's images per process hold ``large_step_pixels``, else those of its ``accelerated`` switches."""
    fused_attention: bool = setting(False, kind=bool)
    """Run window/self attention through ``scaled_dot_product_attention`` instead of explicit matmuls."""
    sdpa_math: bool = setting(False, kind=bool)
    """Force PyTorch's ``math`` attention kernel (flash, memory-efficient and cuDNN attention switched off): attention
    as explicit matmuls and a softmax, with its memory, as before PyTorch 2's fused kernels (the NVIDIA talk's
    baseline; the optimization ladder's first rungs)."""
    channels_last: bool = setting(False, kind=bool)
    """Keep image tensors (and conv weights) in channels-last memory format."""

    def check(self) -> None:
        if self.kernel_ops != AUTO and (not self.kernel_op_names
                                        or any(op not in KERNEL_OPS for op in self.kernel_op_names)):
            raise ConfigError(f"kernel_ops={self.kernel_ops!r} is invalid: expected 'all', 'auto' or a comma list "
                              f"of {', '.join(KERNEL_OPS)}.")
        if self.sdpa_math and self.fused_attention:
            raise ConfigError("sdpa_math=True and fused_attention=True contradict each other: the attention registry "
                              "picks its own kernels. Keep one of them.")

    @property
    def kernel_op_names(self) -> tuple[str, ...]:
        """``kernel_ops`` as names: every op for ``all``. ``auto`` depends on the step: ``RunConfig.kernel_op_names``
        resolves it."""
        if self.kernel_ops == AUTO:
            raise ValueError("kernel_ops='auto' is resolved for the step: read RunConfig.kernel_op_names")
        return kernel_ops_as_names(self.kernel_ops)


@dataclass(frozen=True, kw_only=True)
class Parallel(Section):
    """``parallel``: the training processes and how they share the training (DDP or ZeRO-2)."""

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
