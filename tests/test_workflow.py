"""run_recipes: a run that stops is one line, the next recipe runs, and the notebook fails only at the end."""

from __future__ import annotations

import pytest

from gallery_lib.recipes.profiles import base_config
from gallery_lib.run.failure import RunFailure, RunsFailed, read_failure
from gallery_lib.run.launch import RunFailed, RunResult
from gallery_lib.app.workflow import RecipeRuns, run_recipes


def _fake_launch(stopping: dict[str, RunFailure], launched: list[str], consoles: list[str] | None = None):
    def launch(cfg, echo=None, console="all"):
        launched.append(cfg.recipe)
        if consoles is not None:
            consoles.append(console)
        if cfg.recipe in stopping:
            raise RunFailed("training exited with code 1; per-rank logs: ...\nRuntimeError: ...", stopping[cfg.recipe])
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0, "nonfinite_steps": 0, "final_loss": 2.0})
    return launch


def test_a_stopped_recipe_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    base = base_config("smoke", family="swin_transformer", data_root=str(tmp_path / "data"),
                       output_dir=str(tmp_path / "out"))
    log = str(tmp_path / "out" / "rank0.log")
    launched, echoed = [], []
    monkeypatch.setattr("gallery_lib.app.workflow.preflight", lambda cfg: "cpu")  # no data: the runs are faked
    monkeypatch.setattr("gallery_lib.app.workflow.launch", _fake_launch(
        {"compiled": RunFailure("nonfinite", "loss not finite from step 1", log, first_step=1),
         "baseline+lr=1.0": RunFailure("nonfinite", "loss not finite from step 1", log, first_step=1)}, launched))
    runs = run_recipes(base, ["baseline", "compiled", "accelerated", ("baseline", {"lr": 1.0})], echo=echoed.append)
    assert launched == ["baseline", "compiled", "accelerated", "baseline+lr=1.0"]
    assert isinstance(runs, RecipeRuns) and list(runs) == ["baseline", "accelerated"]
    assert runs.names == launched and list(runs.failures) == ["compiled", "baseline+lr=1.0"]
    # The baseline trained at the same learning rate with a finite loss: the compiled recipe's numerics are at fault;
    # at another learning rate nothing is claimed.
    numerics = (f"compiled: stopped, loss not finite from step 1 while baseline's was finite at the same lr (the "
                f"recipe's numerics), see {log}")
    assert runs.failure_lines() == [numerics, f"baseline+lr=1.0: stopped, loss not finite from step 1, see {log}"]
    assert f"[gallery] {numerics}" in echoed
    assert read_failure(base.replace(recipe="compiled").run_dir).line("compiled") == numerics  # the report's source
    with pytest.raises(RunsFailed) as info:
        runs.raise_if_failed()
    assert info.value._render_traceback_() == [f"RunsFailed: {line}" for line in runs.failure_lines()]


def test_runs_that_all_finished_raise_nothing(tmp_path, monkeypatch):
    base = base_config("smoke", family="swin_transformer", data_root=str(tmp_path / "data"),
                       output_dir=str(tmp_path / "out"))
    consoles = []
    monkeypatch.setattr("gallery_lib.app.workflow.preflight", lambda cfg: "cpu")  # no data: the runs are faked
    monkeypatch.setattr("gallery_lib.app.workflow.launch", _fake_launch({}, [], consoles))
    runs = run_recipes(base, ["baseline"], echo=None)
    assert consoles == ["result"]  # a notebook shows one line per run
    runs.raise_if_failed()
    assert list(runs.values())[-1].config.recipe == "baseline" and not runs.failures


def test_a_notebook_sees_one_line_per_run_and_the_command_line_every_line():
    from gallery_lib.run.launch import console_line
    from gallery_lib.run.summary import describe_summary

    summary = {"samples_per_s": 41.25, "steps": 16, "resumed_from_step": 0, "warmup_steps": 4, "warmup_time_s": 0.6,
               "precompile_time_s": 0.0, "peak_mem_mb": 1024.0, "final_loss": 0.4585}
    done = describe_summary(summary)
    step = "[gallery] step 4/16 | loss 0.8109 | 31.8 img/s"
    assert [console_line(line, "baseline", "all") for line in (step, done)] == [step, done]
    assert console_line(step, "baseline", "result") is None
    assert console_line(done, "baseline", "result") == ("[gallery] baseline: 41.2 img/s (median of 12 steps after "
                                                        "warm-up), warm-up 0.6 s, peak 1.00 GiB, final loss 0.4585")
    on_gpu = describe_summary({**summary, "peak_mem_mb": 14.38 * 1024, "peak_reserved_mb": 15.38 * 1024})
    assert "peak 14.38 GiB allocated, 15.38 reserved, final loss" in on_gpu  # a GPU run's line names both peaks
