"""The gallery's accelerations as one call each, on any model and training loop that the user brings: a plain
``nn.Module``, no config and no family (``accel/accelerate.py`` applies the same calls from a run's config).

Each call changes the module in place (parameters, ``state_dict`` keys and attributes keep their names) and returns
a ``Change``: what it did on this model, the one-line reason it helps, and where the measurement behind it is.
The calls compose, in the order ``accelerate`` applies them (the order of ``accel/accelerate.py``)::

    from gallery_lib import (add_ema, compile_blocks, compile_channels_last_graphs, compile_whole, fuse_attention,
                             fuse_kernels, use_channels_last)

    print(use_channels_last(model))   # channels_last: 53 conv weights in NHWC layout ...
    print(fuse_kernels(model))        # fused kernels: swapped 16: geglu=16 ...
    print(fuse_attention(model))      # fused attention: 32 diffusers attention layers ...
    print(compile_blocks(model))      # compiled blocks: 12 blocks compiled in place ...
    print(compile_whole(model))       # compiled whole: the whole model compiled in place, instead of its 12 blocks
    print(compile_channels_last_graphs(model))  # channels_last graphs: the whole model compiled again with ...
    ema = add_ema(model, optimizer)   # EMA of the weights: stream update ...

or the ones that measured faster, at once: ``changes = accelerate(model)``; with an example batch,
``accelerate(model, example=x)`` times a training step with and without each change and keeps only those that are
faster on this model, at these shapes, on this device (``accel/timed_changes.py``). A change can be undone
(``change.undo()``). A family's runs lay out, fuse and keep their EMA through the same calls (``accel/accelerate.py``,
``run/train.py``); they compile through their compile plan, which adds the precompile workers, and hook attention
through their family's hook.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch import nn

from gallery_lib.accel.change import Change
from gallery_lib.accel.keep_if_faster import MIN_GAIN, SteadyStepTimer, TrainingStep
from gallery_lib.accel.optimize import cache_file
from gallery_lib.accel.timed_changes import kept_if_faster, not_measured
from gallery_lib.config import TRITON_KERNEL_OPS
from gallery_lib.config.quiet import quiet_known_noise

RESULTS = "benchmarks/RESULTS.md"
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def use_channels_last(model: nn.Module, *, device_type: str | None = None) -> Change:
    """Puts the 4-D weights (2-D convolutions) in NHWC layout, what cuDNN's tensor-core convolutions read without a
    transpose; feed images in the same layout (``x.to(memory_format=torch.channels_last)``). ``device_type``: where
    the model will train (default: where its parameters are); the reason given is a GPU's, and says so elsewhere.

        print(use_channels_last(unet))
    """
    convs = [p for p in model.parameters() if p.dim() == 4]
    model.to(memory_format=torch.channels_last)
    what = f"{len(convs)} conv weights in NHWC layout" if convs else "no 4-D weight: nothing to change"
    why = "convolutions on tensor cores read NHWC without transposing"
    runs_on = _runs_on(model, device_type)
    if runs_on not in ("cuda", None):
        why = (f"on a GPU, {why} (the measurement is a GPU's; on {device_phrase(runs_on)} the layout is applied all "
               "the same)")
    undo = functools.partial(model.to, memory_format=torch.contiguous_format) if convs else None
    return Change("channels_last", what, why, f"{RESULTS}#sd15-layout", changed=bool(convs), undo=undo)


def has_convolutions_beyond_a_stem(model: nn.Module) -> bool:
    """More 4-D weights than a stem's (a ViT's patch embedding is one): a network channels_last pays on."""
    return sum(1 for p in model.parameters() if p.dim() == 4) > 2


def _runs_on(model: nn.Module, device_type: str | None) -> str | None:
    """Where ``model`` will run: ``device_type`` when given, else its parameters' device; ``None`` when unknown (no
    parameters, or a structure built on the ``meta`` device)."""
    if device_type is not None:
        return torch.device(device_type).type
    first = next(model.parameters(), None)
    return None if first is None or first.device.type == "meta" else first.device.type


def device_phrase(device_type: str) -> str:
    """``a CPU``, ``an MPS device``: the device as a sentence names it."""
    return {"cpu": "a CPU", "cuda": "a GPU", "mps": "an MPS device"}.get(device_type, f"a {device_type} device")


def fuse_kernels(model: nn.Module, ops: Iterable[str] | None = None, *, verbose: bool = False,
                 device_type: str | None = None) -> Change:
    """Swaps the layers the gallery has fused Triton kernels for (``gallery_lib.accel.kernels.patch.KERNEL_SWAPS``:
    GroupNorm with the SiLU after it, LayerNorm, GEGLU) for the fused modules, forward and backward; ``ops`` picks
    some of them (default: all but ``conv_bn_relu``, which is float16 only). On a CPU the fused modules run their
    PyTorch reference, so this is for a GPU, and the change says so (``device_type``: where the model will train;
    default: where its parameters are).

        print(fuse_kernels(unet, ops=["geglu"]))
    """
    from gallery_lib.accel.kernels.patch import KERNEL_OPS, apply_kernels

    chosen = tuple(ops) if ops is not None else tuple(op for op in KERNEL_OPS if op != "conv_bn_relu")
    unknown = sorted(set(chosen) - set(KERNEL_OPS))
    if unknown:
        raise ValueError(f"fuse_kernels: unknown op(s) {unknown}; choose from {list(KERNEL_OPS)}")
    report = apply_kernels(model, **{op: op in chosen for op in KERNEL_OPS})
    first, _, details = report.summary(verbose).partition("\n")
    what = first if report.swapped else f"no layer the {', '.join(chosen)} kernels replace"
    why = "one kernel where PyTorch launches several, each tensor read and written once"
    runs_on = _runs_on(model, device_type)
    if runs_on not in ("cuda", None):
        why = (f"on a GPU, {why}; on {device_phrase(runs_on)} the swapped modules run their PyTorch reference, not a "
               "fused kernel")
    return Change("fused kernels", what, why, f"{RESULTS}#kernels", changed=bool(report.swapped), details=details,
                  handle=report, undo=report.undo if report.swapped else None)


def fuse_attention(model: nn.Module) -> Change:
    """Routes the attention layers the gallery's registry knows through it (``gallery_lib.accel.attention``): timm
    Swin's window attention (its relative-position bias added inside the window-attention kernel on a GPU, else the
    fastest backend measured that takes a bias) and a diffusers model's attention layers (the backend measured
    fastest per shape). A model with neither is left as it is (the change says so).

        print(fuse_attention(swin))
    """
    from gallery_lib.accel.attention import hook_diffusers_attention, hook_swin_attention

    if _has_window_attention(model):
        hook = hook_swin_attention(model, backend="auto")
        return Change("fused attention", f"{len(hook.modules)} Swin window-attention modules through "
                      "gallery_lib.accel.attention (auto: the window-attention kernel on a GPU, else the fastest "
                      "measured backend that takes the relative-position bias and shift mask)",
                      "plain SDPA given the bias as a mask picks a slower kernel; the registry runs the fastest that "
                      "takes the bias", f"{RESULTS}#attention", handle=hook, undo=hook.remove)
    if hasattr(model, "attn_processors"):
        hook = hook_diffusers_attention(model, backend="auto")
        return Change("fused attention", f"{len(hook.modules)} diffusers attention layers use the fastest measured "
                      "backend per shape (gallery_lib.accel.attention)", _ATTENTION_WHY, f"{RESULTS}#attention",
                      handle=hook, undo=hook.remove)
    return Change("fused attention", f"{type(model).__name__} has no attention layer the registry knows (timm Swin's "
                  "window attention, diffusers' attention): nothing to change", _ATTENTION_WHY, f"{RESULTS}#attention",
                  changed=False)


def _has_window_attention(model: nn.Module) -> bool:
    return any(type(m).__name__ == "WindowAttention" and hasattr(m, "_get_rel_pos_bias") for m in model.modules())


_ATTENTION_WHY = "PyTorch's own SDPA choice is not the fastest for every shape, and the registry times each once"


def compile_blocks(model: nn.Module, block_types: Iterable[type | str] | None = None, *,
                   mode: str | None = None, device_type: str | None = None, **compile_kwargs: Any) -> Change:
    """Compiles each repeated block of ``model`` in place with ``torch.compile`` (regional compilation): one graph
    per distinct block, not one for the whole model, so compiling takes a fraction of the time. ``block_types``
    names the block classes (default: the gallery families' blocks where the model has them, else its most repeated
    block class); ``mode="reduce-overhead"`` replays each block as a CUDA graph on a GPU, and on a CPU runs the
    blocks without graphs (the change says which: ``device_type`` is where the model will train, by default where
    its parameters are). Compilation happens in the first steps.

        print(compile_blocks(vit, mode="reduce-overhead"))
    """
    from gallery_lib.accel.compile.drop_path import rates_as_tensors
    from gallery_lib.accel.compile.regional import (block_names, regional_compile, registered_block_types,
                                                    undo_regional_compile)

    quiet_known_noise()  # it compiles in this process (a notebook's kernel): the same quiet as a gallery run
    types = tuple(block_types) if block_types is not None else None
    if types is None:
        try:
            block_names(model, registered_block_types())
            types = registered_block_types()
        except ValueError:
            types = (repeated_block_type(model),)
    names = regional_compile(model, types, **({"mode": mode} if mode else {}), **compile_kwargs)
    rates, restore_rates = rates_as_tensors(model)  # else each block's own rate makes it a graph of its own
    kinds = Counter(type(model.get_submodule(name)).__name__ for name in names)
    graphs = graphs_text(mode, _runs_on(model, device_type))
    shared = f"; {rates} stochastic-depth rates held as tensors, so blocks of one shape share a graph" if rates else ""
    what = (f"{len(names)} blocks compiled in place ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}"
            f"{graphs}){shared}; compilation happens in the first steps")
    why = ("Inductor fuses each block's memory-bound ops, and compiling repeated blocks instead of the whole model "
           "leaves far fewer graphs to compile")

    def undo() -> None:
        undo_regional_compile(model, names)
        restore_rates()

    return Change("compiled blocks", what, why, f"{RESULTS}#sd15-compile-time", undo=undo)


def compile_whole(model: nn.Module, *, mode: str | None = None, device_type: str | None = None,
                  **compile_kwargs: Any) -> Change:
    """Compiles the whole ``model`` in place (``model.compile``), as a plain PyTorch user does: one graph for the
    forward and one for the backward, so Inductor also fuses across the blocks' edges (the stem, the head), and with
    ``mode="reduce-overhead"`` on a GPU one CUDA graph replays each. Blocks compiled in place before
    (``compile_blocks``) run inside it as the plain modules they were; ``undo`` compiles them in place again, with
    their compiled code kept. Compiling takes longer than for the blocks alone; ``accelerate(model, example=...)``
    keeps it only where a step is faster than with the blocks."""
    quiet_known_noise()
    blocks = {name: module._compiled_call_impl for name, module in model.named_modules()
              if name and getattr(module, "_compiled_call_impl", None) is not None}
    for name in blocks:
        model.get_submodule(name)._compiled_call_impl = None
    model.compile(**({"mode": mode} if mode else {}), **compile_kwargs)

    def undo() -> None:
        model._compiled_call_impl = None
        for name, compiled in blocks.items():
            model.get_submodule(name)._compiled_call_impl = compiled

    instead = f", instead of its {len(blocks)} blocks compiled in place" if blocks else ""
    what = (f"the whole model compiled in place{graphs_text(mode, _runs_on(model, device_type))}{instead}; "
            "compilation happens in the first steps")
    why = ("one graph for the whole step: Inductor fuses across the blocks' edges too, and a CUDA graph replays "
           "the step in one launch")
    return Change("compiled whole", what, why, f"{RESULTS}#your-model", undo=undo)


def compile_channels_last_graphs(model: nn.Module, *, mode: str | None = None,
                                 device_type: str | None = None) -> Change:
    """Compiles again, in place, what of ``model`` is compiled (the whole model, or its blocks compiled in place) with
    channels_last forced through every graph, attention's tensors left in their own layout. Inductor lays a graph out
    channels_last only where it holds forward convolutions, so the backward graphs keep NCHW gradients and cuDNN
    converts between the layouts at every convolution. ``undo`` puts the compiled code before it back."""
    from gallery_lib.accel.compile.attention_layout import channels_last_graph_options
    from gallery_lib.accel.compile.regional import mode_options, with_block_defaults

    quiet_known_noise()
    before = {name: module._compiled_call_impl for name, module in model.named_modules()
              if getattr(module, "_compiled_call_impl", None) is not None}
    name = "channels_last graphs"
    why = ("no NCHW/NHWC conversions around the convolutions of the backward graphs, which Inductor leaves in NCHW "
           "where it does not force the layout")
    where = f"{RESULTS}#sd15-layout"
    if not before:
        return Change(name, "nothing compiled to lay out", why, where, changed=False)
    options = {**mode_options(mode), **channels_last_graph_options()}
    for module_name in before:  # "" is the model itself, compiled whole
        module = model.get_submodule(module_name)
        module.compile(options=options, **({} if module is model else with_block_defaults({})))  # as compiled before

    def undo() -> None:
        for module_name, compiled in before.items():
            model.get_submodule(module_name)._compiled_call_impl = compiled

    what = "the whole model" if "" in before else f"its {len(before)} compiled blocks"
    return Change(name, f"{what} compiled again with channels_last through every graph"
                  f"{graphs_text(mode, _runs_on(model, device_type))}; compilation happens in the first steps",
                  why, where, undo=undo)


def graphs_text(mode: str | None, runs_on: str | None) -> str:
    """What a compile ``mode`` adds where the model runs: CUDA graphs on a GPU only (elsewhere the mode compiles
    without them, and nothing is said)."""
    if mode not in ("reduce-overhead", "max-autotune") or runs_on not in ("cuda", None):
        return ""
    return ", CUDA graphs" if runs_on == "cuda" else ", CUDA graphs where it runs on a GPU"


def repeated_block_type(model: nn.Module) -> type:
    """The class of ``model``'s repeated block: among the classes with children that occur at least twice, the one
    with the most instances whose outermost instances hold at least half the parameters (a transformer's ``Block``,
    a ConvNeXt's ``ConvNeXtBlock``), else the one holding the most parameters."""
    total = sum(p.numel() for p in model.parameters()) or 1
    counts = Counter(type(m) for m in model.modules()
                     if m is not model and not isinstance(m, _CONTAINERS) and next(m.children(), None) is not None)
    repeated = [cls for cls, n in counts.items() if n >= 2]
    if not repeated:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no repeated block; pass block_types=(...) or "
                         "compile the whole model with torch.compile")

    def share(cls: type) -> float:
        return sum(p.numel() for m in _outermost(model, cls) for p in m.parameters()) / total
    large = [cls for cls in repeated if share(cls) >= 0.5]
    if large:
        return max(large, key=lambda cls: (counts[cls], share(cls)))
    return max(repeated, key=share)


def _outermost(model: nn.Module, cls: type) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if type(child) is cls:
                found.append(child)
            else:
                visit(child)
    visit(model)
    return found


def add_ema(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, decay: float = 0.9999,
            mode: str = "auto", ratio_warmup: bool = True, echo: Callable[[str], Any] | None = print, **options: Any):
    """An EMA of ``model``'s weights (``gallery_lib.accel.ema.ModelEma``: call ``ema.update(model)`` after each
    optimizer step, ``ema.module`` for the averaged model). ``mode="auto"`` updates on a side CUDA stream with one
    fused kernel on a GPU (``stream``; the next optimizer step waits for it, so pass ``optimizer``), and with
    PyTorch's multi-tensor ops on a CPU (``foreach``); ``ratio_warmup`` is diffusers' ``(1 + step) / (10 + step)``
    decay ramp. An ``AdamWWithEma`` optimizer takes the update into its pass. ``offload=True`` keeps the EMA's
    weights in the CPU's memory between updates (``ModelEma``'s ``offload``). ``echo`` gets the change
    (``ema.change``).

        ema = add_ema(unet, optimizer)
        ...
        optimizer.step(); ema.update(unet)
    """
    from gallery_lib.accel.ema import ModelEma, ema_mode_on
    from gallery_lib.accel.ema_offload import CHUNK_BYTES

    device_type = next(model.parameters()).device.type
    asked = ("stream" if device_type == "cuda" else "foreach") if mode == "auto" else mode
    offload = bool(options.get("offload"))
    # said in the change, so ModelEma need not warn of it
    effective, fallback = ema_mode_on(asked, device_type, offload)
    ema = ModelEma(model, decay=decay, ratio_warmup=ratio_warmup, mode=effective, **options)
    if ema.effective_mode == "stream" and optimizer is not None:
        ema.attach_optimizer(optimizer)  # the next optimizer step waits for the side-stream update
    because = f" ({asked} asked, but {fallback})" if fallback else ""
    how = f"{ema.effective_mode} update{because}"
    if hasattr(optimizer, "attach_ema"):  # an AdamWWithEma (gallery_lib.accel.adamw_ema)
        optimizer.attach_ema(ema, model)
        how = f"in the fused AdamW's pass (a {how} where its kernel cannot run)"
        why, measured = ("one kernel for AdamW and the EMA, which reads each weight once instead of twice",
                         f"{RESULTS}#adamw-ema")
    elif offload and ema.effective_mode == "stream":
        how += (", its weights kept in the CPU's memory between updates and streamed through the GPU in "
                f"{CHUNK_BYTES >> 20} MiB chunks on side streams")
        why, measured = ("the copies to and from the CPU's memory run beside the next forward and backward instead of "
                         "between them, and the GPU holds two chunks of the EMA, not a copy", f"{RESULTS}#ema")
    elif offload:
        how += ", its weights kept in the CPU's memory between updates"
        why, measured = ("the GPU holds no EMA during the forward and backward passes, whose activations need the "
                         "memory, as diffusers' offload_ema", f"{RESULTS}#memory-plan")
    else:
        why, measured = ("one fused update kernel on a side stream, beside the next forward, instead of a kernel per "
                         "tensor on the main stream", f"{RESULTS}#ema")
    warmup = " after diffusers' (1 + step) / (10 + step) warm-up" if ratio_warmup else ""
    ema.change = Change("EMA of the weights", f"{how}, decay {decay}{warmup}", why, measured)
    if echo is not None:
        echo(str(ema.change))
    return ema


def accelerate(model: nn.Module, *, example: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               device_type: str | None = None, compile: bool = True, echo: Callable[[str], Any] | None = print,
               min_gain: float = MIN_GAIN, cache: bool | str | os.PathLike = True,
               timer: Callable[[Callable[[], Any], torch.device], float] | None = None,
               progress: Callable[[str], Any] | None = None) -> list[Change]:
    """Applies the accelerations that suit the device ``model`` is on, in the gallery's order, and returns (and by
    default prints) what each changed: on a GPU channels_last (for a model with convolutions), the fused kernels
    (GEGLU alone when compiling: the one kernel that beats Inductor's code at every step size; with ``example``
    GroupNorm+SiLU's and LayerNorm's too, each timed on its own) and the blocks compiled and replayed as CUDA
    graphs, and the attention registry for Swin's window attention; on a CPU the blocks compiled (the fused kernels
    are GPU code). Not the registry for other attention: on SD's shapes PyTorch's own SDPA choice measured as fast
    (``fuse_attention`` is there to try).

    Without ``example`` each change is applied on what other models measured, and says that it was not measured on
    this one. With ``example`` (what the model is called with, on its device) each change is timed: a few training
    steps (forward, ``loss_fn``, backward; no optimizer step) with it and without it, each against the state the
    changes before it left, and undone unless it is faster by more than ``min_gain`` (2%: timing noise); its
    ``Change`` says so with both times, and ``decision`` holds them. The changes the fair peer itself makes
    (channels_last on a convnet, the whole model compiled) are the other way round: kept unless they make the step
    slower by more than ``min_gain``, so a tie ends where the peer is (``timed_changes.PEER_CHOICES``). Then the
    whole model compiled (``compile_whole``, what a plain ``torch.compile`` user does) is timed in place of the
    blocks, so a model whose blocks compiled alone lose to it ends no slower than that; on a GPU, a model with
    convolutions then has what is compiled compiled again with channels_last through every graph
    (``compile_channels_last_graphs``), kept where it is faster. Once compiled, each change kept before the compiler
    (but channels_last, a layout) is timed again without it, and left out where the compiler's own code is as fast:
    under the blocks before the whole model is tried, and at the end under what is compiled then; each change left
    out before the compiler is then tried once more under what is compiled (an eager step can misjudge a kernel that
    pays once compiled), so a model that ends compiled has its kernels judged there. The weights,
    gradients, buffers and random state are left as they were. The times are cached per model structure, input
    shapes and dtypes, autocast state, device and torch version, so the next call times nothing. Compiled blocks that
    are undone run eagerly again; their compiled code (with CUDA graphs, its memory pool) stays in Dynamo's cache
    until ``torch._dynamo.reset()``.

        changes = accelerate(model)    # then train as before: the same parameters, the same optimizer
        changes = accelerate(model, example=images, loss_fn=lambda logits: F.cross_entropy(logits, labels))
        # prints each, e.g. fused attention: left out: 41.2 ms with it, 35.9 ms without (this model, batch 64, cuda)

    Args:
        example: a batch as the model takes it: a tensor, a tuple of positional arguments or a dict of keyword
            arguments (not an ``(inputs, labels)`` pair: the labels go in ``loss_fn``). Call ``accelerate`` under the
            autocast your loop uses, so the steps are timed in its precision.
        loss_fn: the model's output to the scalar loss (default: the mean of a tensor output).
        device_type: where the model will train (default: where its parameters are); with ``example``, it must be
            where the model is, since that is where the steps are timed.
        compile: compile the repeated blocks.
        echo: where each change is said (``None``: nowhere).
        min_gain: how much faster a change must make the step to be kept (for the peer's own choices: how much
            slower, to be left out).
        cache: ``True`` for ``accelerate.json`` in the gallery's cache folder (``optimize``'s), a path for another,
            ``False`` to time every time.
        timer: ``timer(step, device)`` runs ``step()`` and returns its time in ms (default: ``SteadyStepTimer()``, the
            median of 10 steps after 3 of warm-up).
        progress: where each timing is said as it ends (``with compiled whole reduce-overhead: 34.1 ms a step, timed
            in 52.3 s``): on a large model compiling makes the call take minutes (default: nowhere).
    """
    runs_on = next(model.parameters()).device.type
    device_type = device_type or runs_on
    if example is None and (loss_fn is not None or timer is not None):
        raise ValueError("accelerate: loss_fn= and timer= time the steps of an example; pass example= too")
    if example is not None and device_type != runs_on:
        raise ValueError(f"accelerate: device_type={device_type!r}, but the model is on {runs_on}, where an example's "
                         f"steps would be timed; move the model to {device_type} first, or leave device_type out")
    steps = _planned_changes(model, device_type, compile=compile, measured=example is not None)
    if example is None:
        changes: Iterable[Change] = (not_measured(call()) for _, call in steps)
    else:
        step = TrainingStep(model, example, loss_fn)
        changes = kept_if_faster(model, steps, step, timer or SteadyStepTimer(), min_gain,
                                 cache_file(cache, "accelerate.json"), progress)
    done = []
    for change in changes:
        done.append(change)
        if echo is not None:
            echo(str(change))
    return done


def _planned_changes(model: nn.Module, device_type: str, *, compile: bool,
                     measured: bool) -> list[tuple[str, Callable[[], Change]]]:
    """The changes ``accelerate`` tries on ``model`` where it trains (``device_type``), in order: each as what the
    cache knows it by, and the call that makes it; the ones only ``measured`` keeps come last."""
    on_gpu = device_type == "cuda"
    convnet = on_gpu and has_convolutions_beyond_a_stem(model)  # what channels_last pays on
    steps: list[tuple[str, Callable[[], Change]]] = []
    if on_gpu:
        if convnet:
            steps.append(("channels_last", lambda: use_channels_last(model, device_type=device_type)))
        # Under Inductor GEGLU's kernel beats Inductor's code at every step size; GroupNorm+SiLU's only on large steps,
        # which a call without the data cannot see (benchmarks/RESULTS.md#sd15-gn-by-batch); with it, each other
        # kernel is timed on its own, and kept only where it still pays once compiled.
        ops = ("geglu",) if compile else None
        steps.append((f"fused kernels {','.join(ops) if ops else 'all'}",
                      lambda: fuse_kernels(model, ops=ops, device_type=device_type)))
        if compile and measured:
            for op in (op for op in TRITON_KERNEL_OPS if op not in ops):
                steps.append((f"fused kernels {op}",
                              lambda op=op: fuse_kernels(model, ops=(op,), device_type=device_type)))
        if _has_window_attention(model):  # Swin's biased windows; on SD's shapes PyTorch's own choice is as fast
            steps.append(("fused attention", lambda: fuse_attention(model)))
    if compile:
        mode = "reduce-overhead" if on_gpu else None
        steps.append((f"compiled blocks {mode}",
                      lambda: compile_blocks(model, mode=mode, device_type=device_type)))
        if measured:  # measured only: it compiles longer, and where it is faster varies by model
            steps.append((f"compiled whole {mode}",
                          lambda: compile_whole(model, mode=mode, device_type=device_type)))
            if convnet:  # DreamBooth's lever (RESULTS.md#dreambooth)
                steps.append((f"compiled channels_last graphs {mode}",
                              lambda: compile_channels_last_graphs(model, mode=mode, device_type=device_type)))
    return steps
