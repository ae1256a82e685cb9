"""What a GPU measured for a planned run is what the next plan on that GPU reads (``run/learned_footprints.py``): a
setting that ran out of memory is not tried again under as little memory, one that ran is measured, and the file's
key is the run's step, whatever it writes where or for how long."""

from __future__ import annotations

import json

import pytest
import torch

from gallery_lib.recipes.memory_fit import fit_to_memory
from gallery_lib.recipes.named import _resolved
from gallery_lib.recipes.profiles import base_config
from gallery_lib.run.learned_footprints import FILE, recalled_gib, remember, remembering, setting_key
from gallery_lib.run.memory_plan import NAMED, PLAN, Budget, Candidate, MemoryPlan, OutOfMemory
from gallery_lib.run.batch_size import is_out_of_memory
from gallery_lib.run.train import run
from test_memory_plan import mock_out_of_memory_above, planned_cfg

GPU = "NVIDIA Fake 24GB"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GALLERY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def sd_planned(budget: Budget, recipe: str = "accelerated"):
    base = base_config("full", family="stable_diffusion", data_root="/nonexistent", device="cuda",
                       precompile_workers=0)

    def resolve(planned):
        cfg = _resolved(base.replace(**planned), recipe, {})
        return cfg.replace(extra={**cfg.extra, NAMED: []})

    return fit_to_memory(resolve({}), resolve, budget)


def chosen(cfg) -> Candidate | None:
    plan = MemoryPlan.from_dict(cfg.extra[PLAN])
    return plan.chosen


def test_the_key_is_the_step_on_one_gpu():
    cfg = base_config("full", family="stable_diffusion", data_root="/a", device="cuda")
    same = cfg.replace(output_dir="/elsewhere", steps=300, seed=7, log_every=1, gpu_memory_gib=16.0)
    assert setting_key(cfg, GPU) == setting_key(same, GPU)
    assert setting_key(cfg, GPU) != setting_key(cfg, "NVIDIA A100-SXM4-40GB")
    for shaping in ({"batch_size": 4}, {"gradient_checkpointing": True}, {"image_size": 256}, {"ema": "off"}):
        assert setting_key(cfg.replace(**shaping), GPU) != setting_key(cfg, GPU), shaping


def test_a_setting_that_ran_out_of_memory_is_not_tried_again_under_as_little(cache_dir):
    first = sd_planned(Budget(22.0, "gpu_memory_gib", GPU))
    assert chosen(first) == Candidate(8, 1, True)  # SD-1.5's measured checkpointed footprint, 20.3 GiB
    remember(first, GPU, out_of_memory_under=22.0)  # this GPU's step needed more

    again = sd_planned(Budget(22.0, "gpu_memory_gib", GPU))
    assert chosen(again) != Candidate(8, 1, True) and again.extra[PLAN]["gpu"] == GPU
    assert chosen(sd_planned(Budget(22.0, "gpu_memory_gib", "another GPU"))) == Candidate(8, 1, True)
    assert chosen(sd_planned(Budget(38.0, "gpu_memory_gib", GPU))) == Candidate(8, 1, False)  # more memory: unknown
    assert chosen(sd_planned(Budget(22.0, "gpu_memory_gib", None))) == Candidate(8, 1, True)  # name unread: as before
    entry = next(iter(json.loads((cache_dir / FILE).read_text()).values()))
    assert entry["out_of_memory_under_gib"] == 22.0 and entry["batch_size"] == 8 and entry["checkpointing"]


def test_a_setting_this_gpu_measured_is_picked_without_a_trial():
    budget = Budget(16.0, "gpu_memory_gib", GPU)
    probed = sd_planned(budget, "baseline")  # nothing measured fits 16 GiB: the run tries settings in order
    plan = MemoryPlan.from_dict(probed.extra[PLAN])
    assert plan.chosen is None and plan.probe
    remember(probed, GPU, peak_gib=15.2)  # the first one ran, reserving 15.2 GiB at its peak

    measured = sd_planned(budget, "baseline")
    assert chosen(measured) == plan.probe[0] and measured.extra[PLAN]["estimate_gib"] == 15.2
    assert "probe_fields" not in measured.extra[PLAN]


def test_a_run_writes_each_attempts_outcome_for_the_next_plan(smoke_data, tmp_path, monkeypatch, cache_dir):
    """The memory plan's probing in a real run: batch 12 and its checkpointed setting run out of memory, 6 x 2 runs;
    the file then says so, under the GPU the plan named."""
    mock_out_of_memory_above(monkeypatch, limit=6)
    cfg = planned_cfg(smoke_data, tmp_path)
    cfg = cfg.replace(extra={**cfg.extra, PLAN: {**cfg.extra[PLAN], "gpu": GPU}})
    run(cfg)
    assert recalled_gib(cfg, GPU, 22.0) == 22.0
    assert recalled_gib(cfg.replace(gradient_checkpointing=True), GPU, 22.0) == 22.0
    assert recalled_gib(cfg, GPU, 40.0) is None  # more memory than it ran out of: not known
    ran = cfg.replace(batch_size=6, gradient_accumulation_steps=2)
    assert recalled_gib(ran, GPU, 22.0) is None  # ran, but a CPU reserves no CUDA memory to measure
    assert len(json.loads((cache_dir / FILE).read_text())) == 2


def test_the_peak_is_written_and_out_of_memory_after_training_is_not(smoke_data, tmp_path):
    cfg = planned_cfg(smoke_data, tmp_path)
    remembered = remembering(lambda c: {"peak_reserved_mb": 20.5 * 1024}, GPU, 22.0, is_out_of_memory)
    remembered(cfg)
    assert recalled_gib(cfg, GPU, 22.0) == 20.5

    def saving_ran_out(c):
        raise OutOfMemory("all 5 training steps ran, then saving the model ran out of GPU memory", c.steps)

    other = cfg.replace(batch_size=4)
    with pytest.raises(OutOfMemory):
        remembering(saving_ran_out, GPU, 22.0, is_out_of_memory)(other)
    assert recalled_gib(other, GPU, 22.0) is None

    def step_ran_out(c):
        raise torch.OutOfMemoryError("CUDA out of memory (mocked)")

    with pytest.raises(torch.OutOfMemoryError):
        remembering(step_ran_out, GPU, 22.0, is_out_of_memory)(other)
    assert recalled_gib(other, GPU, 22.0) == 22.0 and recalled_gib(other, GPU, 24.0) is None


@pytest.mark.gpu
def test_gpu_a_second_plan_picks_the_setting_the_first_run_measured(smoke_data, tmp_path):
    """On a GPU, end to end: swin_micro has no footprint, so its first plan tries batch 12 in the run; the run writes
    its peak under the GPU's name, and the same recipe planned again picks that setting, measured, without a trial."""
    from gallery_lib.recipes import recipe_config

    base = base_config("smoke", family="swin_transformer", data_dir=str(smoke_data), output_dir=str(tmp_path),
                       device="cuda", gpu_memory_gib=6.0, batch_size=12, steps=5, warmup_steps=2, num_workers=0)
    first = recipe_config(base, "baseline", {})
    plan = MemoryPlan.from_dict(first.extra[PLAN])
    assert first.extra[PLAN]["gpu"] and plan.chosen is None and plan.probe[0] == Candidate(12, 1, False)
    summary = run(first)
    again = MemoryPlan.from_dict(recipe_config(base, "baseline", {}).extra[PLAN])
    assert again.chosen == Candidate(12, 1, False) and again.estimate_gib == pytest.approx(
        summary["peak_reserved_mb"] / 1024, abs=0.01)
