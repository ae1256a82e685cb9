"""The memory plan (``run/memory_plan.py``, ``recipes/memory_fit.py``): with memory sizes of the tests' own, the
choice moves the right way, never exceeds the budget, keeps the global batch and what the user named; an unmeasured
setting gives way to the next in a real run when it runs out of memory early; out of memory says where, how much and
what to try; the cap and its settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from script_testing import load_script

from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.recipes import apply_recipe, recipe_config
from gallery_lib.recipes.memory_fit import fit_to_memory, footprint_gib, training_state
from gallery_lib.recipes.named import _resolved
from gallery_lib.recipes.profiles import base_config
from gallery_lib.run.batch_size import SEARCH_DIR
from gallery_lib.run.failure import failure_from_exception, read_failure
from gallery_lib.run.launch import RunFailed, launch
from gallery_lib.run.memory_plan import (CAP_ENV, HEADROOM, NAMED, PLAN, Budget, Candidate, MemoryPlan, OutOfMemory,
                                         TrainingState, candidates, choose, estimate_gib, out_of_memory,
                                         workers_that_fit)
from gallery_lib.run.metrics import read_metrics
from gallery_lib.tasks.classification import ClassificationTask
from gallery_lib.run.train import build_optimizer, run
from gallery_lib.accel.precision import Precision

# A footprint of the tests' own: 10 GiB of state, 1 GiB per image; checkpointing halves the images' part.
POINTS = {4: 14.0, 8: 18.0}
CHECKPOINTED = {2: 11.0, 8: 14.0}


def plan_for(budget: float, named=(), batch=8, accumulation=1, checkpointing=False) -> MemoryPlan:
    options = candidates(batch, accumulation, checkpointing, named)
    estimates = [estimate_gib(CHECKPOINTED if o.checkpointing else POINTS, o.batch_size) if o.accumulation == 1
                 or o.checkpointing else estimate_gib(POINTS, o.batch_size) for o in options]
    return choose(options, estimates, Budget(budget, "gpu_memory_gib"), Candidate(batch, accumulation,
                                                                                    checkpointing))


def test_candidates_keep_the_global_batch_fastest_first():
    options = candidates(8, 1, False, named=())
    assert [(c.batch_size, c.accumulation, c.checkpointing) for c in options] == [
        (8, 1, False), (8, 1, True), (4, 2, False), (4, 2, True), (2, 4, False), (2, 4, True), (1, 8, False),
        (1, 8, True)]
    assert {c.batch_size * c.accumulation for c in options} == {8}
    assert [c.batch_size for c in candidates(3, 2, False, ())][::2] == [6, 3, 2, 1]  # an odd batch may go odd
    # an even batch goes down to 1 too (a recipe whose Mixup pairs images drops the odd ones: its config check)
    assert [c.batch_size for c in candidates(12, 1, False, ())][::2] == [12, 6, 4, 3, 2, 1]


def test_a_compiled_recipe_tries_each_batch_uncompiled_before_a_smaller_one():
    options = candidates(8, 1, False, named=(), compiled=True)
    assert [(c.batch_size, c.checkpointing, c.uncompiled) for c in options[:5]] == [
        (8, False, False), (8, True, False), (8, False, True), (8, True, True), (4, False, False)]
    assert not any(c.uncompiled for c in candidates(8, 1, False, named=["compile"], compiled=True))  # named: stays
    assert options[3].describe() == "batch 8, gradient checkpointing, uncompiled"
    plan = MemoryPlan(16.0, "gpu_memory_gib", None, probe=tuple(options[2:]), after=tuple(options[3:]))
    assert plan.fix_after_oom(options[2]) == (
        "try batch 8, gradient checkpointing, uncompiled (--batch_size 8 --gradient_accumulation_steps 1 "
        "--gradient_checkpointing --set compile=false)")


def test_named_settings_stay():
    assert {c.batch_size for c in candidates(8, 1, False, named=["batch_size"])} == {8}
    assert {(c.batch_size, c.accumulation) for c in candidates(8, 2, False, ["gradient_accumulation_steps"])} == {
        (8, 2)}
    assert {c.checkpointing for c in candidates(8, 1, False, ["gradient_checkpointing"])} == {False}
    assert {c.checkpointing for c in candidates(8, 1, True, ())} == {True}  # switched on: stays on


def test_estimate_interpolates_measurements_and_never_guesses_above_one():
    assert estimate_gib(POINTS, 8) == 18.0
    assert estimate_gib(POINTS, 6) == pytest.approx(16.0)
    assert estimate_gib(POINTS, 2) == pytest.approx(12.0)   # the line through the two nearest
    assert estimate_gib(POINTS, 16) == pytest.approx(26.0)
    assert estimate_gib({8: 14.0}, 4) is None                # one size measured says nothing of another
    assert estimate_gib({8: 14.0}, 16) is None
    assert estimate_gib({}, 4) is None


@pytest.mark.parametrize("budget", [11.0, 13.0, 14.6, 15.0, 19.0, 40.0])
def test_the_plan_never_exceeds_the_budget(budget):
    plan = plan_for(budget)
    if plan.chosen is not None:
        assert plan.estimate_gib * (1 + HEADROOM) <= budget
        assert plan.chosen.batch_size * plan.chosen.accumulation == 8


def test_less_memory_moves_the_choice_to_checkpointing_then_smaller_steps():
    chosen = [plan_for(budget).chosen for budget in (40.0, 19.0, 15.0, 13.0)]
    assert [(c.batch_size, c.checkpointing) for c in chosen] == [(8, False), (8, False), (8, True), (4, True)]
    # a setting measured to fit wins over unmeasured ones before it
    options = candidates(8, 1, False, ())
    estimates = [18.0, None, 16.0, None, None, None]
    plan = choose(options, estimates, Budget(17.0, "free"), options[0])
    assert plan.chosen == Candidate(4, 2, False) and plan.estimate_gib == 16.0 and plan.changed
    assert plan.after == tuple(options[3:])


def test_nothing_measured_fits_says_so_in_one_line():
    plan = plan_for(10.0)
    assert plan.chosen is None and not plan.probe and not plan.fits
    line = plan.does_not_fit()
    # the smallest setting, batch 1 x 8 checkpointed, along the line through the checkpointed points
    assert "does not fit in 10.0 GiB" in line and "needs 10.5 GiB" in line and "\n" not in line


def test_unmeasured_settings_are_tried_in_order():
    options = candidates(8, 1, False, ())
    plan = choose(options, [30.0, None, 25.0, None, None, None], Budget(20.0, "free"), options[0])
    assert plan.chosen is None and plan.probe == (options[1], options[3], options[4], options[5])
    assert "not measured" in plan.note() and "batch 8, gradient checkpointing" in plan.note()
    assert MemoryPlan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan


def test_precompile_workers_that_fit_beside_the_run():
    assert workers_that_fit(8, 139.0, 11.8, 3.5) == 8
    assert workers_that_fit(8, 38.0, 11.8, 3.5) == 7
    assert workers_that_fit(8, 22.0, 11.8, 3.5) == 2
    assert workers_that_fit(8, 16.0, 11.8, 3.5) == 0  # one worker compiles no sooner than the run itself


def sd_full(**overrides) -> RunConfig:
    return base_config("full", family="stable_diffusion", data_root="/nonexistent", device="cpu", **overrides)


def fitted(base: RunConfig, recipe: str, budget: float, overrides=None) -> RunConfig:
    overrides = overrides or {}
    named = sorted(set(base.extra.get(NAMED, ())) | set(overrides))

    def resolve(planned):
        cfg = _resolved(base.replace(**planned), recipe, overrides)
        return cfg.replace(extra={**cfg.extra, NAMED: named})

    return fit_to_memory(resolve({}), resolve, Budget(budget, "gpu_memory_gib"))


def test_sd_recipes_get_the_same_plan_logic_from_their_measured_footprints():
    big = fitted(sd_full(), "accelerated", 80.0)
    assert (big.batch_size, big.gradient_accumulation_steps, big.gradient_checkpointing) == (8, 1, False)
    assert big.extra[PLAN]["estimate_gib"] == footprint_gib(big)
    # accelerated measured 22.9 GiB at batch 8 and 20.3 checkpointed: batch 8 checkpointed, compiled whole
    small = fitted(sd_full(), "accelerated", 22.0)
    assert (small.batch_size, small.gradient_accumulation_steps, small.gradient_checkpointing) == (8, 1, True)
    assert (small.compile_scope, small.resolved_compile_mode) == ("model", "default")  # checkpointing replays no graphs
    assert small.global_batch_size == big.global_batch_size
    plan = MemoryPlan.from_dict(small.extra[PLAN])
    assert plan.chosen == Candidate(8, 1, True) and plan.after[0] == Candidate(8, 1, False, uncompiled=True)
    assert "batch 8, gradient checkpointing" in plan.note()
    # the peer's batch 8 measured 21.8 GiB unchecked (under a 38 GiB cap) and 20.3 checkpointed: in 22 the plan
    # picks the checkpointed step without trying the other; in 38 the unchecked one
    peer = MemoryPlan.from_dict(fitted(sd_full(), "peer", 22.0).extra[PLAN])
    assert peer.chosen == Candidate(8, 1, True) and not peer.probe
    assert MemoryPlan.from_dict(fitted(sd_full(), "peer", 38.0).extra[PLAN]).chosen == Candidate(8, 1, False)


def test_in_16_gib_sd_runs_its_full_batch_checkpointed_and_uncompiled():
    """In 16 GiB with the EMA offloaded, SD-1.5's compiled steps ran out of memory (batch 8, checkpointed or not, and
    4 x 2), and so did batch 8 eager; eager and checkpointed, accelerated and the peer ran at 15.2 GiB reserved
    (benchmarks/RESULTS.md#memory-plan): the plan picks that without trying the others. Uncompiled, a recipe keeps
    its other switches and drops those that act only through the compiler."""
    for recipe in ("accelerated", "peer"):
        small = fitted(sd_full(), recipe, 16.0)
        plan = MemoryPlan.from_dict(small.extra[PLAN])
        assert plan.chosen == Candidate(8, 1, True, uncompiled=True) and not plan.probe
        assert plan.estimate_gib == pytest.approx(15.15, abs=0.02)
        assert re.search(r"uncompiled \(measured 15\.[12] GiB\)$", plan.note())
        assert small.gradient_checkpointing and small.ema_offload and not small.compile
        assert small.precompile_workers == 0 and not small.channels_last_graphs
    small = fitted(sd_full(), "accelerated", 16.0)
    assert small.cache_latents and small.kernels  # what is not the compiler's stays
    # measured with the EMA on the CPU: no estimate for a run that keeps it on the GPU
    assert footprint_gib(fitted(sd_full(), "accelerated", 22.0), uncompiled=True) is None
    # at an image size no footprint has, each batch is tried compiled, then uncompiled, before the next smaller one
    unmeasured = fitted(sd_full(image_size=448), "accelerated", 16.0)
    plan = MemoryPlan.from_dict(unmeasured.extra[PLAN])
    assert plan.probe[:4] == (Candidate(8, 1, False), Candidate(8, 1, True), Candidate(8, 1, False, uncompiled=True),
                              Candidate(8, 1, True, uncompiled=True))
    checkpointed = unmeasured.replace(**unmeasured.extra[PLAN]["probe_fields"][3])
    assert checkpointed.gradient_checkpointing and not checkpointed.compile
    # the recipes that do not compile have nothing to turn off
    assert not any(c.uncompiled for c in MemoryPlan.from_dict(fitted(sd_full(), "baseline", 16.0).extra[PLAN]).probe)


def test_in_16_gib_dreambooth_starts_each_recipe_at_the_setting_that_trained_there():
    """Under a 16 GiB cap, the EMA on the CPU, DreamBooth's baseline and compiled trained at batch 1 as configured,
    accelerated and the peer checkpointed (the peer's compiled batch 1 ran out of memory in CUDA-graph pools;
    benchmarks/RESULTS.md#memory-plan). Those footprints count only where the EMA waits on the CPU: in 22 GiB it
    stays on the GPU and both run batch 1 unchecked, as measured (about five times as fast)."""
    base = base_config("full", family="dreambooth", data_root="/nonexistent", device="cpu")
    plans = {recipe: MemoryPlan.from_dict(fitted(base, recipe, 16.0).extra[PLAN])
             for recipe in ("baseline", "compiled", "accelerated", "peer")}
    assert all(plan.ema_offloaded and not plan.probe for plan in plans.values())
    assert plans["baseline"].chosen == plans["compiled"].chosen == Candidate(1, 1, False)
    assert plans["accelerated"].chosen == plans["peer"].chosen == Candidate(1, 1, True)
    roomier = {recipe: MemoryPlan.from_dict(fitted(base, recipe, 22.0).extra[PLAN])
               for recipe in ("accelerated", "peer")}
    assert not any(plan.ema_offloaded for plan in roomier.values())
    assert roomier["accelerated"].chosen == Candidate(1, 1, False)  # its unchecked batch 1, measured at 19.7 GiB
    assert roomier["peer"].chosen == Candidate(1, 1, False)  # measured at 19.2 GiB with channels_last


def test_a_user_turns_a_compiled_recipe_uncompiled_in_one_setting():
    cfg = _resolved(sd_full(), "accelerated", {"compile": False})
    assert cfg.recipe == "accelerated+no-compile" and not cfg.compile and cfg.cache_latents
    assert (cfg.precompile_workers, cfg.compile_whole, cfg.channels_last_graphs) == (0, "", False)


def test_the_training_state_is_counted_as_built():
    """The SD-1.5 UNet's parameters as its family declares them, counted on the meta device (no memory, 2 s)."""
    pytest.importorskip("diffusers")
    from gallery_lib.models.sd_parts import SD15_UNET_PARAMETERS, build_unet

    with torch.device("meta"):
        unet = build_unet("sd15")
    assert sum(p.numel() for p in unet.parameters()) == SD15_UNET_PARAMETERS
    state = TrainingState(SD15_UNET_PARAMETERS, "adamw", ema=True)
    assert state.gib == pytest.approx(16.01, abs=0.01)  # 20 bytes a parameter
    assert TrainingState(SD15_UNET_PARAMETERS, "sgd", ema=False).gib == pytest.approx(state.gib * 12 / 20)


def test_a_budget_the_training_state_fills_is_refused_before_any_setting_is_tried():
    plan = fitted(sd_full(ema_offload=False), "accelerated", 16.0)  # the EMA named to stay on the GPU
    chosen = MemoryPlan.from_dict(plan.extra[PLAN])
    assert chosen.chosen is None and not chosen.probe and not chosen.fits  # nothing to try in the run
    assert chosen.does_not_fit() == (
        "does not fit in 16.0 GiB: the weights, gradients, AdamW's moments and the EMA of 860M trained parameters "
        "alone take 16.0 GiB at any batch size; use a GPU with more free memory, or without the EMA (--set ema=off)")
    # without an EMA the state is 12.8 GiB: the unmeasured settings are tried
    assert MemoryPlan.from_dict(fitted(sd_full(ema="off"), "accelerated", 16.0).extra[PLAN]).probe
    assert not MemoryPlan.from_dict(fitted(sd_full(), "accelerated", 12.5).extra[PLAN]).fits  # 12.8 even without


def test_a_model_compiled_whole_holds_a_second_copy_of_the_gradients_under_accumulation():
    """Why the plan counts that copy (``TrainingState.compiled_copy``): a compiled backward is one graph handing back
    every gradient at once, before autograd adds them to those accumulated; eager code and compiled blocks add each
    as it comes. Measured here on a step's second batch (the profiler's allocations, aot_eager)."""
    probe = load_script("benchmarks/probe_compiled_accumulation.py")
    model = probe.mlp()
    gradients = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    peaks = {way: probe.second_batch_peak_mib(probe.mlp(), way) for way in probe.WAYS}
    assert peaks["whole"] >= 0.95 * gradients, peaks
    assert peaks["eager"] < 0.5 * gradients and peaks["blocks"] < 0.5 * gradients, peaks


def test_the_state_counts_that_copy_only_compiled_whole_and_accumulating():
    compiled = _resolved(sd_full(ema_offload=True), "compiled", {})
    assert compiled.compile and compiled.compile_scope == "model"
    one = training_state(compiled)
    accumulating = training_state(compiled.replace(batch_size=4, gradient_accumulation_steps=2))
    assert accumulating.gib == pytest.approx(one.gib + one.buffer_gib) and accumulating.compiled_copy
    assert "the compiled backward's second copy of the gradients" in accumulating.describe()
    for other in (compiled.replace(batch_size=4, gradient_accumulation_steps=2, compile_scope="blocks"),
                  compiled.replace(batch_size=4, gradient_accumulation_steps=2, compile=False)):
        assert training_state(other).gib == pytest.approx(one.gib), other.compile_scope
    # in 16 GiB with the EMA offloaded SD-1.5's state is 12.8 GiB, 16.0 with the copy: compiled whole, only the
    # settings without accumulation are weighed, and the note says why the others are not
    plan = MemoryPlan.from_dict(fitted(sd_full(image_size=448), "peer", 16.0).extra[PLAN])
    weighed = (plan.chosen,) if plan.chosen else plan.probe
    assert all(c.accumulation == 1 or c.uncompiled for c in weighed + plan.after)
    assert any(c.accumulation > 1 and c.uncompiled for c in weighed + plan.after)
    assert "settings left out, in which the weights" in plan.note()
    refused = MemoryPlan(16.0, "gpu_memory_gib", None, 16.2, left_out="18 settings left out, in which ... take 16.0 GiB")
    assert refused.does_not_fit().startswith("does not fit in 16.0 GiB: the smallest setting measured for it needs "
                                             "16.2 GiB, and 18 settings left out, in which ... take 16.0 GiB; use a GPU")
    # a peak reserved stops at a cap: one as large as the budget is a setting that ran out of memory there
    ran_out = MemoryPlan(16.0, "gpu_memory_gib", None, 16.0).does_not_fit()
    assert "the smallest setting measured for it ran out of memory in 16.0 GiB or needs more; use" in ran_out
    assert MemoryPlan(16.0, "gpu_memory_gib", None, 16.0).note().endswith(
        "does not fit (the smallest setting measured ran out of memory in 16.0 GiB or needs more)")
    too_close = MemoryPlan(16.0, "gpu_memory_gib", None, 15.6).does_not_fit()
    assert "it reserved 15.6 GiB, too close to the 16.0 to run again (4% is kept free" in too_close
    roomier = MemoryPlan.from_dict(fitted(sd_full(image_size=448), "peer", 22.0).extra[PLAN])
    assert any(c.accumulation > 1 and not c.uncompiled for c in roomier.probe) and not roomier.left_out


def test_where_the_unfused_adamws_copy_does_not_fit_the_update_runs_one_tensor_at_a_time():
    """The baseline's unfused AdamW holds a fifth fp32 copy of SD-1.5's 860M parameters in its multi-tensor update
    (16.0 GiB with the EMA offloaded): at 16 GiB it updates one tensor at a time; the fused recipes hold no such copy;
    a user who names ``foreach_optimizer`` keeps it, and the run is refused before it starts."""
    small = fitted(sd_full(), "baseline", 16.0)
    plan = MemoryPlan.from_dict(small.extra[PLAN])
    assert not small.foreach_optimizer and small.ema_offload and plan.per_tensor_update and plan.fits
    assert all(fields.get("foreach_optimizer", False) is False for fields in small.extra[PLAN]["probe_fields"])
    assert training_state(apply_recipe("baseline", sd_full())).gib == pytest.approx(16.01 + 3.20, abs=0.01)
    for recipe in ("peer", "accelerated"):  # fused: no copy, nothing to move but the EMA
        assert not MemoryPlan.from_dict(fitted(sd_full(), recipe, 16.0).extra[PLAN]).per_tensor_update
    assert fitted(sd_full(), "baseline", 22.0).foreach_optimizer  # 19.2 GiB fits 22 as it is
    kept = MemoryPlan.from_dict(fitted(sd_full(foreach_optimizer=True), "baseline", 16.0).extra[PLAN])
    assert not kept.fits and "its multi-tensor update's copy" in kept.does_not_fit()
    model = torch.nn.Linear(4, 4)
    precision = Precision.from_settings(small.sections.precision, "cpu")
    looped = build_optimizer(model, small.sections.optimizer, precision, lr=1e-3)
    assert looped.defaults["foreach"] is False


@pytest.mark.parametrize("recipe", ["baseline", "peer", "accelerated"])
def test_where_only_the_ema_does_not_fit_it_waits_in_the_cpus_memory(recipe):
    """SD-1.5's state is 16.0 GiB with the EMA and 12.8 without: at 16 GiB every recipe keeps its EMA on the CPU
    between updates and tries, from the largest batch, the settings its footprints less the EMA do not rule out; at
    22 GiB none does."""
    small = fitted(sd_full(), recipe, 16.0)
    plan = MemoryPlan.from_dict(small.extra[PLAN])
    assert small.ema_offload and small.ema != "off" and plan.ema_offloaded and plan.fits
    # accelerated's and the peer's batch 8 checkpointed uncompiled are measured offloaded; the baseline's is not, and
    # its batch 8 unchecked (25.0 GiB, 21.8 less the EMA) is not tried
    if recipe == "baseline":
        assert plan.chosen is None and plan.probe[0] == Candidate(8, 1, True)
        assert plan.note().startswith("memory plan, 16.0 GiB (gpu_memory_gib): the EMA kept in the CPU's memory "
                                      "between updates; the optimizer's update one tensor at a time; not measured for "
                                      "this recipe: batch 8, gradient checkpointing")
        assert all(fields.get("ema_offload", True) for fields in small.extra[PLAN]["probe_fields"])
    else:
        assert plan.chosen == Candidate(8, 1, True, uncompiled=True)
        assert plan.note().startswith("memory plan, 16.0 GiB (gpu_memory_gib): the EMA kept in the CPU's memory "
                                      "between updates; batch 8, gradient checkpointing, uncompiled")
    assert not training_state(small).ema and training_state(small).gib == pytest.approx(12.81, abs=0.01)
    assert not fitted(sd_full(), recipe, 22.0).ema_offload
    assert not MemoryPlan.from_dict(fitted(sd_full(), recipe, 22.0).extra[PLAN]).ema_offloaded
    assert training_state(apply_recipe("accelerated", sd_full()).replace(amp_level="O2")) is None  # bf16 weights
    dreambooth = base_config("full", family="dreambooth", data_root="/d", instance_prompt="a photo of sks dog")
    assert training_state(apply_recipe("peer", dreambooth)).fix.endswith(", or train LoRA adapters (--set lora_rank=4)")
    assert training_state(apply_recipe("peer", dreambooth.replace(lora_rank=4))) is None  # adapters: only they train


def test_an_offloaded_ema_takes_its_bytes_off_the_measured_footprint():
    """Footprints are measured with the EMA on the GPU; offloaded, the estimate is that less the EMA's fp32 copy
    (3.2 GiB for SD-1.5's 860M parameters), and nothing where the family does not count its parameters."""
    on_gpu = apply_recipe("accelerated", sd_full())
    offloaded = on_gpu.replace(ema_offload=True)
    ema_gib = training_state(on_gpu).gib - training_state(offloaded).gib
    assert ema_gib == pytest.approx(3.20, abs=0.01)
    assert footprint_gib(offloaded) == pytest.approx(footprint_gib(on_gpu) - ema_gib)
    checkpointed = on_gpu.replace(gradient_checkpointing=True)
    assert footprint_gib(checkpointed.replace(ema_offload=True)) == pytest.approx(20.32 - ema_gib)


def test_a_batch_size_the_user_named_wins_over_the_plan():
    named = fitted(sd_full(batch_size=8), "accelerated", 22.0)
    assert named.batch_size == 8 and named.gradient_accumulation_steps == 1
    override = fitted(sd_full(), "accelerated", 22.0, {"gradient_checkpointing": False})
    assert not override.gradient_checkpointing
    too_small = fitted(sd_full(batch_size=8), "accelerated", 12.0, {"gradient_checkpointing": True})
    assert MemoryPlan.from_dict(too_small.extra[PLAN]).chosen is None


def test_recipe_config_records_what_the_user_named_and_plans_nothing_on_a_cpu():
    cfg = recipe_config(base_config("smoke", family="stable_diffusion", batch_size=2), "accelerated",
                        {"lr": 1e-3})
    assert set(cfg.extra[NAMED]) >= {"batch_size", "lr"} and PLAN not in cfg.extra


def test_on_a_cpu_a_run_whose_training_state_fills_the_machines_memory_is_refused_before_it_starts(monkeypatch):
    """SD-1.5 named on a CPU: its weights, gradients, AdamW's moments and EMA take 16.0 GiB (its baseline without the
    EMA peaked at 15.0 GiB resident on a CPU, benchmarks/RESULTS.md#memory-plan). Where less is available, every
    recipe is refused with one line; without the EMA, on a larger machine, or with a tiny model, none is."""
    from gallery_lib.recipes import named

    base = base_config("smoke", model="sd15", device="cpu")
    monkeypatch.setattr(named, "read_host_budget", lambda: Budget(17.0, "host"))
    for recipe in ("baseline", "accelerated"):
        plan = MemoryPlan.from_dict(recipe_config(base, recipe, {}).extra[PLAN])
        assert not plan.fits and plan.does_not_fit() == (
            "does not fit in 17.0 GiB available in the machine: the weights, gradients, AdamW's moments and the EMA of "
            "860M trained parameters (and 1.5 GiB for torch and the frozen modules) alone take 17.5 GiB at any batch "
            "size; run it on a GPU or a machine with more memory, or without the EMA (--set ema=off)")
    assert PLAN not in recipe_config(base, "baseline", {"ema": "off"}).extra  # 14.3 GiB: it starts
    monkeypatch.setattr(named, "read_host_budget", lambda: Budget(64.0, "host"))
    assert PLAN not in recipe_config(base, "baseline", {}).extra
    monkeypatch.setattr(named, "read_host_budget", lambda: Budget(0.5, "host"))
    assert PLAN not in recipe_config(base_config("smoke", family="stable_diffusion", device="cpu"), "baseline",
                                     {}).extra  # sd_tiny: no trained parameters counted


def test_a_run_that_does_not_fit_is_refused_before_it_starts(tmp_path, smoke_data):
    cfg = RunConfig(model="swin_micro", data_dir=str(smoke_data), output_dir=str(tmp_path), device="cpu",
                    num_workers=0)
    plan = MemoryPlan(16.0, "gpu_memory_gib", None, 18.4)
    with pytest.raises(RunFailed) as stopped:
        launch(cfg.replace(extra={PLAN: plan.as_dict()}), echo=None)
    assert stopped.value.failure.kind == "does_not_fit"
    assert read_failure(cfg.run_dir).reason.startswith("does not fit in 16.0 GiB")
    assert not (cfg.run_dir / "logs").exists()  # nothing started
    assert stopped.value.failure.line("accelerated").startswith("accelerated: does not fit in 16.0 GiB: ")


def test_out_of_memory_names_the_step_the_memory_and_the_setting_to_try():
    plan = plan_for(19.0)
    error = out_of_memory(4, 100, 21.96, 22.0, plan.chosen, plan, ())
    assert str(error) == ("out of memory at step 5 of 100 with 22.0 GiB reserved of 22.0 GiB at batch 8: try batch 8, "
                          "gradient checkpointing (--batch_size 8 --gradient_accumulation_steps 1 "
                          "--gradient_checkpointing)")
    early = out_of_memory(None, 100, None, None, Candidate(8, 1, False), None, ["batch_size"])
    assert "before the first step" in str(early) and "gradient checkpointing" in str(early)
    failure = failure_from_exception(error, "rank0.log")
    assert failure.kind == "out_of_memory" and failure.reason == str(error) and failure.first_step == 4


def planned_cfg(data, out, **kw) -> RunConfig:
    values = dict(model="swin_micro", data_dir=str(data), output_dir=str(out), image_size=64, batch_size=12, steps=5,
                  warmup_steps=2, log_every=5, lr=1e-3, lr_warmup_steps=1, num_workers=0, device="cpu",
                  amp_level="O0", deterministic=True, mixup_alpha=0, cutmix_alpha=0)
    values.update(kw)
    cfg = RunConfig(**values)
    options = candidates(12, 1, False, ())
    plan = choose(options, [None] * len(options), Budget(22.0, "gpu_memory_gib"), options[0])
    fields = [o.fields() for o in plan.probe]
    return cfg.replace(extra={PLAN: {**plan.as_dict(), "probe_fields": fields, "configured": options[0].fields()}})


def mock_out_of_memory_above(monkeypatch, limit: int, after_calls: int = 0) -> list[int]:
    """The task's loss raises a mocked OOM for batches over ``limit`` once it was called ``after_calls`` times."""
    seen: list[int] = []
    loss = ClassificationTask.loss

    def limited_loss(self, module, batch, precision):
        if torch.is_grad_enabled():
            seen.append(batch[0].shape[0])
            if batch[0].shape[0] > limit and len(seen) > after_calls:
                raise torch.OutOfMemoryError(f"CUDA out of memory (mocked: batch {batch[0].shape[0]} > {limit}). "
                                             "Tried to allocate 2.00 GiB. If reserved but unallocated memory is large")
        return loss(self, module, batch, precision)

    monkeypatch.setattr(ClassificationTask, "loss", limited_loss)
    return seen


def test_an_unmeasured_setting_gives_way_to_the_next_from_step_0(smoke_data, tmp_path, monkeypatch, capsys):
    seen = mock_out_of_memory_above(monkeypatch, limit=6)
    summary = run(planned_cfg(smoke_data, tmp_path))
    assert seen[:2] == [12, 12] and set(seen[2:]) == {6}  # batch 12, then checkpointed, then 6 x 2
    assert summary["global_batch_size"] == 12 and summary["steps"] == 5
    assert summary["memory_plan"]["chosen"] == {"batch_size": 6, "accumulation": 2, "checkpointing": False,
                                                "uncompiled": False}
    assert summary["memory_plan"]["gave_way"] == ["batch 12", "batch 12, gradient checkpointing"]
    records, last = read_metrics(tmp_path / "swin_transformer" / "baseline" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # the stopped attempt left no step behind
    out = capsys.readouterr().out
    assert "batch 12 ran out of memory before its timed steps" in out
    # each attempt says where it ran out, with what in use, before the next one starts
    assert "memory plan: out of memory at step 1 of 5" in out and " at batch 12: " in out
    assert "(Tried to allocate 2.00 GiB)" in out  # PyTorch's own account
    assert "batch 12 as configured (not measured; batch 12, gradient checkpointing if it runs out of memory" in out
    assert not (tmp_path / "swin_transformer" / "baseline" / SEARCH_DIR).exists()


def test_each_tried_setting_keeps_the_state_the_plan_moved_and_says_so():
    """A probed setting runs with the EMA on the CPU and the update one tensor at a time where the plan moved them:
    its summary's note says so, as the plan's did (DreamBooth's and SD-1.5's 16 GiB runs said neither); the first
    says where it started, where the plan left faster settings untried (a ladder rung's)."""
    from gallery_lib.run.batch_size import train_first_that_fits

    plan = MemoryPlan(16.0, "gpu_memory_gib", None, probe=(Candidate(8, 1, False), Candidate(8, 1, True)),
                      changed=True, ema_offloaded=True, per_tensor_update=True, skipped_faster=1).as_dict()
    plan["probe_fields"] = [{"batch_size": 8}, {"batch_size": 8, "gradient_checkpointing": True}]
    cfg = sd_full().replace(ema_offload=True, foreach_optimizer=False)
    attempts = []

    def train(attempt):
        attempts.append(MemoryPlan.from_dict(attempt.extra[PLAN]))
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (mocked)")
        return {}

    train_first_that_fits(cfg.replace(extra={**cfg.extra, PLAN: plan}), train, log=lambda line: None)
    assert [a.chosen for a in attempts] == [Candidate(8, 1, False), Candidate(8, 1, True)]
    assert all(a.ema_offloaded and a.per_tensor_update for a in attempts)
    assert "the EMA kept in the CPU's memory between updates; the optimizer's update one tensor at a time" in (
        attempts[1].note())
    assert [a.skipped_faster for a in attempts] == [1, 0]
    assert ("batch 8 (not measured, where the run it builds on ran, whose 1 faster setting did not fit; batch 8, "
            "gradient checkpointing if it runs out of memory") in attempts[0].note()


def test_a_late_out_of_memory_stops_the_run_in_one_line(smoke_data, tmp_path, monkeypatch):
    mock_out_of_memory_above(monkeypatch, limit=0, after_calls=3)  # every batch, from the 4th step on
    with pytest.raises(OutOfMemory, match=r"^out of memory at step 4 of 8 .*at batch 12: try batch 12, gradient "
                                          r"checkpointing \(--batch_size 12 --gradient_accumulation_steps 1 "
                                          r"--gradient_checkpointing\)$"):
        run(planned_cfg(smoke_data, tmp_path, steps=8, warmup_steps=1))


def test_out_of_memory_after_the_last_step_does_not_train_again(smoke_data, tmp_path, monkeypatch, capsys):
    # on the GPU a run that fit its cap to the last GiB ran out while saving its model, and the plan took that for
    # its setting not fitting: it trained again from step 0, checkpointed
    seen = mock_out_of_memory_above(monkeypatch, limit=100)  # every batch fits

    def export_out_of_memory(self, run_dir, model):
        raise torch.OutOfMemoryError("CUDA out of memory (mocked: saving)")

    monkeypatch.setattr(ClassificationTask, "export", export_out_of_memory)
    with pytest.raises(OutOfMemory, match=r"^all 5 training steps ran, then saving the trained model ran out of GPU "
                                          r"memory(?: \(.* GiB in use\))?: free the GPU"):
        run(planned_cfg(smoke_data, tmp_path))
    assert seen == [12] * 5  # one attempt, not a second one checkpointed
    assert "ran out of memory before its timed steps" not in capsys.readouterr().out


def test_out_of_memory_in_the_validation_pass_is_skipped_in_one_line(smoke_data, tmp_path, monkeypatch, capsys):
    def evaluate_out_of_memory(self, model):
        raise torch.OutOfMemoryError("CUDA out of memory (mocked: validation)")

    monkeypatch.setattr(ClassificationTask, "evaluate", evaluate_out_of_memory)
    summary = run(planned_cfg(smoke_data, tmp_path))
    assert Path(summary["exported_to"]).is_file() and summary["steps"] == 5
    assert re.search(r"all 5 training steps ran, then the validation pass ran out of GPU memory(?: \(.* GiB in "
                     r"use\))?; skipped it", capsys.readouterr().out)


def test_a_run_with_its_ema_offloaded_trains_and_exports_as_one_with_the_ema_beside_the_model(smoke_data, tmp_path):
    """On a CPU the offloaded EMA's copies are the tensors themselves: the run must go through the same steps, free
    the gradients before the EMA's update, and export the same averaged weights."""
    def trained(name, **kw):
        cfg = planned_cfg(smoke_data, tmp_path / name, ema="foreach", **kw)
        summary = run(cfg.replace(extra={k: v for k, v in cfg.extra.items() if k != PLAN}))
        return summary, torch.load(summary["exported_to"])

    (kept, kept_weights), (offloaded, offloaded_weights) = trained("kept"), trained("offloaded", ema_offload=True)
    assert kept["final_loss"] == offloaded["final_loss"] and kept_weights.keys() == offloaded_weights.keys()
    for name, tensor in kept_weights.items():
        assert torch.equal(offloaded_weights[name], tensor), name


def test_other_errors_in_an_attempt_propagate(smoke_data, tmp_path, monkeypatch):
    def broken(self, module, batch, precision):
        raise ValueError("not a memory problem")

    monkeypatch.setattr(ClassificationTask, "loss", broken)
    with pytest.raises(ValueError, match="not a memory problem"):
        run(planned_cfg(smoke_data, tmp_path))


def test_none_fits_is_one_config_error(smoke_data, tmp_path, monkeypatch):
    """Every probed setting out of memory: the run does not fit this GPU, which the notebooks and the ladder show as
    such (a ladder rung's ``does not fit``), not as a stopped run."""
    mock_out_of_memory_above(monkeypatch, limit=0)
    with pytest.raises(ConfigError, match="does not fit in 22.0 GiB: batch 12; batch 12, gradient checkpointing; "
                                          "batch 6 x 2") as raised:
        run(planned_cfg(smoke_data, tmp_path))
    failure = failure_from_exception(raised.value, "rank0.log")
    assert failure.kind == "does_not_fit" and failure.line("baseline").startswith("baseline: does not fit in 22.0 GiB")


def test_the_cap_comes_from_the_flag_or_the_environment(monkeypatch):
    from gallery_lib.app.cli import base_from_args, build_parser

    args = build_parser().parse_args(["train", "--model", "swin_micro", "--gpu-memory-gib", "22"])
    assert base_from_args(args).gpu_memory_gib == 22.0
    monkeypatch.setenv(CAP_ENV, "38.5")
    assert base_config("smoke", family="swin_transformer").gpu_memory_gib == 38.5
    assert base_config("smoke", family="swin_transformer", gpu_memory_gib=10).gpu_memory_gib == 10
    monkeypatch.setenv(CAP_ENV, "lots")
    with pytest.raises(ConfigError, match="GALLERY_GPU_MEMORY_GIB='lots' is invalid"):
        base_config("smoke", family="swin_transformer")
    with pytest.raises(ConfigError, match="gpu_memory_gib=0"):
        RunConfig(model="swin_micro", gpu_memory_gib=0)


def test_a_cap_above_the_gpus_free_memory_gives_way_to_what_is_free(monkeypatch):
    """On a 24 GB card where another process (a notebook's own tensors) holds some, a 22 GiB cap cannot be kept: the
    plan weighs what is free, and says so; a cap below the free memory, or a GPU nvidia-smi cannot read, keeps the
    cap."""
    from gallery_lib.run import memory_plan

    monkeypatch.setattr(memory_plan, "_free_gib", lambda gpu: 19.0 + memory_plan.CONTEXT_GIB)
    monkeypatch.setattr(memory_plan, "gpu_name", lambda gpu: "NVIDIA Fake 24GB")  # whatever this host has
    assert memory_plan.read_budget(22.0) == Budget(19.0, "free_below_cap", "NVIDIA Fake 24GB")
    assert memory_plan.read_budget(22.0).describe() == "19.0 GiB (free on the GPU, less than gpu_memory_gib)"
    assert memory_plan.read_budget(16.0) == Budget(16.0, "gpu_memory_gib", "NVIDIA Fake 24GB")
    assert memory_plan.read_budget(None) == Budget(19.0, "free", "NVIDIA Fake 24GB")
    monkeypatch.setattr(memory_plan, "_free_gib", lambda gpu: None)
    monkeypatch.setattr(memory_plan, "gpu_name", lambda gpu: None)
    assert memory_plan.read_budget(22.0) == Budget(22.0, "gpu_memory_gib")
    assert memory_plan.read_budget(None) is None


def test_the_launching_process_gives_back_its_cached_gpu_memory_before_the_free_memory_is_read(monkeypatch):
    """A notebook that used the GPU itself (the ResNet-50 plain loop, the mechanism cells) keeps what its allocator
    reserved; each run is a process of its own and would find only the rest. A process that never used CUDA is left
    alone (emptying its cache would start a CUDA context)."""
    from gallery_lib.run import memory_plan

    calls = []
    monkeypatch.setattr(memory_plan, "_free_gib", lambda gpu: calls.append("nvidia-smi") or 40.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    memory_plan.read_budget(None)
    assert calls == ["nvidia-smi"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    calls.clear()
    memory_plan.read_budget(22.0)
    assert calls == ["empty_cache", "nvidia-smi"]


@pytest.mark.gpu
def test_gpu_memory_this_process_cached_goes_to_the_run():
    """On a GPU: 2 GiB this process reserved and freed (as a notebook's plain loop leaves them) count as free for the
    next run's plan, not as taken."""
    from gallery_lib.run import memory_plan

    torch.cuda.init()
    held = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    del held
    assert torch.cuda.memory_reserved() >= 2 * 2**30
    with_cache = memory_plan._free_gib(memory_plan._first_visible_gpu())
    budget = memory_plan.read_budget(None)
    assert torch.cuda.memory_reserved() < 2**30
    assert budget.gib + memory_plan.CONTEXT_GIB >= with_cache + 1.9, (budget, with_cache)


def test_accumulated_batches_replay_no_cuda_graphs():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 cannot run with compile_mode"):
        RunConfig(model="swin_micro", compile=True, compile_mode="reduce-overhead", gradient_accumulation_steps=2)
    assert not RunConfig(model="swin_micro", gradient_accumulation_steps=2).graphs_can_replay
    assert RunConfig(model="swin_micro").graphs_can_replay


def test_the_cap_is_a_no_op_on_a_cpu():
    from gallery_lib.accel.torch_switches import cap_gpu_memory

    cap_gpu_memory(22.0, torch.device("cpu"))  # would raise if it touched CUDA
    cap_gpu_memory(None, torch.device("cuda"))


def test_the_cap_on_a_device_without_an_index_goes_to_the_current_gpu(monkeypatch):
    """A notebook passes ``torch.device("cuda")``; CUDA's allocator cap takes only an index (it raised on the bare
    device under a cap before any rung ran)."""
    from types import SimpleNamespace

    from gallery_lib.accel.torch_switches import cap_gpu_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=88 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: calls.append(args))
    cap_gpu_memory(22.0, torch.device("cuda"))
    cap_gpu_memory(44.0, torch.device("cuda", 0))
    assert calls == [(0.25, 1), (0.5, 0)]


def test_the_done_line_says_what_the_plan_changed():
    from gallery_lib.run.summary import describe_summary

    summary = {"precompile_time_s": 0, "steps": 10, "resumed_from_step": 0, "warmup_steps": 2, "samples_per_s": 50.0,
               "warmup_time_s": 1.0, "peak_mem_mb": 1024.0, "final_loss": 0.1,
               "memory_plan": MemoryPlan(22.0, "gpu_memory_gib", Candidate(4, 2, False), 20.1, changed=True).as_dict()}
    assert describe_summary(summary).endswith("batch 4 x 2 accumulation steps (memory plan)")
    summary["memory_plan"]["changed"] = False
    assert "memory plan" not in describe_summary(summary)


def test_the_report_says_what_each_run_planned(tmp_path):
    from gallery_lib.reports.comparison import RunRecord, _memory_plan

    plan = MemoryPlan(22.0, "gpu_memory_gib", Candidate(8, 1, True), 18.44, changed=True)
    record = RunRecord(recipe="accelerated", config={}, steps=[], summary={"memory_plan": plan.as_dict()},
                       run_dir=tmp_path)
    assert _memory_plan(record) == ("; memory plan, 22.0 GiB (gpu_memory_gib): batch 8, gradient checkpointing "
                                    "(measured 18.4 GiB)")
    assert _memory_plan(RunRecord(recipe="compiled", config={}, steps=[], summary={}, run_dir=tmp_path)) == ""


def test_every_ladder_rung_resolves_under_a_plan():
    """A rung that replays CUDA graphs cannot checkpoint or accumulate: the plan leaves those settings out for it
    instead of failing to resolve (every rung raised when the plan weighed checkpointing)."""
    from gallery_lib.recipes.ladder import RUNGS, recipe_name

    base = base_config("full", family="stable_diffusion", data_root="/data", device="cuda", gpu_memory_gib=22.0,
                       precompile_workers=0)
    for rung in RUNGS:
        cfg = recipe_config(base, recipe_name(rung), {})
        plan = MemoryPlan.from_dict(cfg.extra[PLAN])
        settings = (plan.chosen,) if plan.chosen else plan.probe
        if cfg.resolved_compile_mode == "reduce-overhead" and not settings:  # batch 48 with graphs: 55-78 GiB
            assert plan.note().endswith("GiB)") and "does not fit" in plan.note(), rung.name
            continue
        assert settings and cfg.global_batch_size == settings[0].batch_size * settings[0].accumulation
        if cfg.resolved_compile_mode == "reduce-overhead":
            assert not any(s.checkpointing or s.accumulation > 1 for s in settings + plan.after), rung.name


def on_a_gpu(monkeypatch) -> RunConfig:
    """SD-1.5's full profile resolved as on a one-GPU machine (the GPU recipes' switches) without a GPU."""
    monkeypatch.setattr("gallery_lib.recipes.named.visible_cuda_devices", lambda: 1)
    monkeypatch.setattr("gallery_lib.recipes.named.precompile_workers_for_machine", lambda: 6)
    return base_config("full", family="stable_diffusion", data_root="/nonexistent", device="cuda")


def test_checkpointed_accelerated_takes_the_peers_ema(monkeypatch):
    base = on_a_gpu(monkeypatch)
    assert apply_recipe("accelerated", base).ema == "stream"
    small = fitted(base, "accelerated", 22.0)
    assert small.gradient_checkpointing and small.ema == fitted(base, "peer", 22.0, {
        "batch_size": 8, "gradient_checkpointing": True}).ema == "foreach"


def test_an_offloaded_ema_streams_in_checkpointed_accelerated(monkeypatch):
    """In 16 GiB the EMA waits in the CPU's memory: ``accelerated`` streams it through the GPU in chunks, where the
    peer copies the whole average there and back."""
    base = on_a_gpu(monkeypatch)
    small, peer = fitted(base, "accelerated", 16.0), fitted(base, "peer", 16.0)
    assert small.gradient_checkpointing and small.ema_offload and small.ema == "stream"
    assert peer.gradient_checkpointing and peer.ema_offload and peer.ema == "foreach"


def test_an_overridden_recipe_reads_its_recipes_footprints(monkeypatch):
    """``accelerated+ema=foreach`` in 22 GiB skips batch 8 unchecked, which accelerated measured at 22.9 GiB: it
    compiled, ran out of memory and compiled again when the footprints were read by the run's full name."""
    plan = MemoryPlan.from_dict(fitted(on_a_gpu(monkeypatch), "accelerated", 22.0, {"ema": "foreach"}).extra[PLAN])
    assert plan.chosen == Candidate(8, 1, True) and plan.estimate_gib == 20.32  # measured checkpointed


def test_probed_settings_start_the_precompile_workers_that_fit(monkeypatch):
    """A probe with the recipe's 6 workers shared out 1.3 GiB to each, and every worker ran out of memory."""
    base = on_a_gpu(monkeypatch).replace(gradient_checkpointing=False)
    cfg = fitted(base, "accelerated", 22.0, {"image_size": 256})  # a size never measured: probed
    plan = MemoryPlan.from_dict(cfg.extra[PLAN])
    assert plan.chosen is None and plan.probe[0] == Candidate(8, 1, False)
    assert cfg.compile_scope == "blocks" and cfg.precompile_workers == plan.precompile_workers == 2  # 22 - 11.8 = 2 x 3.5


def test_notebooks_run_the_peer_on_a_gpu_only(monkeypatch):
    from gallery_lib import notebook_recipes

    assert notebook_recipes(sd_full()) == ["baseline", "compiled", "accelerated"]
    assert notebook_recipes(on_a_gpu(monkeypatch)) == ["baseline", "compiled", "peer", "accelerated"]


@pytest.mark.gpu
def test_gpu_out_of_memory_is_one_line_with_the_setting_to_try(smoke_data, tmp_path):
    """A real CUDA out-of-memory error under a cap far below what batch 96 needs (20 MiB for the allocator): the run
    stops in one line that names where, the memory reserved of the cap, and the next setting to try."""
    cfg = planned_cfg(smoke_data, tmp_path, device="cuda", batch_size=96, gpu_memory_gib=0.02,
                      memory_plan="off").replace(extra={})
    with pytest.raises(RunFailed) as stopped:
        launch(cfg, echo=None)
    failure = stopped.value.failure
    assert failure.kind == "out_of_memory", failure.reason
    assert re.fullmatch(r"out of memory (at step 1 of 5|before the first step \(.*\)) with \d+\.\d GiB reserved of "
                        r"0\.0 GiB at batch 96: try batch 96, gradient checkpointing \(--batch_size 96 "
                        r"--gradient_accumulation_steps 1 --gradient_checkpointing\)", failure.reason), failure.reason


def test_a_plan_reads_the_same_in_the_ladder_table_and_in_readme():
    """One plan, two cells: the notebook's rung table says it in words, README's card tables in short; both name the
    EMA kept on the CPU, and a probed setting says that it is tried."""
    from gallery_lib.run.memory_plan import Candidate, MemoryPlan

    chosen = MemoryPlan(22.0, "gpu_memory_gib", Candidate(4, 2, True), estimate_gib=20.14, changed=True,
                        ema_offloaded=True)
    assert chosen.cell() == "batch 4 x 2 accumulation steps, gradient checkpointing, the EMA in the CPU's memory"
    assert chosen.cell(short=True) == "4 x 2, checkpointing, EMA on the CPU (20.1)"
    kept = MemoryPlan(80.0, "free", Candidate(8, 1, False), estimate_gib=None)
    assert (kept.cell(), kept.cell(short=True)) == ("batch 8 as configured", "8")
    probed = MemoryPlan(16.0, "gpu_memory_gib", None, probe=(Candidate(8, 1, True, uncompiled=True),))
    assert probed.cell() == ("tries batch 8, gradient checkpointing, uncompiled, then the next setting where it runs "
                             "out of memory")
    assert probed.cell(short=True) == "8, checkpointing, uncompiled (tried)"
    none = MemoryPlan(16.0, "gpu_memory_gib", None, estimate_gib=24.0)
    assert (none.cell(), none.cell(short=True)) == ("does not fit in 16.0 GiB", "does not fit")


def test_gpu_runs_that_do_not_fit_as_configured_get_growable_allocator_segments_unless_the_user_set_them(
        monkeypatch):
    from gallery_lib.run.launch import Nodes, Processes, _child_env
    from gallery_lib.run.memory_plan import ALLOCATOR_ENV

    def env(device="cuda", tight=True):
        return _child_env(Processes(), Nodes(), device, deterministic=False, family={}, tight_memory=tight)

    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    assert env()[ALLOCATOR_ENV] == "expandable_segments:True"
    assert ALLOCATOR_ENV not in env(tight=False)  # a run that fits keeps the defaults it was measured with
    assert ALLOCATOR_ENV not in env("cpu")
    monkeypatch.setenv(ALLOCATOR_ENV, "expandable_segments:False")
    assert env()[ALLOCATOR_ENV] == "expandable_segments:False"
    budget = Budget(22.0, "gpu_memory_gib")
    assert not MemoryPlan(22.0, "gpu_memory_gib", Candidate(8, 1, False)).tight
    assert MemoryPlan(22.0, "gpu_memory_gib", Candidate(8, 1, True), changed=True).tight
    assert choose([Candidate(8, 1, False)], [None], budget, Candidate(8, 1, False)).tight  # probes: not measured
