"""Applies a config's accelerations to a freshly built model, in one fixed, commented order.

The order matters and is the same for every model and recipe:

1. memory format (channels_last) - parameters must be in their final layout before anything
   captures them; gradient checkpointing is switched on here too (it changes no module, only how each
   block's forward keeps its activations);
2. kernel swap (``gallery_lib.accel.kernels.patch``) - replaces submodules, so it goes before anything that
   traces or snapshots the module tree;
3. attention backend - same reason, and it changes what the compiler will see;
4. precision (O2) - fp32 master copies are taken from the final modules, then weights are cast;
5. data parallelism (``gallery_lib.accel.distributed``) - DDP wraps the module that is trained; ZeRO-2 shards it in
   place (FSDP2's ``fully_shard`` on each repeated block, then on the root) after taking a plain template of it,
   from which the EMA and the export rebuild plain modules;
6. compile - last. The whole model (``compile_scope='model'``) is compiled on the DDP-wrapped module, so
   TorchDynamo's DDPOptimizer can split graphs at gradient-bucket boundaries and overlap communication
   with the backward pass (PyTorch's recommended order for DDP), or on the sharded root. The blocks
   (``compile_scope='blocks'``) are compiled in place inside whatever wraps them, as torchtitan compiles per block,
   and keep under DDP the graphs one process compiles (``keep_block_graphs_whole_under_ddp``).

Each step appends a line to ``notes``; the training log prints them so a run says what it did.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint

from gallery_lib.config import RunConfig
from gallery_lib.config.sections.acceleration import AUTO
from gallery_lib.config.sections.acceleration import Compile as CompileSettings
from gallery_lib.config.sections.acceleration import Parallel as ParallelSettings
from gallery_lib.accel.compile.plan import CompilePlan
from gallery_lib.accel.compile.cpu_codegen import use_safe_cpu_codegen
from gallery_lib.accel.distributed import DistInfo, apply_zero2, keep_block_graphs_whole_under_ddp, wrap_ddp
from gallery_lib.accel.precision import Precision
from gallery_lib.accel.on_any_model import fuse_kernels, use_channels_last

if TYPE_CHECKING:  # imported where fused_attention is on: the core loop does not need the registry
    from gallery_lib.accel.attention import AttentionHook


@dataclass
class AcceleratedModel:
    module: torch.nn.Module
    """The model as built (parameters, state_dict keys); with ZeRO-2, sharded in place."""
    train_module: torch.nn.Module
    """What the loop calls: possibly DDP-wrapped and compiled."""
    compile_plan: CompilePlan
    """What was compiled and how (the blocks compiled in place, their precompilation, the cache statistics)."""
    notes: list[str] = field(default_factory=list)
    attention: AttentionHook | None = None
    """The attention hook when ``fused_attention``: its ``selector.chosen`` says what each attention shape ran."""
    template: torch.nn.Module | None = None
    """ZeRO-2: the model before sharding, its parameters on the meta device (``meta_template``): what the EMA and the
    export build plain modules from. ``None`` with DDP."""


def apply_accelerations(model: torch.nn.Module, cfg: RunConfig, precision: Precision, dist: DistInfo,
                        compile_plan: CompilePlan | None = None) -> AcceleratedModel:
    """``model`` with ``cfg``'s accelerations; ``compile_plan`` is the run's (opened before the model was built, so its
    precompile workers start early), else one without workers."""
    plan = compile_plan if compile_plan is not None else CompilePlan(
        dist, compile=cfg.replace(precompile_workers=0).sections.compile, family=cfg.model_family, job=cfg.sections.job,
        batch_size=cfg.batch_size, image_size=cfg.image_size)
    notes: list[str] = []
    attention = None
    if cfg.channels_last:
        notes.append(use_channels_last(model, device_type=dist.device.type).note)
    if cfg.gradient_checkpointing:
        notes.append(enable_gradient_checkpointing(model))
    if cfg.kernels:
        notes.append(fuse_kernels(model, cfg.kernel_op_names, verbose=cfg.verbose, device_type=dist.device.type).note)
    if cfg.fused_attention:  # the family's hook (RunConfig refuses the switch for a family without one)
        note, attention = cfg.model_family.attention_hook(model)
        notes.append(note)
    precision.cast_model(model)
    notes.append(f"precision: {precision.describe()}")
    train_module, template = _apply_data_parallel(model, cfg.sections.parallel, cfg.model_family.block_types, dist,
                                                  notes)
    tuning = "".join(text for on, text in (
        (cfg.coordinate_descent_tuning, ", coordinate-descent tuning of its kernels"),
        (cfg.tiled_reductions, ", reductions tiled in 2D"),
        (cfg.channels_last_graphs, ", channels_last through every graph")) if on)
    if cfg.compile and dist.device.type == "cpu":
        codegen_note = use_safe_cpu_codegen()  # AVX-512 C++ that this machine's compiler gets wrong: AVX2 instead
        if codegen_note:
            notes.append(codegen_note)
    mode = cfg.resolved_compile_mode  # its ``auto`` resolved for this run's step
    if cfg.compile and cfg.gradient_checkpointing and dist.device.type == "cuda":
        notes.append(plan.cache_checkpointed_graphs())
    if cfg.compile and cfg.compile_scope == "blocks":
        if train_module is not model:  # DDP-wrapped (ZeRO-2 shards the model in place)
            keep_block_graphs_whole_under_ddp()
        # Static shapes, as whole-model compilation has: each block shape gets its own graph.
        kwargs = compile_kwargs(cfg.sections.compile, mode)
        names = plan.compile_blocks(model, backend="inductor", dynamic=False, **kwargs)
        whole = "".join(f", {name} whole" for name in cfg.compile_whole_types)
        notes.append(f"torch.compile(mode={mode!r}{tuning}) of {len(names)} repeated blocks in place{whole}"
                     + (f", precompiled by {cfg.precompile_workers} processes before the first step"
                        if cfg.precompile_workers else "; compilation happens in the first warm-up steps"))
    elif cfg.compile:
        train_module = torch.compile(train_module, **compile_kwargs(cfg.sections.compile, mode))
        notes.append(f"torch.compile(mode={mode!r}{tuning}); compilation happens in the first warm-up "
                     "steps")
    return AcceleratedModel(module=model, train_module=train_module, compile_plan=plan, notes=notes,
                            attention=attention, template=template)


def compile_kwargs(settings: CompileSettings, mode: str | None = None) -> dict[str, Any]:
    """``torch.compile``'s arguments for a run's compile ``settings`` (``cfg.sections.compile``): its mode (``mode``,
    the run's ``cfg.resolved_compile_mode``, where the settings' own is ``auto``), or, with
    ``coordinate_descent_tuning``, ``tiled_reductions`` or ``channels_last_graphs``, the mode's Inductor options plus
    theirs (``torch.compile`` takes a mode or options, not both). The channels_last layout leaves attention's tensors
    in their own layout (``attention_layout``)."""
    from gallery_lib.accel.compile.attention_layout import channels_last_graph_options
    from gallery_lib.accel.compile.regional import mode_options

    mode = mode or settings.compile_mode
    if mode == AUTO:
        raise ValueError("compile_mode='auto' is resolved for the run's step: pass cfg.resolved_compile_mode")
    mode = None if mode == "default" else mode
    extra = {**({"coordinate_descent_tuning": True} if settings.coordinate_descent_tuning else {}),
             **({"triton.prefer_nd_tiling": True, "triton.tile_reductions": True} if settings.tiled_reductions else {})}
    if not extra and not settings.channels_last_graphs:
        return {"mode": mode}
    options = {**mode_options(mode), **extra}
    if settings.channels_last_graphs:
        options.update(channels_last_graph_options())
    return {"options": options}


def _apply_data_parallel(model: torch.nn.Module, parallel: ParallelSettings, block_types: tuple[str, ...],
                         dist: DistInfo, notes: list[str]) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The module the loop trains (DDP-wrapped, or ``model`` sharded in place at its ``block_types``) and, for
    ZeRO-2, the plain template."""
    if parallel.data_parallel == "zero2":
        blocks, template = apply_zero2(model, block_types, dist)
        notes.append(f"ZeRO-2 over {dist.world_size} process(es): FSDP2 fully_shard(reshard_after_forward=False) of "
                     f"{len(blocks)} blocks and the root; gradients and optimizer state sharded")
        return model, template
    train_module = wrap_ddp(model, dist, bucket_cap_mb=parallel.ddp_bucket_cap_mb,
                            static_graph=parallel.ddp_static_graph, grad_compression=parallel.ddp_grad_compression)
    if train_module is not model:
        notes.append(f"DDP over {dist.world_size} processes: gradients as bucket views, {parallel.ddp_bucket_cap_mb} "
                     f"MB buckets{', static graph' if parallel.ddp_static_graph else ''}"
                     f"{', bf16 all-reduce' if parallel.ddp_grad_compression == 'bf16' else ''}")
    return train_module, None


_CHECKPOINTING = ("enable_gradient_checkpointing", "activation_checkpointing_enable", "gradient_checkpointing_enable",
                  "set_grad_checkpointing")
"""How diffusers, transformers (its current name, then the one before) and timm models switch it on."""


def checkpointed_call(module: torch.nn.Module, *args):
    """diffusers' default checkpoint function (non-reentrant ``torch.utils.checkpoint`` of the module's call), defined
    at module level: the blocks that hold it can be pickled for the precompile workers."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)


def enable_gradient_checkpointing(model: torch.nn.Module) -> str:
    """Switches on the library's own gradient checkpointing of ``model``, or of each outermost submodule that has
    it (a UNet and a text encoder trained together); returns the log line. ``ConfigError`` when nothing has it."""
    from gallery_lib.config import ConfigError

    switched: list[str] = []

    def visit(module: torch.nn.Module, name: str) -> None:
        method = next((m for m in _CHECKPOINTING if callable(getattr(module, m, None))), None)
        if method is None:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)
            return
        switch = getattr(module, method)
        if method == "set_grad_checkpointing":
            switch(True)
        elif "gradient_checkpointing_func" in inspect.signature(switch).parameters:
            switch(gradient_checkpointing_func=checkpointed_call)  # diffusers' own is a closure: no pickling
        else:
            switch()
        switched.append(f"{name or type(module).__name__} ({method})")
    visit(model, "")
    if not switched:
        raise ConfigError(f"gradient_checkpointing=True: {type(model).__name__} has no gradient checkpointing of its "
                          f"own (none of {', '.join(_CHECKPOINTING)}): drop the switch for this model.")
    return f"gradient checkpointing: {', '.join(switched)}; blocks recompute their activations in the backward"
