"""Named recipes: each is ``base.replace(...)`` of one base config, so runs differ only where named.

``baseline``    what a user runs today (the Swin reference code, diffusers' ``train_text_to_image.py``, the
                torchvision ResNet recipe): eager, AMP O1 (float16 with a GradScaler on a GPU), the family's
                optimizer unfused, a per-tensor EMA loop when the profile trains an EMA, DDP when several processes.
``compiled``    plain ``torch.compile``: compile + bfloat16 autocast + fused optimizer + foreach EMA.
``peer``        the strongest plain-PyTorch setup a skilled user writes in a few lines: ``compiled`` plus the switches
                the family declares (``ModelFamily.peer``: cached latents for diffusion, channels_last for convnets
                and Swin), replayed as CUDA graphs on a GPU where they pay (``mode="reduce-overhead"``).
                ``accelerated`` has to beat it; ``gallery bench`` measures both.
``accelerated`` ``compiled`` plus the switches that measured faster for the model's family, which the family
                declares (``ModelFamily.accelerated`` in ``gallery_lib/families/<family>.py``, each with a pointer
                to its measurement in ``benchmarks/RESULTS.md``).

Whether a run keeps an EMA at all is the profile's choice (``ema`` on or ``off``); a recipe only picks how the
update runs. The plain recipes set the task settings that ``accelerated`` switches back to their defaults.

What a recipe chooses by the size of the step it states as intent, ``compile_mode='auto'`` and
``kernel_ops='auto'``, which the config resolves for its own batch size wherever it is read
(``gallery_lib/config/step_size.py``): a run at another batch size runs what the recipe would choose there, and a
value the user names runs as named at every size. No note in ``extra`` decides them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from gallery_lib.config import CUDA_GRAPH_COMPILE_MODES, ConfigError, RunConfig, resolve_device, visible_cuda_devices
from gallery_lib.config.step_size import AUTO
from gallery_lib.recipes.memory_fit import fit_to_memory, refuse_beyond_host_memory, uncompiled
from gallery_lib.run.memory_plan import NAMED, read_budget, read_host_budget


def baseline(base: RunConfig) -> RunConfig:
    """Eager PyTorch with AMP O1 and the standard (unfused) optimizer: the reference everyone starts from."""
    return base.replace(recipe="baseline", amp_level="O1", amp_dtype="auto", compile=False, fused_optimizer=False,
                        kernels=False, fused_attention=False, channels_last=False, ema=_ema_mode(base, "loop"),
                        **base.model_family.plain_options())


def compiled(base: RunConfig) -> RunConfig:
    """``torch.compile`` with bfloat16 autocast, a fused optimizer and a foreach EMA: what a user picks next."""
    return base.replace(recipe="compiled", amp_level="O1", amp_dtype="bfloat16", compile=True, compile_mode="default",
                        fused_optimizer=True, kernels=False, fused_attention=False, channels_last=False,
                        ema=_ema_mode(base, "foreach"), **base.model_family.plain_options())


def peer(base: RunConfig) -> RunConfig:
    """The strongest plain-PyTorch setup a skilled user writes in a few lines: ``compiled`` plus the family's peer.

    On a GPU that user adds one word, ``mode="reduce-overhead"``: the compiled model replays as CUDA graphs, at the
    batch sizes where ``accelerated`` replays its own (``ModelFamily.block_graphs_below_pixels``). What such a user
    adds for the family (``ModelFamily.peer``, which may also turn the graphs off): the frozen encoders run once over
    the data for Stable Diffusion and DreamBooth (cached latents), channels_last images for convnets and Swin.
    It is the bar ``accelerated`` is measured against (``gallery bench``), so that its gains are over the best a user
    gets without this library, not over the easy setup.
    """
    # The graphs made every family's plain model faster or left it the same (benchmarks/RESULTS.md#peer).
    graphs = {"compile_mode": AUTO} if runs_on_gpu(base) else {}
    switches = {**graphs, **base.model_family.peer}
    return compiled(base).replace(recipe="peer", **_without_graphs_where_they_cannot_replay(base, switches))


def accelerated(base: RunConfig) -> RunConfig:
    """Everything that measured faster than ``compiled`` on the GPU, for the model's family."""
    switches = dict(base.model_family.accelerated)
    on_gpu = runs_on_gpu(base)
    if on_gpu:
        switches.update(base.model_family.accelerated_on_gpu)
    if base.gradient_checkpointing:
        # compiled whole, as the peer is: Inductor then sees the recomputation inside one graph, where the blocks
        # compiled in place left it to eager checkpointing around them (SD-1.5 at batch 8 in 22 GiB: 36.0 img/s,
        # the peer compiled whole 56.5; benchmarks/RESULTS.md#memory-plan)
        switches["compile_scope"] = "model"
        # and with the peer's EMA where the EMA stays on the GPU: the side-stream update was measured beside replayed
        # graphs, which checkpointing turns off, and without them it measured slower (SD-1.5, batch 8 checkpointed:
        # 55.1 img/s, foreach 61.3). Kept in the CPU's memory, the EMA streams through the GPU in chunks beside the
        # step instead of the peer's copies of the whole average: faster (benchmarks/RESULTS.md#sd-16-ema-stream)
        if switches.get("ema") == "stream" and not base.ema_offload:
            del switches["ema"]
    if base.compile_scope != "model":  # named by the user (``recipe_config`` reads it first): wins over the family's
        switches["compile_scope"] = base.compile_scope
    if base.data_parallel == "zero2" or base.gradient_checkpointing:
        # compiled whole, their blocks sharded or checkpointed inside them: a path never measured
        switches.pop("compile_whole", None)
    if "ema" in switches:
        switches["ema"] = _ema_mode(base, switches["ema"])
    if on_gpu and "compile_mode" not in switches:  # the blocks or whole model replayed as CUDA graphs where they pay
        switches["compile_mode"] = AUTO
    if on_gpu and base.model_family.accelerated_on_large_steps:  # kernels that pay once a step gives them work enough
        switches["kernel_ops"] = AUTO
    if on_gpu and switches.get("compile_scope") == "blocks" and base.data_parallel != "zero2":
        # precompiled in parallel; ZeRO-2's sharded blocks cannot be copied to the workers
        switches["precompile_workers"] = precompile_workers_for_machine()
    return compiled(base).replace(recipe="accelerated", **_without_graphs_where_they_cannot_replay(base, switches))


def _without_graphs_where_they_cannot_replay(base: RunConfig, switches: dict[str, Any]) -> dict[str, Any]:
    """``switches`` with a CUDA-graph ``compile_mode`` (a family's, at every size) turned back to ``default`` where
    ``base`` cannot replay them (``RunConfig.graphs_can_replay``); ``auto`` leaves them out there itself."""
    if not base.graphs_can_replay and switches.get("compile_mode") in CUDA_GRAPH_COMPILE_MODES:
        return {**switches, "compile_mode": "default"}
    return switches


def notebook_recipes(base: RunConfig) -> list[str]:
    """What a family's notebook runs by default: ``baseline``, ``compiled`` and ``accelerated``, and on a GPU also
    ``peer``, the bar README's comparison is against (on a CPU its speed means nothing, and its compile costs time)."""
    return ["baseline", "compiled", *(["peer"] if runs_on_gpu(base) else []), "accelerated"]


def runs_on_gpu(base: RunConfig) -> bool:
    """Whether runs of ``base`` train on a GPU here (``device`` resolved on this machine)."""
    return resolve_device(base.device, visible_cuda_devices()) == "cuda"


def precompile_workers_for_machine() -> int:
    """Half the cores, at most 8 (benchmarks/RESULTS.md#sd15-compile-time); 0 (compile in the warm-up steps) where
    there are too few cores for parallel compilation to pay."""
    workers = min(8, (os.cpu_count() or 1) // 2)
    return workers if workers >= 2 else 0


def _ema_mode(base: RunConfig, mode: str) -> str:
    """``mode`` when the profile keeps an EMA, else ``off``."""
    return "off" if base.ema == "off" else mode


RECIPES: dict[str, Callable[[RunConfig], RunConfig]] = {
    "baseline": baseline,
    "compiled": compiled,
    "peer": peer,
    "accelerated": accelerated,
}


_REGISTERED: dict[str, Callable[[RunConfig], RunConfig]] = {}


def register_recipes(recipes: dict[str, Callable[[RunConfig], RunConfig]]) -> None:
    """Adds recipes beside ``RECIPES`` (the optimization ladder registers its rungs: ``gallery_lib.recipes.ladder``)."""
    clash = set(recipes) & set(RECIPES)
    if clash:
        raise ValueError(f"recipe name(s) {sorted(clash)} are taken by the named recipes")
    _REGISTERED.update(recipes)


def all_recipes() -> dict[str, Callable[[RunConfig], RunConfig]]:
    """``RECIPES`` and those registered beside them (the ladder's rungs, which train Stable Diffusion only)."""
    return {**RECIPES, **_REGISTERED}


def apply_recipe(name: str, base: RunConfig) -> RunConfig:
    """Resolves recipe ``name`` on top of ``base``; unknown names fail with the list of recipes."""
    recipes = all_recipes()
    if name not in recipes:
        raise ConfigError(f"recipe={name!r} is not known: choose one of {', '.join(RECIPES)} (or a ladder rung, "
                          "ladder-00-tf32 ... : `gallery list`).")
    return recipes[name](base)


def describe(name: str) -> str:
    """The recipe's one-line explanation (its docstring, as plain text: no reST double backticks), for notebooks,
    the runs' headers and ``gallery --help``."""
    return (all_recipes()[name].__doc__ or "").strip().splitlines()[0].replace("``", "`")


def recipe_config(base: RunConfig, recipe: str, overrides: dict[str, Any]) -> RunConfig:
    """Recipe ``recipe`` with explicit ``overrides`` on top, named after both (``baseline+amp_level=O2+compile``)
    so an overridden run never writes over the plain recipe's results; on a GPU, fitted to the memory the run may
    use (``memory_fit.py``), leaving what the user named (``base_config``'s and these overrides) as named."""
    named = sorted(set(base.extra.get(NAMED, ())) | set(overrides))

    on_top = getattr(all_recipes().get(recipe), "planned_on_top", False)

    def resolve(planned: dict[str, Any]) -> RunConfig:
        if on_top:  # a ladder rung sets its own batch: the plan's setting goes on the rung's config
            cfg = _resolved(base, recipe, overrides).replace(**planned)
        else:  # the recipe resolves its switches for the setting (checkpointing turns CUDA graphs off, say)
            cfg = _resolved(base.replace(**planned), recipe, overrides)
        return cfg.replace(extra={**cfg.extra, NAMED: sorted({*named, *cfg.extra.get(NAMED, ())})})

    cfg = resolve({})
    if not runs_on_gpu(cfg):
        return refuse_beyond_host_memory(cfg, read_host_budget())
    return fit_to_memory(cfg, resolve, read_budget(cfg.gpu_memory_gib))


def _resolved(base: RunConfig, recipe: str, overrides: dict[str, Any]) -> RunConfig:
    """``recipe_config`` before the memory plan."""
    base = base.replace(**{name: overrides[name] for name in _RECIPE_INPUTS if name in overrides})
    cfg = apply_recipe(recipe, base)
    _refuse_ignored(recipe, cfg, overrides)
    if overrides:
        label = "+".join(_label(name, value) for name, value in overrides.items() if name not in _UNNAMED)
        # The recipe's precompile workers and its classes compiled whole act on blocks: a whole model named by the
        # user compiles in its first step, as one graph.
        whole = overrides.get("compile_scope", "blocks") != "blocks"
        left_out = {name: off for name, off in (("precompile_workers", 0), ("compile_whole", "")) if whole
                    and name not in overrides}
        if overrides.get("compile") is False:  # the recipe's compile-only switches go with it
            cfg = uncompiled(cfg, named=overrides)
        cfg = cfg.replace(recipe=f"{recipe}+{label}" if label else recipe, **left_out, **overrides)
    return cfg


_UNNAMED = ("resume", "resume_from", "checkpoint_every", "keep_checkpoints", "max_restarts", "log_every", "verbose")
"""Overrides of how a run is carried out, not of what it trains: they keep its name, and so its folder (a resumed run
goes on in the folder of the one it resumes)."""


def _label(name: str, value: Any) -> str:
    """An override in the run's name, which is its folder's: ``ema=off``, ``no-kernels``; a path by its last part
    (``instance_data_dir=photos``), and any character a folder name should not hold as ``_``."""
    if isinstance(value, bool):
        return name if value else f"no-{name}"
    text = str(value)
    if "/" in text or os.sep in text:
        text = os.path.basename(os.path.normpath(text)) or text
    return f"{name}={re.sub(r'[^A-Za-z0-9._,=+-]+', '_', text)}"


# Overrides a recipe reads before it resolves: ``accelerated`` leaves out what they cannot run with and precompiles
# the blocks of a ``compile_scope='blocks'`` the user names; the ladder's rungs scale the base's batch.
_RECIPE_INPUTS = ("gradient_checkpointing", "data_parallel", "batch_size", "image_size", "compile_scope")

# Settings that only act when a switch is on: asking for one in a recipe that leaves the switch off is a mistake.
_NEEDS_SWITCH = {"compile_mode": "compile", "compile_scope": "compile", "compile_whole": "compile",
                 "precompile_workers": "compile", "coordinate_descent_tuning": "compile", "tiled_reductions": "compile",
                 "channels_last_graphs": "compile", "kernel_ops": "kernels"}


def _refuse_ignored(recipe: str, cfg: RunConfig, overrides: dict[str, Any]) -> None:
    for name, switch in _NEEDS_SWITCH.items():
        if name in overrides and not overrides.get(switch, getattr(cfg, switch)):
            takers = [r for r in RECIPES if getattr(RECIPES[r](cfg), switch)]
            use = f"use the {_either(takers)} recipe, or " if takers else ""
            raise ConfigError(f"{name}={overrides[name]!r} has no effect in the {recipe} recipe, which runs with "
                              f"{switch}=False: {use}add --set {switch}=true.")


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
