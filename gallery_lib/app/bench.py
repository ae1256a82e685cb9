"""``gallery bench``: each model's training step alone, per recipe and batch size, in one result file.

Every (model, recipe, batch size) is one run through the launcher, as the notebooks run it: a torchrun process,
CUDA-event step times after warm-up (median with p20/p80), compile time apart. Each run trains on one device-resident
batch of the model's real shapes, reused every step (``workflow.model_step_config``), so the data pipeline does not
set the pace. A run that fails (out of memory, say) becomes a row with an ``error`` and the bench goes on.

The result file (``output/bench/bench-<gpu>-<date>.json`` unless ``--out`` names another: the machine, the command,
one row per run) and its figure are rewritten after every run, so a bench stopped by a time limit keeps what it
measured. Which of the speed goals the rows meet is judged from the rows alone (``reports/bench_goals.py``).

Everything is resolved and checked before the first run: a typo in a model, a recipe or a batch size fails at once.
"""

from __future__ import annotations

import json
import platform
import re
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from gallery_lib.config import ConfigError, RunConfig, machine, parse_overrides, resolve_device, validate_for_machine
from gallery_lib.recipes.profiles import base_config, resolve_profile
from gallery_lib.reports.provenance import source_version

DEFAULT_RECIPES = ("baseline", "compiled", "peer", "accelerated")
GPU_TIMED_STEPS = 30
"""Timed steps after warm-up on a GPU, at least: enough for a median and p20/p80 that hold from run to run."""
OUTPUT_DIR = Path("output/bench")
"""Where result files go by default, under the current directory as ``gallery run``'s ``output/``: a user's runs stay
out of the source tree (the numbers committed to ``benchmarks/results/`` are written there with ``--out``)."""
STEP_TIMING = ("the training step alone on one reused batch; CUDA events per step after warm-up (wall clock on a CPU); "
               "median with p20/p80; compile_s = warm-up steps + precompilation, shorter when an earlier run of the "
               "bench left the same graphs in Inductor's cache; to_steady_s = precompilation + the warm-up steps up to "
               "the last one over 1.1x the median; compile_caches = cold (the run or its precompile workers compiled) "
               "or warm (it loaded all from the caches)")


def resolve_models(names: Sequence[str], profile: str) -> list[str]:
    """Gallery model names for ``names``: each a model (``sd15``) or a family shortcut that means the profile's model
    of that family: its name, a prefix of it (``swin``, ``resnet``) or its initials (``sd`` for
    ``stable_diffusion``). No names: the profile's model of every family."""
    from gallery_lib.families import FAMILIES, MODELS

    profile = resolve_profile(profile)
    if not names:
        return [family.run_profiles[profile]["model"] for family in FAMILIES.values()]
    models = []
    for name in names:
        if name in MODELS:
            models.append(name)
            continue
        matches = [f for f in FAMILIES.values() if _family_matches(name, f.name)]
        if len(matches) != 1:
            why = "matches " + " and ".join(f.name for f in matches) if matches else "is no model or family"
            raise ConfigError(f"--models {name!r} {why}: name a model ({', '.join(MODELS)}) or a family "
                              f"({', '.join(FAMILIES)}, or a prefix or the initials of one, e.g. sd, swin).")
        models.append(matches[0].run_profiles[profile]["model"])
    return list(dict.fromkeys(models))


def _family_matches(name: str, family: str) -> bool:
    initials = "".join(word[0] for word in family.split("_") if word)
    return family.startswith(name) or name == initials


def parse_batch_sizes(values: Sequence[str], models: Sequence[str]) -> dict[str, list[int] | None]:
    """``--batch-size`` values: ``32,48`` for every model, ``MODEL=32,48`` for one (a model or a shortcut, as in
    ``--models``); a model given no size runs at its profile's (``None``)."""
    sizes: dict[str, list[int] | None] = {model: None for model in models}
    for value in values:
        target, sep, text = value.rpartition("=")
        numbers = _positive_ints(text, value)
        if not sep:
            sizes = {model: numbers for model in models}
            continue
        model = _one_model(target, models)
        sizes[model] = numbers
    return sizes


def _positive_ints(text: str, value: str, flag: str = "--batch-size",
                   example: str = "--batch-size 32,48 or --batch-size sd15=32") -> list[int]:
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise ConfigError(f"{flag} {value!r} is invalid: expected positive integers, e.g. {example}.")
    return list(dict.fromkeys(numbers))


def _one_model(target: str, models: Sequence[str]) -> str:
    from gallery_lib.families import family_of

    for model in models:
        if target == model or _family_matches(target, family_of(model).name):
            return model
    raise ConfigError(f"--batch-size {target}=...: {target!r} is not among the benched models ({', '.join(models)}); "
                      "name one of them.")


def parse_recipe(entry: str) -> tuple[str, dict[str, Any]]:
    """``accelerated`` or ``accelerated+ema=off`` (a recipe with fields changed, named as ``gallery train`` names
    it): the recipe and its overrides."""
    name, *assignments = entry.split("+")
    return name, parse_overrides(assignments)


def plan_runs(models: Sequence[str], recipes: Sequence[str], batch_sizes: dict[str, list[int] | None], *,
              profile: str, warmup_steps: int | None, timed_steps: int | None, output_dir: str, data_root: str,
              overrides: dict[str, Any], processes: Sequence[int] = ()) -> list[RunConfig]:
    """Every run's config, resolved and checked for this machine before any runs: models in the order given, then
    batch sizes, then recipes, then ``processes`` (process counts, e.g. ``(1, 2)`` for the scaling over two GPUs;
    none given: ``nproc_per_node`` as set)."""
    from gallery_lib.recipes import recipe_config
    from gallery_lib.app.workflow import model_step_config

    runs = []
    for model in models:
        for batch in batch_sizes[model] or [None]:
            base = base_config(profile, model=model, batch_size=batch, data_root=data_root, **overrides)
            base = _step_counts(base, warmup_steps, timed_steps)
            base = base.replace(output_dir=str(Path(output_dir) / f"batch{base.batch_size}"))
            for entry in recipes:
                cfg = recipe_config(model_step_config(base, steps=base.steps), *parse_recipe(entry))
                for procs in processes or [cfg.nproc_per_node]:
                    run = cfg.replace(nproc_per_node=procs, output_dir=str(Path(cfg.output_dir) / f"{procs}proc")
                                      if processes else cfg.output_dir)
                    validate_for_machine(run)
                    runs.append(run)
    return runs


def parse_processes(text: str | None) -> list[int]:
    """``--processes 1,2``: the process counts to run each recipe at (none: ``nproc_per_node`` as set)."""
    if not text:
        return []
    return _positive_ints(text, text, flag="--processes", example="--processes 1,2")


def _step_counts(base: RunConfig, warmup_steps: int | None, timed_steps: int | None) -> RunConfig:
    """The profile's warm-up and timed steps unless given; at least ``GPU_TIMED_STEPS`` timed steps on a GPU."""
    warmup = base.warmup_steps if warmup_steps is None else warmup_steps
    on_gpu = resolve_device(base.device, machine.visible_cuda_devices()) == "cuda"
    timed = timed_steps if timed_steps is not None else (
        GPU_TIMED_STEPS if on_gpu else base.steps - base.warmup_steps)
    if timed < 1 or warmup < 0:
        raise ConfigError(f"--timed-steps {timed} / --warmup-steps {warmup}: expected at least 1 timed step and no "
                          "negative warm-up.")
    if on_gpu and timed < GPU_TIMED_STEPS:
        raise ConfigError(f"--timed-steps {timed} is too few on a GPU: the bench times at least {GPU_TIMED_STEPS} "
                          "steps after warm-up (median, p20 and p80 need them); leave it out or raise it.")
    return base.replace(steps=warmup + timed, warmup_steps=warmup)


def run_bench(runs: Sequence[RunConfig], out: Path, *, command: str, profile: str,
              echo: Callable[[str], None] | None = print) -> dict:
    """Prepares each model's data, runs every run in turn and rewrites ``out`` (and its figure) after each."""
    from gallery_lib.reports.bench import write_figure
    from gallery_lib.reports.bench_goals import check_goals
    from gallery_lib.run.launch import RunFailed, launch
    from gallery_lib.app.workflow import prepare

    record = machine_record(command, profile)
    prepared: set[str] = set()
    for cfg in runs:
        if cfg.data_dir not in prepared:
            prepare(cfg, progress=False)
            prepared.add(cfg.data_dir)
        if echo:
            echo(f"\n[bench] === {cfg.model} | {cfg.recipe} | batch {cfg.batch_size} ===")
        try:
            row = result_row(cfg, launch(cfg, echo=echo).summary)
        except RunFailed as exc:
            row = error_row(cfg, str(exc))
        record["rows"].append(row)
        record["device"] = record["device"] or row.get("device")
        record["goals"] = [goal.as_dict() for goal in check_goals(record["rows"])]
        write_record(record, out)
        write_figure(record, out.with_suffix(".png"))
    return record


def machine_record(command: str, profile: str | None, timing: str = STEP_TIMING) -> dict:
    """The header of a result file: what ran, where, with which software, and how it was timed (``timing``)."""
    import torch

    return {"command": command, **source_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "profile": resolve_profile(profile) if profile else None, "gpu": gpu_name(), "device": None,
            "torch": torch.__version__, "triton": _version("triton", "pytorch-triton"),
            "python": platform.python_version(), "timing": timing, "rows": [], "goals": []}


def result_row(cfg: RunConfig, summary: dict) -> dict:
    """One finished run's row: speed, spread, memory, MFU, compile time, FLOPs, and what ran."""
    from gallery_lib.reports.comparison import mfu
    from gallery_lib.run.summary import compile_caches

    speed = summary["samples_per_s"]
    return {
        "model": cfg.model, "recipe": cfg.recipe, "batch_size": cfg.batch_size,
        "processes": summary.get("world_size", cfg.nproc_per_node), "samples_per_s": speed,
        "median_step_ms": summary["median_step_time_ms"], "p20_step_ms": summary["p20_step_time_ms"],
        "p80_step_ms": summary["p80_step_time_ms"], "peak_mem_gib": summary["peak_mem_mb"] / 1024,
        "peak_mem_kind": summary["peak_mem_kind"],
        "peak_reserved_gib": summary["peak_reserved_mb"] / 1024 if summary.get("peak_reserved_mb") else None,
        "mfu": mfu(speed, summary["train_flops_per_sample"], summary["matmul_tflops"]),
        "compile_s": summary["warmup_time_s"] + (summary["precompile_time_s"] or 0.0),
        "to_steady_s": summary.get("to_steady_speed_s"), "compile_caches": compile_caches(summary),
        "warmup_step_ms": [round(ms, 1) for ms in summary["warmup_step_times_ms"]],
        "timed_step_ms": [round(ms, 2) for ms in summary["timed_step_times_ms"]],
        "flops_per_sample": summary["train_flops_per_sample"], "matmul_tflops": summary["matmul_tflops"],
        "timed_steps": summary["steps"] - summary["warmup_steps"] - summary.get("profiled_steps", 0),
        "warmup_steps": summary["warmup_steps"],
        "ema": summary["ema"], "setup_s": summary["setup_time_s"], "cache_s": summary.get("cache_time_s"),
        "device": summary["device_name"], "run_dir": summary["output_dir"],
    }


def error_row(cfg: RunConfig, message: str) -> dict:
    """A failed run's row: ``error`` says why in a few words, ``error_detail`` holds the log's tail."""
    lines = [line.strip() for line in message.splitlines() if "Error" in line]
    reason = "out of memory" if "out of memory" in message.lower() else (lines[-1] if lines else message)[:200]
    return {"model": cfg.model, "recipe": cfg.recipe, "batch_size": cfg.batch_size, "processes": cfg.nproc_per_node,
            "error": reason,
            "error_detail": message[-1500:], "run_dir": str(cfg.run_dir)}


def out_path(out: str | None, gpu: str | None, name: str = "bench") -> Path:
    """``--out``: a file, or a folder for the default name (a GPU machine's output folder, say); default:
    ``output/bench/<name>-<gpu-slug>-<date>.json`` under the current directory."""
    if out and not Path(out).is_dir():
        return Path(out)
    return default_out_path(gpu, folder=Path(out) if out else OUTPUT_DIR, name=name)


def default_out_path(gpu: str | None, date: str | None = None, folder: Path = OUTPUT_DIR,
                     name: str = "bench") -> Path:
    """``<folder>/<name>-<gpu-slug>-<date>.json`` (``cpu`` for the slug without a GPU), numbered (``-2``, ...) rather
    than overwriting a bench run earlier that day."""
    stem = f"{name}-{slug(gpu or 'cpu')}-{date or time.strftime('%Y-%m-%d')}"
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` as a file name takes it: ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_name() -> str | None:
    """The GPU's name as ``nvidia-smi`` gives it (as torch does), asked without a CUDA context in this process, which
    would hold device memory through every run; ``None`` without a GPU that torch can use."""
    import torch

    from gallery_lib.config.gpu_check import nvidia_gpus

    gpus = nvidia_gpus() if torch.cuda.is_available() else ()
    return gpus[0][0] if gpus else None


def _version(*packages: str) -> str | None:
    for package in packages:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return None


def write_record(record: dict, out: Path) -> None:
    """Writes ``record`` to ``out`` as JSON through a temporary file, so a reader never sees half of it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)
