"""The gallery's steps for one model, shared by the notebooks and the ``gallery`` command.

Every notebook makes the same three calls: ``prepare`` makes the mock data a profile needs, ``run_recipes``
launches one run per recipe (each from the same base config, each with its own output folder), ``compare`` writes
the report.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.run.failure import RunFailure, RunsFailed
from gallery_lib.run.launch import RunFailed, RunFolderInUse, RunResult, launch, preflight
from gallery_lib.recipes.profiles import data_spec
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


class RecipeRuns(Mapping):
    """What ``run_recipes`` returns: the runs that finished, by run name, in the order they ran (a mapping:
    ``results["accelerated"]``, ``list(results.values())``), and in ``failures`` why the others stopped.
    ``names`` lists every run, finished or not, as ``compare`` reports them."""

    def __init__(self) -> None:
        self.finished: dict[str, RunResult] = {}
        self.failures: dict[str, RunFailure] = {}
        self.names: list[str] = []

    def __getitem__(self, name: str) -> RunResult:
        return self.finished[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.finished)

    def __len__(self) -> int:
        return len(self.finished)

    def failure_lines(self) -> list[str]:
        return [failure.line(name) for name, failure in self.failures.items()]

    def raise_if_failed(self) -> None:
        """``RunsFailed``, one line per stopped run, when any stopped: call it once everything that ran is shown."""
        if self.failures:
            raise RunsFailed(self.failure_lines())


def run_recipes(base: RunConfig, recipes: Sequence[RecipeSpec], *,
                echo: Callable[[str], None] | None = print, console: str = "result") -> RecipeRuns:
    """Launches every recipe on top of ``base``, one after another; a run that stops is recorded in one line and the
    next one starts. Every config is resolved and checked for this machine before the first run starts. A notebook
    shows one line per run (``console="result"``, with a progress bar); ``console="all"`` shows every line of it,
    as each run's ``logs/rank0.log`` keeps them."""
    return launch_all(resolve_recipes(base, recipes), echo=echo, console=console)


def launch_all(configs: Sequence[RunConfig], *, echo: Callable[[str], None] | None = print,
               console: str = "all") -> RecipeRuns:
    """Launches already-resolved run configs one after another (each checked, its data included, before any
    starts)."""
    refuse_runs_sharing_a_folder(configs)
    for cfg in configs:
        preflight(cfg)
    runs = RecipeRuns()
    for cfg in configs:
        if echo and console == "all":
            name, _, overrides = cfg.recipe.partition("+")  # "compiled+lr=0.002": a recipe with overrides
            doc = describe(name) if name in all_recipes() else "custom run"
            echo(f"\n=== {cfg.recipe}: {doc}{' (with overrides)' if overrides else ''} ===")
        runs.names.append(cfg.recipe)
        try:
            runs.finished[cfg.recipe] = launch(cfg, echo=echo, console=console)
        except RunFailed as exc:
            failure = _against_finished_runs(exc.failure or RunFailure("error", str(exc).splitlines()[0]), cfg, runs)
            if not isinstance(exc, RunFolderInUse):  # the folder is the other run's
                failure.write(cfg.run_dir)
            runs.failures[cfg.recipe] = failure
            if echo:
                echo(f"[gallery] {failure.line(cfg.recipe)}")
    return runs


def refuse_runs_sharing_a_folder(configs: Sequence[RunConfig]) -> None:
    """``ConfigError`` where two configs would train in one folder (a recipe listed twice): the second would move the
    first one's results away, and the report would list it twice."""
    folders = [cfg.run_dir.resolve() for cfg in configs]
    twice = sorted({cfg.recipe for cfg, folder in zip(configs, folders) if folders.count(folder) > 1})
    if twice:
        raise ConfigError(f"{', '.join(twice)} listed twice: each run of a recipe trains in one folder; list it once, "
                          "or change a setting of the second (RECIPE+FIELD=VALUE names a run of its own)")


def _against_finished_runs(failure: RunFailure, cfg: RunConfig, runs: RecipeRuns) -> RunFailure:
    """A loss that was not finite from a run's first steps, where an earlier run at the same learning rate on the
    same data trained with a finite one, says so: the recipe's numerics are at fault, not the learning rate."""
    if failure.kind != "nonfinite" or failure.first_step is None or failure.first_step > 1:
        return failure
    finite = [name for name, result in runs.finished.items()
              if result.summary.get("nonfinite_steps", 0) == 0 and result.config.lr == cfg.lr
              and result.config.data_dir == cfg.data_dir]
    if not finite:
        return failure
    return replace(failure, reason=f"{failure.reason} while {finite[0]}'s was finite at the same lr (the recipe's "
                                   "numerics)")


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


def compare(cfg: RunConfig, recipes: RecipeRuns | Sequence[str] | None = None):
    """Writes ``<output>/<family>/report.{md,png}`` from the runs' own metrics files and returns the report; given
    what ``run_recipes`` returned, every run it started, a stopped one as one line."""
    from gallery_lib.reports.comparison import write_report

    names = recipes.names if isinstance(recipes, RecipeRuns) else recipes
    train = f"gallery train --model {cfg.model} --recipe {{recipe}} --output-dir {shlex.quote(str(cfg.output_dir))}"
    return write_report(model_dir(cfg), recipes=list(names) if names else None, train_command=train)


def summarize(report, reference: str = "baseline") -> str:
    """A few sentences on what each recipe bought, from the report's own numbers."""
    from gallery_lib.reports.comparison import SPEEDUP_ON_CPU

    rows = {row["recipe"]: row for row in report.table}
    ref = rows.get(reference)
    lines = []
    for name, row in rows.items():
        if row["img_per_s"] is None:
            lines.append(f"- {name}: did not finish; see {row['run_dir']}/logs.")
            continue
        text = f"- {name}: {row['img_per_s']:.1f} img/s on {row['device']} (global batch {row['global_batch']})"
        if ref is not None and name != reference and row["speedup"] is not None:
            text += (f", speedup over the {reference} {SPEEDUP_ON_CPU}" if row["device"] == "CPU"
                     else f", {row['speedup']:.2f}x the {reference}")
        if row.get("mfu") is not None:
            text += f", MFU {row['mfu']:.1%}"
        text += f"; warm-up/compile {row['warmup_s']:.1f} s"
        if row.get("cache_s") is not None:
            text += f"; latent cache built in {row['cache_s']:.1f} s before training"
        text += f"; peak memory {row['peak_mem_gib']:.2f} GiB" + (" reserved" if row.get("peak_mem_reserved") else "")
        text += f"; final loss {row['final_loss']:.3f}"
        text += f"; validation top-1 {row['val_top1']:.1%}." if row.get("val_top1") is not None else "."
        lines.append(text)
    lines += [f"- {failure.line(name)}." for name, failure in report.failures.items()]
    if any(row["device"] == "CPU" for row in rows.values()):
        lines.append("These are CPU smoke numbers: they check the code path, not speed. "
                     "Run on a GPU for the benchmark.")
    return "\n".join(lines)
