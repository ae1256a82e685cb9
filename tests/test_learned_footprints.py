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
from gallery_lib.run.learned_footprints import FILE, Recalled, recalled, remember, setting_key
from gallery_lib.run.memory_plan import NAMED, PLAN, Budget, Candidate, MemoryPlan, OutOfMemory
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


def key(cfg, gpu=GPU) -> str:
    return setting_key(cfg.to_dict(), gpu)


def first_probe_as_run(budget: Budget):
    """SD-1.5 ``baseline``'s first setting to try under ``budget`` (none measured fits 16 GiB), and its config as
    the run that tried it writes its key."""
    first = MemoryPlan.from_dict(sd_planned(budget, "baseline").extra[PLAN]).probe[0]
    ran = sd_planned(budget, "baseline")
    return first, ran.replace(**first.fields(), extra={**ran.extra, PLAN: {}})


def chosen(cfg) -> Candidate | None:
    plan = MemoryPlan.from_dict(cfg.extra[PLAN])
    return plan.chosen


def test_the_key_is_the_step_on_one_gpu():
    cfg = base_config("full", family="stable_diffusion", data_root="/a", device="cuda")
    same = cfg.replace(output_dir="/elsewhere", steps=300, seed=7, log_every=1, gpu_memory_gib=16.0)
    assert key(cfg) == key(same)
    assert key(cfg) != key(cfg, "NVIDIA A100-SXM4-40GB")
    for shaping in ({"batch_size": 4}, {"gradient_checkpointing": True}, {"image_size": 256}, {"ema": "off"}):
        assert key(cfg.replace(**shaping)) != key(cfg), shaping
    assert key(cfg.replace(batch_size=4, gradient_accumulation_steps=2, gradient_checkpointing=True)).startswith(
        "sd15 | batch 4 x 2, checkpointing | NVIDIA Fake 24GB | torch ")


def test_a_setting_that_ran_out_of_memory_is_not_tried_again_under_as_little(cache_dir):
    first = sd_planned(Budget(22.0, "gpu_memory_gib", GPU))
    assert chosen(first) == Candidate(8, 1, True)  # SD-1.5's measured checkpointed footprint, 20.3 GiB
    remember(key(first), out_of_memory_under=22.0)  # this GPU's step needed more

    again = sd_planned(Budget(22.0, "gpu_memory_gib", GPU))
    assert chosen(again) != Candidate(8, 1, True) and again.extra[PLAN]["gpu"] == GPU
    assert chosen(sd_planned(Budget(22.0, "gpu_memory_gib", "another GPU"))) == Candidate(8, 1, True)
    assert chosen(sd_planned(Budget(38.0, "gpu_memory_gib", GPU))) == Candidate(8, 1, False)  # more memory: unknown
    assert chosen(sd_planned(Budget(22.0, "gpu_memory_gib", None))) == Candidate(8, 1, True)  # name unread: as before
    assert json.loads((cache_dir / FILE).read_text()) == {key(first): {"out_of_memory_under_gib": 22.0}}


def test_a_setting_this_gpu_measured_is_picked_without_a_trial():
    budget = Budget(16.0, "gpu_memory_gib", GPU)
    probed = sd_planned(budget, "baseline")  # nothing measured fits 16 GiB: the run tries settings in order
    plan = MemoryPlan.from_dict(probed.extra[PLAN])
    assert plan.chosen is None and plan.probe
    remember(key(probed), peak_gib=15.2)  # the first one ran, reserving 15.2 GiB at its peak

    measured = sd_planned(budget, "baseline")
    assert chosen(measured) == plan.probe[0] and measured.extra[PLAN]["estimate_gib"] == 15.2
    assert "probe_fields" not in measured.extra[PLAN]


def test_a_setting_that_ran_under_this_cap_is_picked_though_its_peak_filled_it():
    """Under a cap the allocator caches up to the cap: SD's ladder rung that ran at batch 1 x 8 checkpointed under
    22 GiB on an H100 reserved 21.8 GiB at its peak, and its next plan, reading that peak with the headroom, said
    "does not fit". A step that ran under as little memory fits; under less, its peak is what it needs."""
    budget = Budget(16.0, "gpu_memory_gib", GPU)
    first, ran = first_probe_as_run(budget)
    remember(key(ran), peak_gib=15.98, ran_under=16.0)

    remember(key(ran), peak_gib=30.5, ran_under=38.0)  # a run on this GPU without the cap: its allocator cached more
    again = MemoryPlan.from_dict(sd_planned(budget, "baseline").extra[PLAN])
    assert again.chosen == first and again.estimate_gib == 15.98
    assert "measured 16.0 GiB" in again.note()
    smaller = MemoryPlan.from_dict(sd_planned(Budget(15.5, "gpu_memory_gib", GPU), "baseline").extra[PLAN])
    assert smaller.chosen != first  # 15.98 GiB does not fit 15.5: the plan moves on


def test_a_run_writes_each_attempts_outcome_for_the_next_plan(smoke_data, tmp_path, monkeypatch, cache_dir):
    """The memory plan's probing in a real run: batch 12 and its checkpointed setting run out of memory, 6 x 2 runs;
    the file then says so, under the GPU the plan named."""
    mock_out_of_memory_above(monkeypatch, limit=6)
    cfg = planned_cfg(smoke_data, tmp_path)
    cfg = cfg.replace(extra={**cfg.extra, PLAN: {**cfg.extra[PLAN], "gpu": GPU}})
    monkeypatch.setattr("gallery_lib.run.summary.peak_reserved_mb", lambda device: 3.5 * 1024)  # as on a GPU
    run(cfg)
    assert recalled(key(cfg), 22.0) == Recalled(22.0)
    assert recalled(key(cfg.replace(gradient_checkpointing=True)), 22.0) == Recalled(22.0)
    assert recalled(key(cfg), 40.0) is None  # more memory than it ran out of: not known
    ran = key(cfg.replace(batch_size=6, gradient_accumulation_steps=2))
    assert recalled(ran, 22.0) == Recalled(3.5, ran_within=True)  # it ran under the plan's 22 GiB
    assert recalled(ran, 3.6) == Recalled(3.5)  # under less memory: its peak is an estimate
    assert len(json.loads((cache_dir / FILE).read_text())) == 3


def test_out_of_memory_after_the_last_step_is_not_written(smoke_data, tmp_path, monkeypatch, cache_dir):
    """Saving the model ran out of memory after every step ran: the step fitted, and the next plan must not skip it."""
    from gallery_lib.tasks.classification import ClassificationTask

    def export_out_of_memory(self, run_dir, model):
        raise torch.OutOfMemoryError("CUDA out of memory (mocked: saving)")

    monkeypatch.setattr(ClassificationTask, "export", export_out_of_memory)
    cfg = planned_cfg(smoke_data, tmp_path)
    cfg = cfg.replace(extra={**cfg.extra, PLAN: {**cfg.extra[PLAN], "gpu": GPU}})
    with pytest.raises(OutOfMemory, match="^all 5 training steps ran, then saving"):
        run(cfg)
    assert recalled(key(cfg), 22.0) is None and not (cache_dir / FILE).exists()


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


def test_a_setting_that_ran_once_and_ran_out_of_memory_once_under_this_cap_is_not_picked_again():
    """SD's ladder rung at batch 16 x 3 checkpointed ran its 8 steps under 22 GiB on an H100, reserving all of it;
    the next run picked it from that and ran out of memory at its first timed step. A step at the edge of its
    budget is not reliable there: the plan moves on; under more memory it fits, as before."""
    budget = Budget(16.0, "gpu_memory_gib", GPU)
    first, ran = first_probe_as_run(budget)
    remember(key(ran), peak_gib=16.0, ran_under=16.0)
    assert recalled(key(ran), 16.0).ran_within
    remember(key(ran), out_of_memory_under=16.0)

    assert recalled(key(ran), 16.0) == Recalled(16.0)
    again = MemoryPlan.from_dict(sd_planned(budget, "baseline").extra[PLAN])
    assert again.chosen != first and first not in again.probe
    assert recalled(key(ran), 20.0) == Recalled(16.0, ran_within=True)


def test_what_ran_under_the_users_allocator_settings_counts_only_under_them(monkeypatch):
    """The CUDA allocator's settings change what fits (SD's ladder under 22 GiB on an H100 trained twice the batch
    with expandable segments): a step measured under the user's ``PYTORCH_CUDA_ALLOC_CONF`` is measured again under
    the gallery's own choice, and the training process writes under the settings the plan read."""
    budget = Budget(22.0, "gpu_memory_gib", GPU)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    users = sd_planned(budget)
    assert users.extra[PLAN]["allocator"] == "max_split_size_mb:128"
    remember(setting_key(users.to_dict(), GPU, users.extra[PLAN]["allocator"]), out_of_memory_under=22.0)
    assert chosen(sd_planned(budget)) != Candidate(8, 1, True)  # under the same settings: not tried again

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    gallerys = sd_planned(budget)
    assert gallerys.extra[PLAN]["allocator"] is None and chosen(gallerys) == Candidate(8, 1, True)
