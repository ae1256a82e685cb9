"""The training loop's parts, each on its own: the non-finite guard, the step log, the summary, the compile plan and
the attention probe (the loop itself is tested end to end in test_train.py, test_checkpoint.py, test_reliability.py)."""

from __future__ import annotations

import gc
import json
import time
from types import SimpleNamespace

import pytest
import torch

from gallery_lib.accel.compile.plan import CompilePlan
from gallery_lib.accel.distributed import DistInfo
from gallery_lib.accel.precision import Precision
from gallery_lib.config import RunConfig
from gallery_lib.run.attention_probe import AttentionProbe
from gallery_lib.run.metrics import MetricsWriter, read_metrics
from gallery_lib.run.nonfinite import NonfiniteGuard
from gallery_lib.run.step_log import StepLog
from gallery_lib.run.summary import build_summary, describe_summary

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def cfg(**kw) -> RunConfig:
    return RunConfig(**{"model": "swin_micro", "batch_size": 4, "steps": 8, "warmup_steps": 2, "log_every": 4,
                        "device": "cpu", **kw})


def compile_plan(c: RunConfig) -> CompilePlan:
    """The CPU compile plan of a run of ``c``, as the loop opens it."""
    return CompilePlan(CPU, compile=c.sections.compile, family=c.model_family, job=c.sections.job,
                       batch_size=c.batch_size, image_size=c.image_size)


def guard(**kw) -> NonfiniteGuard:
    c = cfg(max_nonfinite_steps=2, **kw)
    return NonfiniteGuard(c.max_nonfinite_steps, c.fused_optimizer, Precision.from_settings(c.sections.precision,
                                                                                            "cpu"), CPU)


def test_device_guard_with_a_grad_scaler_skips_a_bad_step_through_the_scaler():
    """fp16 with a fused optimizer: no host sync; a NaN loss makes the scaler skip the step and back off its scale."""
    c = cfg(max_nonfinite_steps=2, fused_optimizer=True, amp_dtype="float16")
    precision = Precision.from_settings(c.sections.precision, "cpu")
    g = NonfiniteGuard(c.max_nonfinite_steps, c.fused_optimizer, precision, CPU)
    assert g.mode == "device" and precision.scaler is not None
    weight = torch.nn.Parameter(torch.ones(3, 2).t())  # not contiguous, as channels_last weights are not
    optimizer = torch.optim.SGD([weight], lr=0.5, fused=True)
    flags, weights, scales = [], [], []
    for loss in (1.0, float("nan"), 2.0):
        weight.grad = None
        precision.backward(weight.sum())  # finite gradients: only the guard's flag can make the scaler skip
        flags.append(g.update(torch.tensor(loss), optimizer, lambda: precision.step(None, optimizer, None)))
        weights.append(weight.detach().clone())
        scales.append(precision.scaler.get_scale())
    assert [bool(f) for f in flags] == [False, True, False]
    assert torch.equal(weights[0], torch.full((2, 3), 0.5)) and torch.equal(weights[1], weights[0])  # skipped
    assert torch.equal(weights[2], torch.zeros(2, 3)) and scales[1] == scales[0] / 2
    g.count([bool(f) for f in flags])
    assert g.total == 1 and g.counters()["nonfinite_in_a_row"] == 0


def test_host_guard_skips_the_update_of_a_bad_step_and_stops_after_a_run_of_them():
    g, updates = guard(), []
    assert g.mode == "host"
    assert g.update(torch.tensor(1.0), None, lambda: updates.append(1)) is False and updates == [1]
    assert g.update(torch.tensor(float("nan")), None, lambda: updates.append(2)) is True and updates == [1]
    assert not g.should_stop() and g.counters() == {"nonfinite_in_a_row": 1, "nonfinite_steps": 1}
    g.update(torch.tensor(float("inf")), None, updates.append)
    assert g.should_stop() and g.total == 2
    assert "not finite for 2 steps in a row (steps 3-4)" in str(g.error(4, "ckpt/step_5.pt"))
    g.count([True, True, True])  # host mode counted already: flags read back later change nothing
    assert g.total == 2


def test_device_guard_hands_the_optimizer_a_flag_and_counts_it_when_read_back():
    g = guard(fused_optimizer=True, amp_level="O0")
    assert g.mode == "device"
    optimizer = SimpleNamespace()
    seen = []
    flag = g.update(torch.tensor(float("nan")), optimizer, lambda: seen.append(float(optimizer.found_inf)))
    assert seen == [1.0] and not hasattr(optimizer, "found_inf")  # the update ran, the optimizer skipped itself
    assert isinstance(flag, torch.Tensor) and not g.should_stop()  # nothing is read on the host yet
    g.count([bool(flag), True])
    assert g.should_stop() and g.counters() == {"nonfinite_in_a_row": 2, "nonfinite_steps": 2}
    g.count([False])
    assert not g.should_stop()


def test_guard_off_never_checks_and_resumes_its_counters():
    c = cfg(max_nonfinite_steps=0)
    off = NonfiniteGuard(c.max_nonfinite_steps, c.fused_optimizer, Precision.from_settings(c.sections.precision,
                                                                                           "cpu"), CPU)
    calls = []
    assert off.update(torch.tensor(float("nan")), None, lambda: calls.append(1)) is False and calls == [1]
    assert off.mode == "off" and not off.should_stop()
    resumed = NonfiniteGuard(cfg().max_nonfinite_steps, False, Precision.from_settings(cfg().sections.precision, "cpu"),
                             CPU, {"nonfinite_in_a_row": 1, "nonfinite_steps": 3})
    assert resumed.counters() == {"nonfinite_in_a_row": 1, "nonfinite_steps": 3}


def test_step_log_writes_each_step_once_per_flush(tmp_path):
    c, lines = cfg(), []
    path = tmp_path / "metrics.jsonl"
    loader = SimpleNamespace(skipped=3)
    with MetricsWriter(path) as writer:
        log = StepLog(CPU, writer, loader, steps=c.steps, log_every=c.log_every, global_batch_size=c.global_batch_size,
                      start=0, warmup_steps=2, log=lines.append)
        for step in range(4):
            log.record(torch.tensor(float(step)), 0.1 * step, step == 2)
            assert log.due(step + 1) == (step == 3)
        assert log.flush(4) == [False, False, True, False]
        log.restart_clock()
        log.record(torch.tensor(9.0), 0.5, torch.tensor(0.0))
        assert log.flush(5) == [False]
    steps, _ = read_metrics(path)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4] and [s["loss"] for s in steps] == [0, 1, 2, 3, 9]
    assert [s["warmup"] for s in steps] == [True, True, False, False, False]
    assert steps[2]["skipped_step"] and steps[0]["skipped_samples"] == 3 and steps[1]["lr"] == pytest.approx(0.1)
    assert all(s["samples_per_s"] == pytest.approx(4e3 / s["step_time_ms"]) for s in steps)
    assert log.losses == [0, 1, 2, 3, 9] and len(log.step_times) == 5 and len(lines) == 2
    assert lines[0].startswith("[gallery] step 4/8 | loss 3.0000")


def test_work_between_two_steps_is_in_neither_steps_time():
    """The collector's freeze at the end of the warm-up (hundreds of ms after compiling) falls between two steps:
    the step before it ends where it was recorded, the one after starts once the work is done."""
    c = cfg()
    log = StepLog(CPU, None, SimpleNamespace(skipped=0), steps=c.steps, log_every=c.log_every,
                  global_batch_size=c.global_batch_size, start=0, warmup_steps=1, log=lambda line: None)
    for step in range(4):
        log.record(torch.tensor(float(step)), 0.1, False)
        if step == 1:
            log.between_steps(lambda: time.sleep(0.3))
    log.flush(4)
    assert len(log.step_times) == 4 and max(log.step_times) < 100, log.step_times


def test_the_collector_freezes_what_the_warm_up_left_and_counts_the_timed_steps_collections():
    """Frozen objects are out of the collector's walks; a full collection in the timed steps is counted with its
    pause; closing hands the objects back, so a process that trains again frees what they hold."""
    from gallery_lib.run.collector import TimedStepsCollector

    kept = [[object()] for _ in range(1000)]  # long-lived objects, as compiling leaves
    collector = TimedStepsCollector()
    before = gc.get_freeze_count()
    try:
        collector.freeze()
        frozen = collector.frozen
        # a frozen object can still be freed by its reference count (CI's run at 529199d: 2 of 1.19M in a worker that
        # had run other tests), so the count may fall, never below what is kept alive
        assert len(kept) <= gc.get_freeze_count() <= frozen
        collector.freeze()  # once
        assert collector.frozen == frozen and gc.get_freeze_count() <= frozen
        gc.collect()
        assert collector.collections[2] == 1 and collector.pause_ms > 0
    finally:
        collector.close()
    assert gc.get_freeze_count() == before == 0
    gc.collect()
    summary = collector.summary()
    assert summary["gc_full_collections"] == 1 and summary["gc_frozen_objects"] == collector.frozen  # closed: no more
    collector.close()


def test_summary_reads_the_steady_steps_after_warm_up():
    c = cfg()
    log = SimpleNamespace(step_times=[50.0, 30.0, 10.0, 12.0, 11.0], losses=[5.0, 4.0, 3.0, 2.0, 1.0], start=3)
    summary = build_summary(CPU, log, job=c.sections.job, data=c.sections.data, ema=c.sections.ema, steps=c.steps,
                            global_batch_size=c.global_batch_size, run_dir=c.run_dir, warmup_steps=2, setup_time=1.5,
                            precompile_seconds=0.0, probe_seconds=0.2, skipped_samples=1, nonfinite_steps=0,
                            notes=["n"], flops_per_sample=None, extra=7)
    assert summary["median_step_time_ms"] == 11.0 and summary["warmup_time_s"] == pytest.approx(0.08)
    assert summary["samples_per_s"] == pytest.approx(4e3 / 11.0) and summary["resumed_from_step"] == 3
    assert summary["mean_loss_last_10"] == 3.0 and summary["final_loss"] == 1.0 and summary["extra"] == 7
    assert summary["output_dir"] == str(c.run_dir) and json.dumps(summary)
    assert "(median of 3 steps after warm-up)" in describe_summary(summary)


def test_compile_plan_compiles_the_family_blocks_and_reports_the_caches():
    c = cfg(compile=True, compile_scope="blocks")
    lines = []
    with compile_plan(c) as plan:
        assert plan.workers is None  # no precompile_workers asked for
        model = c.model_family.build(c.model, num_classes=4)
        names = plan.compile_blocks(model, backend="eager")
        assert names and all(type(model.get_submodule(n)).__name__ == "SwinTransformerBlock" for n in names)
        called = []
        assert plan.precompile(model, lambda: None, lines.append, meanwhile=lambda: called.append(1)) is False
        assert not called and plan.precompile_seconds == 0.0
        record = plan.summary(lines.append)
    assert set(record) == {"compile_cache", "compile_phases_s"} and "graphs_traced" in record["compile_cache"]
    assert lines and lines[0].startswith("[gallery] compilation in this run:")
    with compile_plan(cfg()) as eager:
        assert eager.summary(lines.append) == {}


def test_compile_whole_compiles_the_named_containers_in_place_of_their_blocks():
    from gallery_lib.config import ConfigError

    c = cfg(compile=True, compile_scope="blocks", compile_whole="SwinTransformerStage")
    model = c.model_family.build(c.model, num_classes=4).eval()
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    expected = model(x)
    with compile_plan(c) as plan:
        names = plan.compile_blocks(model, backend="eager")
    stages = [n for n, m in model.named_modules() if type(m).__name__ == "SwinTransformerStage"]
    assert names == stages and len(stages) > 1  # the stages whole, none of the blocks inside them again
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    with compile_plan(c.replace(compile_whole="SwinTransformerStage,SwinStage")) as plan:
        with pytest.raises(ConfigError, match=r"compile_whole names SwinStage, not a class of SwinTransformer's "
                                              r"modules: name classes that hold its blocks \(SwinTransformerStage\)"):
            plan.compile_blocks(c.model_family.build(c.model, num_classes=4), backend="eager")
    with pytest.raises(ConfigError, match="compile_whole=.* needs compile=True and compile_scope='blocks'"):
        cfg(compile=True, compile_whole="SwinTransformerStage")


def test_compile_plan_counts_only_what_its_run_compiled():
    """Dynamo's counters outlive a run in the same process (a notebook, a test session): the plan reports its part."""
    from torch._dynamo.utils import counters

    counters["inductor"]["fxgraph_cache_miss"] += 5  # an earlier compilation in this process
    counters["stats"]["unique_graphs"] += 2
    with compile_plan(cfg(compile=True, compile_scope="blocks")) as plan:
        counters["inductor"]["fxgraph_cache_miss"] += 1  # this run's own
        record = plan.summary(lambda line: None)["compile_cache"]
    assert record["fx_graph_misses"] == 1 and record["graphs_traced"] == 0 and record["aot_autograd_hits"] == 0


def test_compile_plan_reports_why_a_graph_was_not_cached():
    """A graph a cache bypasses is compiled again by every run: the run says so, with the cache's reason, once."""
    import logging

    fx_log = logging.getLogger("torch._inductor.codecache")
    with compile_plan(cfg(compile=True, compile_scope="blocks")):
        fx_log.info("Bypassing FX Graph Cache because '%s'", "an earlier run's reason")  # not this run's
    lines = []
    with compile_plan(cfg(compile=True, compile_scope="blocks")) as plan:
        for _ in range(2):
            fx_log.info("Bypassing FX Graph Cache because '%s'", "Can't cache HigherOrderOperator: x")
        record = plan.summary(lines.append)
    reason = "Bypassing FX Graph Cache because 'Can't cache HigherOrderOperator: x'"
    assert record["compile_cache_bypassed"] == {reason: 2}
    assert lines[1] == f"[gallery]   not cached, so compiled again by every run: {reason} (2x)"


def test_a_checkpointed_runs_plan_keeps_its_rng_state_in_the_cacheable_form_until_it_closes():
    """AOTAutograd saves a recomputed attention's RNG state in CUDA graphs' form by default, which Inductor's caches
    do not store; a checkpointed run (no CUDA graphs) asks for the other form while its plan is open, and its
    precompile workers copy the setting (it is in the graphs' cache key)."""
    from torch._functorch import config as functorch

    from gallery_lib.accel.compile.precompile.record import apply_flags, backend_flags

    assert functorch.graphsafe_rng_functionalization  # PyTorch's default
    with compile_plan(cfg(compile=True, compile_scope="model")) as plan:
        assert "so the next run loads them" in plan.cache_checkpointed_graphs()
        assert not functorch.graphsafe_rng_functionalization
        flags = backend_flags()
    assert functorch.graphsafe_rng_functionalization and backend_flags()["graphsafe_rng"]
    try:
        apply_flags(flags)  # as a worker does
        assert not functorch.graphsafe_rng_functionalization
    finally:
        functorch.graphsafe_rng_functionalization = True


def test_compile_plan_reports_where_its_own_compile_time_went(monkeypatch):
    """The phases PyTorch times (nested, per process) are reported for this run alone, longest first."""
    from torch._dynamo import utils

    monkeypatch.setattr(utils, "compilation_time_metrics", {"entire_frame_compile": [4.0], "gc": [0.5]})
    lines = []
    with compile_plan(cfg(compile=True, compile_scope="blocks")) as plan:
        utils.compilation_time_metrics["entire_frame_compile"].append(2.5)  # this run's own
        utils.compilation_time_metrics["CUDAGraphNode.record"] = [0.5, 1.0]
        phases = plan.summary(lines.append)["compile_phases_s"]
    assert phases == {"entire_frame_compile": 2.5, "CUDAGraphNode.record": 1.5}  # gc took nothing in this run
    assert list(phases) == ["entire_frame_compile", "CUDAGraphNode.record"]
    assert "entire_frame_compile 2.5, CUDAGraphNode.record 1.5" in lines[-1]



def test_a_phase_cleared_by_a_reset_counts_from_zero(monkeypatch):
    from torch._dynamo import utils

    from gallery_lib.accel.compile.regional import phase_seconds_since

    monkeypatch.setattr(utils, "compilation_time_metrics", {"bytecode_tracing": [0.2], "gc": [3.0]})
    assert phase_seconds_since({"bytecode_tracing": 5.0, "gc": 1.0}) == {"gc": 2.0, "bytecode_tracing": 0.2}

def test_warm_marker_keys_and_a_stale_marker(tmp_path, monkeypatch):
    from gallery_lib.accel.compile.precompile import warm

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    flags = {"deterministic": False}
    key = warm.graph_set_key(["a", "b"], {"backend": "inductor"}, flags, torch.device("cpu"))
    assert key == warm.graph_set_key(["b", "a"], {"backend": "inductor"}, flags, torch.device("cpu"))
    assert len({key, warm.graph_set_key(["a"], {"backend": "inductor"}, flags, torch.device("cpu")),
                warm.graph_set_key(["a", "b"], {"backend": "eager"}, flags, torch.device("cpu")),
                warm.graph_set_key(["a", "b"], {"backend": "inductor"}, {"deterministic": True},
                                   torch.device("cpu"))}) == 4
    with torch._inductor.config.patch(force_layout_optimization=True):  # as TORCHINDUCTOR_FORCE_LAYOUT_OPT=1 sets it
        assert warm.graph_set_key(["a", "b"], {"backend": "inductor"}, flags, torch.device("cpu")) != key
    hint = warm.hint_key("sd15", "accelerated", 32)
    assert not warm.is_warm(key) and not warm.hinted_warm(hint)
    warm.mark_warm(key, hint)
    assert warm.is_warm(key) and warm.hinted_warm(hint) and warm.marker_dir().parent == tmp_path
    # A plan that skipped its workers on this marker, whose run then missed the caches (emptied under the marker):
    with compile_plan(cfg(compile=True, compile_scope="blocks")) as plan:
        plan.cached_key = key
        from torch._dynamo.utils import counters

        counters["inductor"]["fxgraph_cache_miss"] += 1
        lines = []
        record = plan.summary(lines.append)
    assert record["precompile_skipped"] and "the next run precompiles them again" in lines[-1]
    assert not warm.is_warm(key) and not warm.hinted_warm(hint)


def test_seconds_to_steady_counts_the_warm_up_up_to_its_last_slow_step():
    from gallery_lib.run.timing import seconds_to_steady

    assert seconds_to_steady([9000.0, 300.0, 120.0, 250.0, 101.0, 100.0], 100.0) == pytest.approx(9.67)
    assert seconds_to_steady([105.0, 99.0], 100.0) == 0.0  # within 10% of the median from the start
    assert seconds_to_steady([500.0, 100.0], float("nan")) == 0.6  # no timed step: all of the warm-up


def test_attention_probe_reports_what_ran():
    hook = SimpleNamespace(selector=SimpleNamespace(chosen={"shape": "efficient"}))
    probe = AttentionProbe(SimpleNamespace(attention=hook, module=None), None, None, None)
    probe()
    lines = []
    assert probe.choices == {} and probe.report(lines.append) == {"attention": {"shape": "efficient"}}
    assert lines == ["[gallery] attention shape: efficient"]
    plain = AttentionProbe(SimpleNamespace(attention=None, module=torch.nn.Linear(2, 2)),
                           SimpleNamespace(loss=lambda module, batch, precision: module(batch).sum()),
                           torch.ones(1, 2), None)
    plain()
    assert plain.report(lines.append) == {} and "no scaled_dot_product_attention call" in lines[-1]
    own_kernel = AttentionProbe(SimpleNamespace(attention=SimpleNamespace(selector=SimpleNamespace(chosen={}))),
                                None, None, None)
    assert own_kernel.report(lines.append) == {} and "ran their own kernel" in lines[-1]


def test_progress_line_eta_uses_the_interval_median_pace():
    from gallery_lib.run.step_log import eta

    assert eta([100.0, 900.0, 200.0], 30) == " | ETA 0:06"  # median 200 ms: a slow outlier does not set the pace
    assert eta([1000.0], 4000) == " | ETA 1:06:40"
    assert eta([100.0], 0) == "" and eta([], 5) == ""


def test_progress_bar_follows_the_step_lines_from_a_resumed_start():
    import io

    from gallery_lib.run.progress import StepProgress

    out = io.StringIO()
    bar = StepProgress("accelerated", enabled=True, file=out, mininterval=0)
    bar.feed("[gallery] sd_tiny | recipe accelerated | ...")  # not a step line: no bar yet
    assert bar.bar is None
    bar.feed("[gallery] step 40/100 | loss 0.1234 | 55.0 img/s | 10.0 ms/step | peak 1.00 GiB | ETA 0:01")
    assert (bar.bar.n, bar.bar.total) == (40, 100)
    bar.feed("[gallery] step 50/100 | loss nan | 56.0 img/s | 9.9 ms/step | peak 1.00 GiB | ETA 0:00")
    bar.close()
    assert bar.bar.n == 50 and "loss nan, 56.0 img/s" in out.getvalue() and "accelerated" in out.getvalue()
    quiet = StepProgress("baseline", enabled=False)
    quiet.feed("[gallery] step 4/4 | loss 1.0 | 1.0 img/s | 1.0 ms/step | peak 0.1 GiB")
    assert quiet.bar is None


def test_the_advice_of_a_nonfinite_stop_fits_when_it_began():
    from gallery_lib.run.nonfinite import NonfiniteLossError

    g = guard()
    for loss in (float("nan"), float("nan")):
        g.update(torch.tensor(loss), None, lambda: None)
    early = g.error(1, "ckpt/step_2.pt")
    assert isinstance(early, NonfiniteLossError) and early.first_step == 0
    assert "from the run's first steps: the recipe's numerics" in str(early) and "Lower the learning" not in str(early)
    late = g.error(7, "ckpt/step_8.pt")  # steps 6-7 after six good ones: the learning rate or the data
    assert late.first_step == 6 and "Lower the learning rate (lr)" in str(late) and "numerics" not in str(late)
    assert g.error(11, "ckpt", start=10).first_step == 10 and "first steps" in str(g.error(11, "ckpt", start=10))


def test_a_run_after_a_deterministic_one_in_the_same_process_is_set_up_as_in_a_fresh_one():
    """In-process runs (the tests) do not inherit the last run's deterministic algorithms or fp32 matmul precision:
    both are in Inductor's cache key, so an inherited one would change the numerics and miss every graph that fresh
    processes compiled."""
    from gallery_lib.run.train import configure_backends

    def state():
        return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)

    saved = state()
    try:
        configure_backends(deterministic=False, sdpa_math=False)
        after_fast = state()
        assert after_fast == (False, False, "high", True)
        configure_backends(deterministic=True, sdpa_math=False)
        assert state() == (True, True, "highest", False)
        configure_backends(deterministic=False, sdpa_math=False)
        assert state() == after_fast
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.set_float32_matmul_precision(saved[2])
        torch.backends.cudnn.benchmark = saved[3]


def test_a_config_error_stops_the_run_with_its_whole_message_other_errors_cut_to_one_line():
    from gallery_lib.config import ConfigError
    from gallery_lib.run.failure import failure_from_exception

    fix = "name classes that hold its blocks (" + ", ".join(f"Block{i}" for i in range(30)) + "), or drop it"
    assert failure_from_exception(ConfigError(fix), "r.log").line("accelerated") == (
        f"accelerated: stopped, ConfigError: {fix}, see r.log")
    assert failure_from_exception(RuntimeError(fix), None).reason == f"RuntimeError: {fix}"  # whole, not cut


def test_a_gpu_without_bfloat16_trains_in_float16_with_a_scaler_and_says_why(monkeypatch):
    """T4 and V100 (compute capability 7.x) have no bfloat16 tensor cores: a bfloat16 recipe runs float16 there."""
    from gallery_lib.accel.precision import no_bfloat16_reason, resolve_amp_dtype

    cfg = RunConfig(model="swin_micro", amp_level="O1", amp_dtype="bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (7, 5))
    assert resolve_amp_dtype(cfg.sections.precision, "cuda") == torch.float16 and "7.5" in no_bfloat16_reason("cuda")
    assert resolve_amp_dtype(cfg.sections.precision, "cpu") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (8, 0))
    assert resolve_amp_dtype(cfg.sections.precision, "cuda") == torch.bfloat16 and no_bfloat16_reason("cuda") is None
