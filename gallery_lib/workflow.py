"""The gallery's steps for one model, shared by the notebooks and the ``gallery`` command.

Every notebook makes the same three calls: ``prepare`` makes the mock data a profile needs, ``run_recipes``
launches one run per recipe (each from the same base config, each with its own output folder), ``compare`` writes
the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence, Union

from gallery_lib.config import ConfigError, RunConfig, validate_for_machine
from gallery_lib.run.launch import RunResult, launch
from gallery_lib.profiles import data_spec
from gallery_lib.recipes import RECIPES, all_recipes, describe, recipe_config

RecipeSpec = Union[str, "tuple[str, dict[str, Any]]"]
"""A recipe name, or ``(name, overrides)`` for a recipe with some fields changed (``("accelerated",
{"batch_size": 64})`` runs as ``accelerated+batch_size=64``, beside the plain one)."""


def prepare(cfg: RunConfig, *, progress: bool = True, **spec_overrides) -> Path:
    """Creates (or reuses) the model's mock dataset at ``cfg.data_dir``, sized by ``cfg.profile`` with the family's
    data maker (``ModelFamily.make_dataset``)."""
    profile = cfg.profile if cfg.profile in ("smoke", "full") else "smoke"
    spec = data_spec(profile, cfg.family, **spec_overrides)
    return cfg.model_family.make_dataset(cfg.data_dir, **spec, seed=cfg.seed, progress=progress)


def resolve_recipes(base: RunConfig, recipes: Sequence[RecipeSpec]) -> list[RunConfig]:
    """All recipe configs, resolved and validated up front, so a typo fails before the first run starts."""
    if not recipes:
        raise ConfigError("no recipes given: pass at least one of " + ", ".join(RECIPES))
    specs = [(spec, {}) if isinstance(spec, str) else spec for spec in recipes]
    unknown = [name for name, _ in specs if name not in all_recipes()]
    if unknown:
        raise ConfigError(f"unknown recipe(s) {unknown}: choose from {', '.join(RECIPES)}.")
    return [recipe_config(base, name, overrides) for name, overrides in specs]


def run_recipes(base: RunConfig, recipes: Sequence[RecipeSpec], *,
                echo: Callable[[str], None] | None = print) -> dict[str, RunResult]:
    """Launches every recipe on top of ``base``, one after another; returns the results by run name (the recipe's,
    with its overrides). Every config is resolved and checked for this machine before the first run starts."""
    return launch_all(resolve_recipes(base, recipes), echo=echo)


def launch_all(configs: Sequence[RunConfig], *, echo: Callable[[str], None] | None = print) -> dict[str, RunResult]:
    """Launches already-resolved run configs one after another (each validated before any starts)."""
    for cfg in configs:
        validate_for_machine(cfg)
    results: dict[str, RunResult] = {}
    for cfg in configs:
        if echo:
            name, _, overrides = cfg.recipe.partition("+")  # "compiled+lr=0.002": a recipe with overrides
            doc = describe(name) if name in all_recipes() else "custom run"
            echo(f"\n=== {cfg.recipe}: {doc}{' (with overrides)' if overrides else ''} ===")
        results[cfg.recipe] = launch(cfg, echo=echo)
    return results


def model_step_config(base: RunConfig, steps: int = 60) -> RunConfig:
    """``base`` set to time the model step alone: one device-resident batch reused, output kept apart.

    With RandAugment on the CPU the data pipeline can set the pace before the GPU does; these runs show
    what each recipe does to the training step itself (as timm's ``benchmark.py`` measures).
    """
    steps = min(base.steps, steps)
    # No per-step non-finite check here: it costs a host sync per step, and these runs only measure speed.
    return base.replace(reuse_batch=True, output_dir=str(Path(base.output_dir) / "model_step"), steps=steps,
                        warmup_steps=min(base.warmup_steps, steps // 2), max_nonfinite_steps=0,
                        checkpoint_every=0, resume=False, export_model=False)


def model_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir) / cfg.family


def compare(cfg: RunConfig, recipes: Sequence[str] | None = None):
    """Writes ``<output>/<family>/report.{md,png}`` from the runs' own metrics files and returns the report."""
    from gallery_lib.reports.comparison import write_report

    return write_report(model_dir(cfg), recipes=list(recipes) if recipes else None)


def summarize(report, reference: str = "baseline") -> str:
    """A few sentences on what each recipe bought, from the report's own numbers."""
    rows = {row["recipe"]: row for row in report.table}
    ref = rows.get(reference)
    lines = []
    for name, row in rows.items():
        if row["img_per_s"] is None:
            lines.append(f"- {name}: did not finish; see {row['run_dir']}/logs.")
            continue
        text = f"- {name}: {row['img_per_s']:.1f} img/s on {row['device']} (global batch {row['global_batch']})"
        if ref is not None and name != reference and row["speedup"] is not None:
            text += f", {row['speedup']:.2f}x the {reference}"
        if row.get("mfu") is not None:
            text += f", MFU {row['mfu']:.1%}"
        text += f"; warm-up/compile {row['warmup_s']:.1f} s"
        if row.get("cache_s") is not None:
            text += f"; latent cache built in {row['cache_s']:.1f} s before training"
        text += f"; peak memory {row['peak_mem_gib']:.2f} GiB"
        text += f"; final loss {row['final_loss']:.3f}."
        lines.append(text)
    if any(row["device"] == "CPU" for row in rows.values()):
        lines.append("These are CPU smoke numbers: they check the code path, not speed. "
                     "Run on a GPU for the benchmark.")
    return "\n".join(lines)
