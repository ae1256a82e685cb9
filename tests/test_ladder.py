"""The optimization ladder: each rung adds only its own switches, the top rungs are the accelerated recipe, the math
attention switch really forces PyTorch's math kernel, and the report computes speedups and findings from the runs."""

from __future__ import annotations

import json

import pytest
import torch

from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.recipes.ladder import (RUNG_NAMES, RUNGS, SMALLER_SIZES, LadderSizes, RungResult, default_sizes,
                                        ladder_base, ladder_configs, recipe_name, rung_named, rung_parents, run_ladder)
from gallery_lib.recipes.profiles import base_config
from gallery_lib.recipes import accelerated, apply_recipe, describe, recipe_config
from gallery_lib.reports.ladder import findings, ladder_plan, ladder_report, ladder_rows, to_markdown
from gallery_lib.run.memory_plan import NAMED, PLAN, MemoryPlan
from gallery_lib.run.train import configure_backends

SIZES = LadderSizes(large_batch=48, checkpointing_batch=96, loader_workers=8)


def _full_base() -> RunConfig:
    return base_config("full", family="stable_diffusion", data_root="/data")


def _changes(cfg: RunConfig, under: RunConfig) -> set[str]:
    now, then = cfg.to_dict(), under.to_dict()
    return {name for name, value in now.items() if then[name] != value and name not in ("recipe", "extra")}


def test_each_rung_changes_only_its_own_switches():
    base = _full_base()
    configs = ladder_configs(base, sizes=SIZES, on_gpu=True)
    assert list(configs) == list(RUNG_NAMES)
    below = None
    for rung in RUNGS[1:]:
        under = configs[rung.builds_on or below or RUNGS[0].name]
        cfg = configs[rung.name]
        assert cfg.recipe == recipe_name(rung)
        changed = _changes(cfg, under)
        assert changed and changed <= set(rung.adds(under, SIZES)), rung.name  # something, and only its own
        below = rung.name
    first = configs["tf32"]  # the talk's baseline: fp32/TF32, math attention, loading in the training process
    assert (first.amp_level, first.sdpa_math, first.num_workers, first.compile, first.cache_latents) == (
        "O0", True, 0, False, False)
    assert (first.ema, first.fused_optimizer, first.kernels) == ("loop", False, False)
    # past the talk the rungs build on the EMA rung: ZeRO-2 stays a branch of its own
    assert configs["zero2"].data_parallel == "zero2" and configs["bf16"].data_parallel == "ddp"
    assert configs["checkpointing"].batch_size == 96 and configs["checkpointing"].gradient_checkpointing


def test_the_kernels_rung_is_the_accelerated_recipe_at_the_large_batch(monkeypatch):
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    base = _full_base()
    configs = ladder_configs(base, sizes=SIZES, on_gpu=True)
    rung = configs["kernels"]
    assert configs["cuda_graphs"].compile_whole and not configs["checkpointing"].compile_whole  # as the recipe does
    reference = accelerated(base.replace(batch_size=SIZES.large_batch))
    # The recipe states the CUDA graphs and the kernels as intent, resolved for the step's size; the rung names what
    # they resolve to at its batch, like every rung its switch.
    assert (reference.compile_mode, reference.kernel_ops) == ("auto", "auto")
    named = reference.replace(compile_mode=reference.resolved_compile_mode, kernel_ops=reference.resolved_kernel_ops,
                              num_workers=rung.num_workers)
    assert rung.replace(recipe="accelerated", extra=named.extra) == named  # extra: the rung names its compile
    assert "compile" in rung.extra[NAMED]
    assert rung.kernel_op_names == ("geglu", "group_norm_silu")  # 48 images of 512 px: a large step


def test_on_a_cpu_the_cuda_graph_rung_is_left_out_and_the_next_builds_below_it():
    base = base_config("smoke", family="stable_diffusion", data_root="/data")
    configs = ladder_configs(base, on_gpu=False)
    assert configs["cuda_graphs"] is None
    assert configs["cached_latents"].compile_mode == "default"
    assert _changes(configs["cached_latents"], configs["regional"]) == {"cache_latents"}
    assert configs["batch"].batch_size == 8 and configs["checkpointing"].batch_size == 8  # the 32-image smoke set
    with pytest.raises(ConfigError, match="cuda_graphs rung needs a GPU"):
        apply_recipe("ladder-11-cuda_graphs", base)


def test_rungs_are_recipes_and_the_ladder_refuses_other_families():
    base = base_config("smoke", family="stable_diffusion", data_root="/data")
    assert apply_recipe("ladder-05-batch", base) == ladder_configs(base)["batch"]
    assert describe("ladder-04-attention").startswith("Optimization ladder, rung 4: fused attention.")
    assert rung_named("ladder-04-attention") is rung_named("attention")
    with pytest.raises(ConfigError, match="not on the ladder"):
        rung_named("turbo")
    swin = base_config("smoke", family="swin_transformer", data_root="/data")
    with pytest.raises(ConfigError, match="trains Stable Diffusion's UNet.*model='sd15'"):
        ladder_configs(swin)


def test_sdpa_math_forces_the_math_kernel_and_the_next_run_gets_the_fused_ones_back():
    q = torch.randn(1, 2, 64, 16)
    math_kernel = 0  # torch's SDPBackend numbering: 0 math, 1 flash
    configure_backends(deterministic=False, sdpa_math=True)
    try:
        assert torch._fused_sdp_choice(q, q, q) == math_kernel
    finally:
        configure_backends(deterministic=False, sdpa_math=False)
    assert torch._fused_sdp_choice(q, q, q) != math_kernel
    with pytest.raises(ConfigError, match="sdpa_math=True and fused_attention=True contradict"):
        RunConfig(model="sd_tiny", sdpa_math=True, fused_attention=True)


def _result(name: str, img_per_s: float | None, mem_gib: float = 10.0, failure: str | None = None) -> RungResult:
    cfg = ladder_configs(_full_base(), sizes=SIZES, on_gpu=True)[name]
    summary = None if img_per_s is None else {
        "samples_per_s": img_per_s, "median_step_time_ms": 1000 * cfg.batch_size / img_per_s,
        "p20_step_time_ms": 990 * cfg.batch_size / img_per_s, "p80_step_time_ms": 1010 * cfg.batch_size / img_per_s,
        "peak_mem_mb": mem_gib * 1024, "peak_reserved_mb": (mem_gib + 2) * 1024, "device_name": "NVIDIA H100 80GB HBM3"}
    return RungResult(rung_named(name), cfg, summary=summary, failure=failure, builds_on=rung_parents(True)[name])


def test_report_speedups_gains_and_findings(tmp_path):
    results = [_result("tf32", 10.0, 60), _result("amp", 12.0, 62), _result("ema", 30.0, 70),
               _result("zero2", 29.0, 71), _result("bf16", 30.5, 70), _result("compile", None, failure="out of memory")]
    rows = ladder_rows(results)
    by = {row["name"]: row for row in rows}
    assert by["amp"]["speedup"] == pytest.approx(1.2) and by["amp"]["gain"] == pytest.approx(1.2)
    assert by["bf16"]["builds_on"] == "ema" and by["bf16"]["gain"] == pytest.approx(30.5 / 30.0)
    assert by["zero2"]["gain"] == pytest.approx(29 / 30) and by["tf32"]["talk_speedup"] == 1.0
    assert by["compile"]["img_per_s"] is None and by["compile"]["failure"] == "out of memory"
    said = "\n".join(findings(rows))
    assert "Fastest rung: bfloat16 (ladder-08-bf16), 30.5 img/s, 3.05x the first rung" in said
    assert "ZeRO-2 (0.97x)" in said and "bfloat16 (1.02x)" in said and "fused EMA" not in said.split("Bought")[1]
    assert "ladder-09-compile (torch.compile): stopped, out of memory." in said
    assert "stopped" not in "\n".join(findings(rows, failures=False))  # the report lists it under its table
    report = ladder_report(results, tmp_path)
    assert report.markdown.count("ladder-09-compile (torch.compile): stopped") == 1
    assert "Fastest rung" in report.markdown and "Fastest rung" not in report._repr_markdown_()  # printed after
    assert "| ladder-01-amp (fp16 AMP) | 8 | 12.0 |" in report.markdown
    # a rung is not said to be 1.00x itself: where the fastest is the one the speedups are over, the line says so
    alone = findings(ladder_rows([_result("compile", None, failure="does not fit"), _result("regional", 19.8)]))
    assert "Fastest rung: regional compile, precompiled (ladder-10-regional), 19.8 img/s, the only rung that ran " \
           "here, on NVIDIA H100" in alone[0]
    first = findings(ladder_rows([_result("tf32", 12.0), _result("amp", 10.0)]))[0]
    assert "12.0 img/s, the first that ran here, which no later rung beat," in first and "1.00x" not in first
    assert "| 64.0 (62.0) | 1.20x | 1.20x |" in report.markdown  # memory as reserved (allocated)
    assert report.figure.axes[1].get_title() == "(b) peak memory reserved"
    assert json.loads((tmp_path / "ladder.json").read_text())[1]["speedup"] == pytest.approx(1.2)
    assert (tmp_path / "ladder.png").stat().st_size > 10_000
    assert "data:image/png;base64," in report._repr_markdown_()


def test_findings_say_what_the_top_speedup_is_made_of_and_which_rungs_compiled_cold():
    """The gains on the top rung's path multiply to its speedup: the report lists them largest first, lumps those
    that bought nothing, and says for each compiled rung whether its caches were cold or warm."""
    results = [_result("tf32", 10.0), _result("amp", 10.2), _result("loader", 12.5), _result("fused", 13.0),
               _result("attention", 20.0)]
    results[3].summary["compile_cache"] = {"aot_autograd_misses": 2, "fx_graph_misses": 2}
    results[4].summary["compile_cache"] = {"aot_autograd_misses": 0, "fx_graph_misses": 0}
    said = "\n".join(findings(ladder_rows(results)))
    assert ("What the 2.00x of fused attention is made of (each rung's gain over the one it builds on; they multiply "
            "to it): fused attention 1.54x, tuned data loader 1.23x, fused layers + fused AdamW 1.04x, the other 1 "
            "rung together 1.02x.") in said
    assert ("Compile caches at each compiled rung's start: fused layers + fused AdamW cold, fused attention warm"
            in said)
    gapped = [_result("tf32", 10.0), _result("loader", 12.5), _result("fused", 13.0)]  # amp missing: no breakdown
    assert "made of" not in "\n".join(findings(ladder_rows(gapped)))


def test_cpu_rungs_show_no_speedup(tmp_path):
    """On a CPU the smoke rungs check code paths: the table says "n/a on CPU (smoke)" where a GPU run has its
    speedups and gains; the findings name no fastest rung, claim no rung "bought nothing" and say that CPU timings
    are not speedups; the figure shows step times, with no bar and no ratio."""
    from gallery_lib.reports.comparison import CPU_TIMINGS

    results = [_result("tf32", 10.0), _result("amp", 9.0), _result("ema", 30.0)]
    for result in results:
        result.summary.update(device_name="CPU", peak_reserved_mb=None)
    rows = ladder_rows(results)
    said = "\n".join(findings(rows))
    assert "Fastest" not in said and "fastest" not in said and "Bought no speed" not in said
    assert CPU_TIMINGS in said and "3 of 3 rungs ran on a CPU" in said and "3.00x" not in said
    report = ladder_report(results, tmp_path)
    assert "| n/a on CPU (smoke) | n/a on CPU (smoke) |" in report.markdown and "0.90x" not in report.markdown
    assert "Fastest rung" not in report.markdown and CPU_TIMINGS in report.markdown
    speed_axis = report.figure.axes[0]
    assert CPU_TIMINGS in speed_axis.get_title() and speed_axis.get_ylabel() == "ms per step"
    assert not speed_axis.patches and not speed_axis.texts  # no bar, no label: nothing reads as a ratio
    medians = [bar.lines[0].get_ydata()[0] for bar in speed_axis.containers]  # one error bar per rung
    assert medians == pytest.approx([row["median_step_ms"] for row in rows])


def test_a_rung_run_without_the_one_it_builds_on_has_no_gain():
    """Picked alone with the first rung, the kernels rung builds on channels_last all the same: no gain is claimed
    over the first rung, and the CPU parents skip the left-out GPU-only rungs (CUDA graphs, channels_last)."""
    rows = ladder_rows([_result("tf32", 10.0), _result("kernels", 75.0)])
    assert rows[1]["builds_on"] == "channels_last" and rows[1]["gain"] is None
    assert rows[1]["speedup"] == pytest.approx(7.5)
    assert rung_parents(True)["cached_latents"] == "cuda_graphs"
    assert rung_parents(False)["cached_latents"] == "regional" and rung_parents(False)["bf16"] == "ema"
    assert rung_parents(True)["kernels"] == "channels_last" and rung_parents(False)["kernels"] == "cached_latents"


def test_plan_lists_what_each_rung_changes():
    text = str(ladder_plan(base_config("smoke", family="stable_diffusion", data_root="/data"), ["attention",
                                                                                               "cuda_graphs"]))
    assert "| ladder-04-attention: fused attention | fused | `sdpa_math=False` |" in text
    assert "(left out: needs a GPU)" in text and "ladder-05" not in text


def test_a_failing_rung_is_reported_and_the_ladder_goes_on(monkeypatch):
    from gallery_lib.run.launch import RunFailed, RunResult

    def fake_launch(cfg, echo=None, console="all"):
        if cfg.recipe.endswith("amp"):
            raise RunFailed("training exited with code 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried ...")
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0})

    monkeypatch.setattr("gallery_lib.recipes.ladder.launch", fake_launch)
    base = base_config("smoke", family="stable_diffusion", data_root="/data")
    results = run_ladder(base, ["tf32", "amp", "loader", "cuda_graphs"], echo=None)
    assert [(r.rung.name, r.failure) for r in results] == [("tf32", None), ("amp", "out of memory"),
                                                          ("loader", None), ("cuda_graphs", "needs a GPU")]


def test_bench_ladder_joins_parts_in_ladder_order_with_short_failures(tmp_path):
    from script_testing import load_script

    bench = load_script("benchmarks/bench_ladder.py")
    parts = []
    for i, entries in enumerate([[_result("amp", 12.0), _result("tf32", 10.0)],
                                 [_result("checkpointing", None), _result("amp", 13.0)]]):
        rungs = [{"rung": r.rung.name, "config": r.config.to_dict(), **({"summary": r.summary} if r.summary else
                  {"failure": "training exited with code 1\n  File x\nAttributeError: Can't pickle local object"})}
                 for r in entries]
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({"command": "c", "date": "d", "gpu": "g", "torch": "t", "rungs": rungs}))
    record = bench.merge([str(p) for p in parts], str(tmp_path / "ladder.json"), str(tmp_path / "report"))
    assert [row["name"] for row in record["rows"]] == ["tf32", "amp", "checkpointing"]
    assert record["rows"][1]["speedup"] == pytest.approx(1.3)  # the later part's amp
    assert record["rows"][2]["failure"] == "AttributeError: Can't pickle local object"
    assert (tmp_path / "report" / "ladder.md").exists() and "commit" in record and "commit" in record["parts"][0]


def test_bench_ladder_records_each_rungs_wall_time_from_start_to_exit(tmp_path, monkeypatch):
    """Beyond set-up, warm-up and steps, a rung's process starts and exits: its whole time is what a time-limited call
    has to fit."""
    import time
    from types import SimpleNamespace

    from script_testing import load_script

    bench = load_script("benchmarks/bench_ladder.py")
    monkeypatch.setattr(bench, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(bench, "launch", lambda cfg: (time.sleep(0.2), SimpleNamespace(summary={
        "samples_per_s": 1.0, "peak_mem_mb": 1024.0}))[1])
    out = tmp_path / "part.json"
    bench.main(["--profile", "smoke", "--rungs", "tf32,amp", "--data-root", str(tmp_path), "--out", str(out)])
    entries = json.loads(out.read_text())["rungs"]
    assert [e["rung"] for e in entries] == ["tf32", "amp"]
    assert all(0.2 <= e["wall_s"] < 5 for e in entries)


def test_the_smoke_ladder_reaches_the_sd_notebooks_batch_at_its_batch_rung():
    """On a CPU the ladder starts at batch 2, so that the accelerated rung compiles the SD and DreamBooth notebooks'
    graphs (batch 4) once for the gallery, and the checkpointing rung stays at that batch to load most of them; a given
    batch size and the full profile keep their sizes."""
    smoke = ladder_base("smoke", data_root="/data")
    configs = ladder_configs(smoke, on_gpu=False)
    accelerated = base_config("smoke", family="stable_diffusion", data_root="/data")
    assert (smoke.batch_size, configs["batch"].batch_size, configs["checkpointing"].batch_size) == (2, 4, 4)
    assert configs["kernels"].batch_size == configs["checkpointing"].batch_size == accelerated.batch_size == 4
    assert ladder_base("smoke", batch_size=3).batch_size == 3 and default_sizes(ladder_base("smoke", batch_size=3)
                                                                                 ).large_batch == 6
    assert default_sizes(base_config("smoke", family="stable_diffusion")).large_batch == 8  # gallery train's rungs
    full = ladder_base("full", data_root="/data")
    assert (full.batch_size, default_sizes(full).large_batch, default_sizes(full).checkpointing_batch) == (8, 48, 96)


def test_the_ladders_rungs_save_no_trained_model_unless_asked():
    """The ladder measures speed: each rung saving its SD-1.5 pipeline would fill some 60 GB of disk. A user who wants
    the rungs' models names ``export_model``; ``gallery run``'s own runs still save theirs."""
    assert not any(cfg.export_model for cfg in ladder_configs(ladder_base("smoke", data_root="/data"),
                                                              on_gpu=False).values() if cfg is not None)
    assert all(cfg.export_model for cfg in ladder_configs(ladder_base("smoke", data_root="/data", export_model=True),
                                                          on_gpu=False).values() if cfg is not None)
    assert base_config("smoke", family="stable_diffusion").export_model


def test_the_talks_a100_marks_are_drawn_beside_gpu_rungs_only():
    from gallery_lib.reports.ladder import ladder_figure

    results = [_result("tf32", 10.0, 60), _result("amp", 12.0, 62)]
    on_gpu = ladder_figure(ladder_rows(results))
    assert all(any(line.get_label().startswith("the talk") for line in ax.get_lines()) for ax in on_gpu.axes)
    for result in results:
        result.summary.update(device_name="CPU", peak_reserved_mb=None)
    on_cpu = ladder_figure(ladder_rows(results))
    assert not any(line.get_label().startswith("the talk") for ax in on_cpu.axes for line in ax.get_lines())
    assert "not its speed" in on_cpu.texts[0].get_text()


def test_a_rung_too_large_for_the_gpu_says_does_not_fit_and_is_no_failure(monkeypatch, tmp_path):
    """At a small memory a rung the plan cannot fit is shown as not fitting, not as a stopped run, and the notebook
    does not raise for it; a rung the plan changed shows the setting it ran."""
    from gallery_lib.run.failure import RunFailure
    from gallery_lib.run.launch import RunFailed, RunResult

    too_large = "does not fit in 16.0 GiB: the smallest setting measured for it needs 17.1 GiB; use a GPU with more"
    planned = {"changed": True, "chosen": {"batch_size": 4, "accumulation": 2, "checkpointing": True}}

    def fake_launch(cfg, echo=None, console="all"):
        if cfg.recipe.endswith("amp"):
            raise RunFailed("refused", RunFailure(kind="does_not_fit", reason=too_large, log="rank0.log"))
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0, "memory_plan": planned})

    monkeypatch.setattr("gallery_lib.recipes.ladder.launch", fake_launch)
    results = run_ladder(base_config("smoke", family="stable_diffusion", data_root="/data"), ["tf32", "amp"],
                         echo=None)
    amp = results[1]
    assert amp.does_not_fit and not amp.stopped
    assert amp.line() == f"ladder-01-amp (fp16 AMP): {too_large}; {SMALLER_SIZES}"
    results.raise_if_failed()  # nothing stopped with an error
    rows = ladder_rows([_result("tf32", 10.0), RungResult(amp.rung, amp.config, failure=too_large,
                                                          builds_on="tf32", does_not_fit=True)])
    rows[0]["setting"] = "4 x 2, checkpointing (memory plan)"  # as ladder_rows reads it from a planned summary
    markdown = to_markdown(rows)
    assert "| 4 x 2, checkpointing (memory plan) | 10.0 |" in markdown
    assert f"- ladder-01-amp (fp16 AMP): {too_large}; {SMALLER_SIZES}" in markdown and "stopped" not in markdown
    summary = {**_result("tf32", 10.0).summary, "memory_plan": planned}
    assert ladder_rows([RungResult(rung_named("tf32"), None, summary=summary)])[0]["setting"] == (
        "4 x 2, checkpointing (memory plan)")


# The rungs before the compile rung train eagerly: here each is one in-process run, as the notebook's would be one
# process; the notebook test climbs the first rung and every compiled one (CI's time, RESULTS.md#ci).
EAGER_RUNGS = RUNG_NAMES[1:RUNG_NAMES.index("compile")]


@pytest.mark.slow
def test_every_eager_rung_above_the_first_trains_on_a_cpu(tmp_path):
    """amp to bf16 on the smoke ladder, each resolved on the rungs below it: each trains its 4 steps at its batch size
    with a finite loss and lands a summary, as in the notebook."""
    from gallery_lib.app.workflow import prepare
    from gallery_lib.run.train import run

    base = ladder_base("smoke", data_root=str(tmp_path / "data"), output_dir=str(tmp_path / "out"), device="cpu",
                       steps=4, log_every=4)
    prepare(base, progress=False)
    configs = ladder_configs(base, on_gpu=False)
    assert EAGER_RUNGS == ("amp", "loader", "fused", "attention", "batch", "ema", "zero2", "bf16")
    for name in EAGER_RUNGS:
        cfg = configs[name]
        assert not cfg.compile, name
        summary = run(cfg)
        assert summary["type"] == "summary" and summary["recipe"] == recipe_name(rung_named(name))
        assert summary["steps"] == 4 and summary["samples_per_s"] > 0 and torch.isfinite(
            torch.tensor(summary["final_loss"])), (name, summary)
        assert summary["global_batch_size"] == (4 if RUNG_NAMES.index(name) >= RUNG_NAMES.index("batch") else 2)


def test_under_a_cap_every_rung_keeps_its_global_batch_and_the_plan_sets_each_rungs_step(monkeypatch):
    """On a 16 GiB card the rungs ran as configured and stopped out of memory (the ladder bypassed the memory plan):
    each rung is now fitted as every recipe is, its global batch kept, and the ladder's own batch sizes are not the
    user's to keep."""
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    base = ladder_base("full", data_root="/data", device="cuda", gpu_memory_gib=16.0, precompile_workers=0)
    assert "batch_size" not in base.extra[NAMED] and base.batch_size == 8
    configs = ladder_configs(base, sizes=SIZES, on_gpu=True)
    # ZeRO-2 on one process shards nothing and cannot move its EMA to the CPU: its state alone fills 16 GiB; the
    # rungs that replay CUDA graphs neither checkpoint nor accumulate, and measured 52-75 GiB at batch 48
    too_large = ["zero2", "cuda_graphs", "cached_latents", "channels_last", "kernels"]
    assert all("does not fit" in MemoryPlan.from_dict(configs.pop(name).extra[PLAN]).note() for name in too_large)
    for name, cfg in configs.items():
        plan = MemoryPlan.from_dict(cfg.extra[PLAN])
        settings = (plan.chosen,) if plan.chosen else plan.probe
        wanted = {"batch": 48, "checkpointing": 96}.get(name, 8 if RUNG_NAMES.index(name) < 5 else 48)
        assert settings and all(s.batch_size * s.accumulation == wanted for s in settings + plan.after), name
        # the training process switches to each probed setting with its batch, not the rung's own
        for setting, fields in zip(settings, cfg.extra[PLAN].get("probe_fields", ())):
            assert (fields["batch_size"], fields["gradient_accumulation_steps"]) == (
                setting.batch_size, setting.accumulation), name
        # a compiled rung stays compiled (what it measures), and a setting measured too large is not tried
        assert not any(s.uncompiled for s in settings + plan.after), name
        assert (cfg.batch_size, cfg.gradient_checkpointing) != (wanted, False), name
    # a 16 GiB card takes the rungs' steps smaller or checkpointed; the plan is in the rung table before a run
    assert any(s.batch_size < 48 or s.checkpointing for s in MemoryPlan.from_dict(
        configs["batch"].extra[PLAN]).probe)
    table = str(ladder_plan(base, ["tf32", "batch"], sizes=SIZES))
    # batch 48 checkpointed measured too large (34.6 GiB under a 38 GiB cap): the batch rung tries 24 x 2 first
    assert "| on this GPU |" in table and "tries batch 8" in table and "tries batch 24 x 2" in table
    # the same rung as a recipe of its own (`gallery run --recipes ladder-05-batch`) is planned the same way
    alone = MemoryPlan.from_dict(recipe_config(base, "ladder-05-batch", {}).extra[PLAN])
    assert alone.probe == MemoryPlan.from_dict(configs["batch"].extra[PLAN]).probe


def test_a_user_batch_stays_named_on_the_ladder():
    base = ladder_base("full", data_root="/data", batch_size=4)
    assert "batch_size" in base.extra[NAMED] and base.batch_size == 4


def test_where_the_first_rungs_do_not_fit_the_speedups_are_over_the_first_that_ran(tmp_path):
    """On a small GPU the rungs that write attention out may not fit at all: the report still renders, its speedups
    and the breakdown are over the first rung that ran and say so, and the talk's markers in the plot are taken over
    that rung too."""
    no_fit = "does not fit in 16.0 GiB: batch 1 x 8 accumulation steps each ran out of memory before its timed steps"
    results = [_result("tf32", None, failure=no_fit), _result("amp", None, failure=no_fit),
               _result("loader", None, failure=no_fit), _result("fused", None, failure=no_fit),
               _result("attention", 20.0), _result("batch", 30.0)]
    rows = ladder_rows(results)
    assert {row["speedup_over"] for row in rows} == {"ladder-04-attention"}
    assert rows[5]["speedup"] == pytest.approx(1.5) and rows[5]["gain"] == pytest.approx(1.5)
    said = "\n".join(findings(rows))
    assert ("1.50x fused attention (ladder-04-attention), the first rung that ran here, on NVIDIA H100 80GB HBM3"
            in said)
    assert "What the 1.50x of larger batch is made of (each rung's gain over the one it builds on; they multiply " \
           "to it): larger batch 1.50x." in said  # the breakdown stops at the rung the speedups are over
    report = ladder_report(results, tmp_path)
    assert "Speedups over fused attention (ladder-04-attention), the first rung that ran here" in report.markdown
    assert all(f"{recipe_name(rung_named(name))} (" in report.markdown for name in ("tf32", "amp", "loader", "fused"))
    speed_axis = report.figure.axes[0]
    assert "over fused attention" in speed_axis.get_title()
    talk = {row["name"]: row["talk_speedup"] for row in rows}  # the talk's markers: over its attention rung too
    assert list(speed_axis.lines[0].get_ydata()) == pytest.approx([1.0, talk["batch"] / talk["attention"]])


def test_a_rung_that_frees_no_memory_starts_where_the_rung_it_builds_on_ran(monkeypatch, tmp_path):
    """At 16 GiB the batch, EMA and bf16 rungs each ran out of memory at the same 12 settings before batch 4 x 12
    checkpointed: a rung whose switch frees no memory now starts where the rung below it ran, and says how many
    faster settings it left untried; one that frees memory (fused attention) tries its settings from the fastest.
    The training processes are faked: each runs at the setting its plan names after ``runs_out`` of them."""
    from gallery_lib.recipes.ladder import Start, _fitted, rung_chain
    from gallery_lib.run.failure import RunFailure
    from gallery_lib.run.launch import RunFailed, RunResult
    from gallery_lib.run.memory_plan import Budget, Candidate

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setenv("GALLERY_CACHE_DIR", str(tmp_path / "cache"))  # nothing learned on this machine
    base = ladder_base("full", data_root="/data", device="cuda", gpu_memory_gib=16.0, precompile_workers=0)
    launched, runs_out = {}, {"batch": 11, "fused": 3}

    def fake_launch(cfg, echo=None, console="all"):
        plan = MemoryPlan.from_dict(cfg.extra[PLAN])
        launched[cfg.recipe] = plan
        settings = (plan.chosen,) if plan.chosen else plan.probe
        if not settings:  # as the launcher refuses it
            raise RunFailed("refused", RunFailure(kind="does_not_fit", reason=plan.note(), log="rank0.log"))
        ran = settings[min(runs_out.get(cfg.recipe.split("-")[-1], 0), len(settings) - 1)]
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0, PLAN: {"chosen": ran.__dict__, "changed": True}})

    monkeypatch.setattr("gallery_lib.recipes.ladder.launch", fake_launch)
    monkeypatch.setattr("gallery_lib.recipes.ladder.validate_for_machine", lambda cfg: None)  # no GPU here
    run_ladder(base, ["fused", "attention", "batch", "ema", "zero2", "bf16", "compile"], sizes=SIZES, echo=None)
    batch = launched["ladder-05-batch"]
    below = batch.probe[11]  # 48 checkpointed is measured too large: not among the settings to try
    assert below == Candidate(4, 12, True) and batch.skipped_faster == 0
    for name in ("ladder-06-ema", "ladder-08-bf16"):  # bf16 builds on ema, past ZeRO-2
        plan = launched[name]
        assert plan.probe[0] == below and plan.skipped_faster == 11 and plan.probe[1:] == batch.probe[12:], name
        assert "batch 4 x 12 accumulation steps, gradient checkpointing, where the run it builds on ran, whose 11 " \
               "faster settings did not fit, giving way" in plan.note()
    # compiled whole, a step that accumulates holds a second copy of the gradients: 16.0 GiB of state with SD-1.5's,
    # so only the full batch 48 is left to try (checkpointed: unchecked it was measured too large)
    compiled = launched["ladder-09-compile"]
    assert compiled.probe == (Candidate(48, 1, True),) and compiled.skipped_faster == 0  # 48 unchecked: measured
    assert "18 settings left out, in which the weights, gradients, AdamW's moments, the compiled backward's second " \
           "copy of the gradients of 860M trained parameters alone take 16.0 GiB" in compiled.note()
    assert launched["ladder-07-zero2"].chosen is None and not launched["ladder-07-zero2"].probe  # does not fit
    table = str(ladder_plan(base, ["attention", "batch", "ema"], sizes=SIZES)).splitlines()
    assert [line.endswith("or from where the rung it builds on ran |") for line in table[2:]] == [False, False, True]
    fused, attention = launched["ladder-03-fused"], launched["ladder-04-attention"]
    # it frees memory: from the fastest, batch 8 checkpointed, which the fused rung's measured peak rules out for it
    assert attention.probe == (Candidate(8, 1, True), *fused.probe) and attention.skipped_faster == 0
    # climbed in parts: a rung whose rung below is not run in this call starts where the plan knows that one runs
    # (here measured; on a GPU, what its run in an earlier call left in this machine's footprints)
    from gallery_lib.recipes import memory_fit

    family_footprint = memory_fit.footprint_gib
    monkeypatch.setattr(memory_fit, "footprint_gib", lambda cfg, uncompiled=False: 15.0 if (
        cfg.recipe.startswith("ladder-05") and (cfg.batch_size, cfg.gradient_checkpointing) == (4, True)) else
        family_footprint(cfg, uncompiled))
    launched.clear()
    run_ladder(base, ["ema"], sizes=SIZES, echo=None)
    assert launched["ladder-06-ema"].probe[0] == below and launched["ladder-06-ema"].skipped_faster == 11
    # a faster setting measured to fit is still taken: the start only skips the unmeasured ones
    measured = Candidate(12, 4, True)
    monkeypatch.setattr(memory_fit, "footprint_gib", lambda cfg, uncompiled=False: 12.0 if (
        cfg.batch_size, cfg.gradient_checkpointing) == (12, True) else family_footprint(cfg, uncompiled))
    plan = MemoryPlan.from_dict(_fitted(rung_chain(base, sizes=SIZES, on_gpu=True)["ema"],
                                        Budget(16.0, "gpu_memory_gib"), Start(below, ran=True)).extra[PLAN])
    assert plan.chosen == measured and plan.skipped_faster == 0


def test_above_a_rung_that_does_not_fit_the_next_starts_where_the_one_below_that_ran(monkeypatch, tmp_path):
    """At 16 GiB the compile rung does not fit (compiled whole, its accumulating steps hold a second copy of the
    gradients): the regional rung above it starts where the bf16 rung ran, in one call or climbed in parts, not
    from batch 48; past a rung that frees memory, it does not."""
    from gallery_lib.recipes import memory_fit
    from gallery_lib.recipes.ladder import _rungs_it_starts_from, rung_parents
    from gallery_lib.run.failure import RunFailure
    from gallery_lib.run.launch import RunFailed, RunResult
    from gallery_lib.run.memory_plan import Candidate

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setenv("GALLERY_CACHE_DIR", str(tmp_path / "cache"))
    base = ladder_base("full", data_root="/data", device="cuda", gpu_memory_gib=16.0, precompile_workers=0)
    bf16_ran = Candidate(4, 12, True)
    launched = {}

    def fake_launch(cfg, echo=None, console="all"):
        plan = MemoryPlan.from_dict(cfg.extra[PLAN])
        launched[cfg.recipe] = plan
        if cfg.recipe.endswith("compile"):
            raise RunFailed("too large", RunFailure(kind="does_not_fit", reason=plan.note(), log="rank0.log"))
        ran = bf16_ran if cfg.recipe.endswith("bf16") else (plan.chosen or plan.probe[0])
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0, PLAN: {"chosen": ran.__dict__, "changed": True}})

    monkeypatch.setattr("gallery_lib.recipes.ladder.launch", fake_launch)
    monkeypatch.setattr("gallery_lib.recipes.ladder.validate_for_machine", lambda cfg: None)
    results = run_ladder(base, ["bf16", "compile", "regional"], sizes=SIZES, echo=None)
    assert results[1].does_not_fit and launched["ladder-10-regional"].probe[0] == bf16_ran
    assert launched["ladder-10-regional"].skipped_faster == 11  # 48 checkpointed: measured too large
    # climbed in parts: bf16's setting known from what it measured on this machine
    family_footprint = memory_fit.footprint_gib
    monkeypatch.setattr(memory_fit, "footprint_gib", lambda cfg, uncompiled=False: 15.0 if (
        cfg.recipe.startswith("ladder-08") and (cfg.batch_size, cfg.gradient_checkpointing) == (4, True)) else
        family_footprint(cfg, uncompiled))
    launched.clear()
    run_ladder(base, ["compile", "regional"], sizes=SIZES, echo=None)
    assert launched["ladder-10-regional"].probe[0] == bf16_ran
    parents = rung_parents(True)
    assert _rungs_it_starts_from("regional", parents)[:3] == ["compile", "bf16", "ema"]
    assert _rungs_it_starts_from("batch", parents) == ["attention"]  # fused attention frees memory: no further


def test_a_rung_that_ran_out_where_the_rung_below_ran_starts_past_it(monkeypatch, tmp_path):
    """The compile rung ran out of memory at 16 GiB where the bf16 rung ran (batch 4 x 12 checkpointed), and at the
    next setting: the next call started it again at batch 48, since the start was no longer among the settings to
    try. A rung now starts at the first setting past the rung below's that it has not run out at, and says so (here
    the regional rung: the compile rung, compiled whole, has no setting with accumulation left at 16 GiB)."""
    from gallery_lib.recipes import memory_fit
    from gallery_lib.recipes.ladder import Start, _fitted, rung_chain
    from gallery_lib.run.memory_plan import Budget, Candidate

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setenv("GALLERY_CACHE_DIR", str(tmp_path / "cache"))
    base = ladder_base("full", data_root="/data", device="cuda", gpu_memory_gib=16.0, precompile_workers=0)
    rung = rung_chain(base, sizes=SIZES, on_gpu=True)["regional"]
    ran_out = {(4, 12, True), (3, 16, False)}
    family_footprint = memory_fit.footprint_gib
    monkeypatch.setattr(memory_fit, "footprint_gib", lambda cfg, uncompiled=False: 16.5 if (
        cfg.batch_size, cfg.gradient_accumulation_steps, cfg.gradient_checkpointing) in ran_out and not uncompiled
        else family_footprint(cfg, uncompiled))
    below = Candidate(4, 12, True)  # where the bf16 rung ran
    plan = MemoryPlan.from_dict(_fitted(rung, Budget(16.0, "gpu_memory_gib"), Start(below, ran=True)).extra[PLAN])
    alone = MemoryPlan.from_dict(_fitted(rung, Budget(16.0, "gpu_memory_gib")).extra[PLAN])
    start = alone.probe.index(Candidate(3, 16, True))
    # without the start: from the fastest not measured too large (48 checkpointed is, since that call)
    assert alone.probe[0] == Candidate(24, 2, False)
    assert plan.probe == alone.probe[start:] and plan.skipped_faster == start and plan.started_past
    assert plan.after == plan.probe[1:]
    assert ("batch 3 x 16 accumulation steps, gradient checkpointing, past where the run it builds on ran (out of "
            f"memory here before), whose {start} faster settings did not fit") in plan.note()
    # where every setting from the start on ran out here, the faster ones are still tried
    ran_out.update((c.batch_size, c.accumulation, c.checkpointing) for c in alone.probe[start:])
    last = MemoryPlan.from_dict(_fitted(rung, Budget(16.0, "gpu_memory_gib"), Start(below, ran=True)).extra[PLAN])
    assert last.probe and last.skipped_faster == 0 and not last.started_past


def test_above_a_rung_that_stopped_out_of_memory_the_next_starts_past_where_it_ran_out(monkeypatch, tmp_path):
    """At 22 GiB on an H200 the EMA rung's faster settings ran out of memory before their timed steps and batch 16 x 3
    checkpointed ran out mid-run, which stopped it; the compile rung above then tried from batch 48 again, a
    whole-model compile each (4 tries in 8 minutes). A rung above one that stopped out of memory now starts at the
    first setting that one has not run out of memory at, and says so; climbed in parts (the rung below not run in
    the call, its footprints left by an earlier one), the same, past rungs between with nothing learned. The training
    processes are faked; what ran out of memory is faked in the footprints the plan reads, as the training process
    writes them."""
    from gallery_lib.run.failure import RunFailure
    from gallery_lib.run.launch import RunFailed, RunResult
    from gallery_lib.run.learned_footprints import remember, setting_key

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setattr("gallery_lib.run.memory_plan.gpu_name", lambda gpu: "NVIDIA Fake 24GB")
    monkeypatch.setenv("GALLERY_CACHE_DIR", str(tmp_path / "cache"))
    base = ladder_base("full", data_root="/data", device="cuda", gpu_memory_gib=16.0, precompile_workers=0)
    launched = {}

    def fake_launch(cfg, echo=None, console="all"):
        plan = MemoryPlan.from_dict(cfg.extra[PLAN])
        launched[cfg.recipe] = plan
        if cfg.recipe.endswith("ema"):  # three settings run out before their timed steps, the fourth mid-run
            noted = cfg.extra[PLAN]
            for fields in noted["probe_fields"][:4]:  # as the training process writes them
                remember(setting_key(cfg.replace(**fields).to_dict(), noted["gpu"], noted["allocator"]),
                         out_of_memory_under=16.0)
            raise RunFailed("stopped", RunFailure(kind="out_of_memory", reason="out of memory at step 5 of 8",
                                                  log="rank0.log", first_step=4))
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0, PLAN: {"chosen": plan.probe[0].__dict__}})

    monkeypatch.setattr("gallery_lib.recipes.ladder.launch", fake_launch)
    monkeypatch.setattr("gallery_lib.recipes.ladder.validate_for_machine", lambda cfg: None)
    results = run_ladder(base, ["ema", "bf16"], sizes=SIZES, echo=None)
    ema, bf16 = launched["ladder-06-ema"], launched["ladder-08-bf16"]
    assert results[0].stopped and not results[1].stopped and ema.skipped_faster == 0
    # bf16 (builds on the EMA rung, frees no memory) starts at the EMA rung's fifth setting, not its own first
    assert bf16.probe[0] == ema.probe[4] and bf16.skipped_faster == 4 and not bf16.started_past
    assert (f"{ema.probe[4].describe()}, at the first setting not yet tried by the run it builds on, whose 4 faster "
            "settings did not fit, giving way") in bf16.note()
    launched.clear()
    run_ladder(base, ["bf16"], sizes=SIZES, echo=None)  # climbed in parts: the EMA rung's settings known to run out
    assert launched["ladder-08-bf16"].probe == bf16.probe and launched["ladder-08-bf16"].skipped_faster == 4
    # past rungs below with nothing learned here (bf16; compile does not fit at 16 GiB) to the one that has
    run_ladder(base, ["regional"], sizes=SIZES, echo=None)
    assert launched["ladder-10-regional"].probe[0] == ema.probe[4] and launched["ladder-10-regional"].skipped_faster
    # a rung below with nothing learned here does not narrow the tries
    (tmp_path / "cache").rename(tmp_path / "elsewhere")
    launched.clear()
    run_ladder(base, ["bf16"], sizes=SIZES, echo=None)
    assert launched["ladder-08-bf16"].skipped_faster == 0 and launched["ladder-08-bf16"].probe[0] == ema.probe[0]


def test_a_rung_with_more_training_state_starts_past_where_the_rung_below_filled_the_budget(monkeypatch, tmp_path):
    """At 22 GiB on an H100 the EMA rung ran at 12 x 4 checkpointed with 21.54 GiB reserved; the compile rung above
    started there and ran out of memory after a whole-model compile: compiled whole, a step that accumulates holds a
    second copy of the gradients (3.2 GiB for SD-1.5). A rung whose training state at the start is larger than the
    rung below's now starts past it where the rung below's peak there, with the larger state, exceeds the budget, and
    says so; the regional rung, which holds no second copy, still starts there, not where the compile rung ran (6 x
    8 checkpointed there: the regional rung trained 12 x 4 checkpointed)."""
    from gallery_lib.recipes.ladder import Start, _fitted, rung_chain
    from gallery_lib.recipes.memory_fit import training_state
    from gallery_lib.run.launch import RunResult
    from gallery_lib.run.memory_plan import Budget, Candidate

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setattr("gallery_lib.run.memory_plan.gpu_name", lambda gpu: "NVIDIA Fake 24GB")
    monkeypatch.setenv("GALLERY_CACHE_DIR", str(tmp_path / "cache"))
    base = ladder_base("full", data_root="/data", device="cuda", gpu_memory_gib=22.0, precompile_workers=0)
    chain = rung_chain(base, sizes=SIZES, on_gpu=True)
    ema_ran, peak = Candidate(12, 4, True), 21.54
    ema_state = training_state(chain["ema"].replace(**ema_ran.fields())).gib
    compile_state = training_state(chain["compile"].replace(**ema_ran.fields())).gib
    assert round(compile_state - ema_state, 1) == 3.2  # the compiled backward's second copy of the gradients
    launched = {}

    def fake_launch(cfg, echo=None, console="all"):
        plan = MemoryPlan.from_dict(cfg.extra[PLAN])
        launched[cfg.recipe] = plan
        ran = {"ladder-06-ema": ema_ran, "ladder-09-compile": Candidate(6, 8, True)}.get(cfg.recipe, plan.probe[0])
        return RunResult(cfg, cfg.run_dir, {"samples_per_s": 1.0, "peak_reserved_mb": peak * 1024,
                                            PLAN: {"chosen": ran.__dict__, "changed": True}})

    monkeypatch.setattr("gallery_lib.recipes.ladder.launch", fake_launch)
    monkeypatch.setattr("gallery_lib.recipes.ladder.validate_for_machine", lambda cfg: None)
    run_ladder(base, ["ema", "compile", "regional"], sizes=SIZES, echo=None)
    assert launched["ladder-10-regional"].probe[0] == ema_ran  # past the compile rung's start: it holds less
    compiled = launched["ladder-09-compile"]
    alone = MemoryPlan.from_dict(_fitted(chain["compile"], Budget(22.0, "gpu_memory_gib")).extra[PLAN])
    past = alone.probe.index(ema_ran) + 1
    assert compiled.probe == alone.probe[past:] and compiled.skipped_faster == past and compiled.started_past
    assert compiled.start_needs_gib == pytest.approx(peak - ema_state + compile_state)
    assert (f"{compiled.probe[0].describe()}, past where the run it builds on ran ({peak + 3.2:.1f} GiB there with "
            f"this run's training state), whose {past} faster settings did not fit") in compiled.note()
    # the same start climbed in parts (what the EMA rung held, from its peak in this GPU's footprints)
    held = Start(ema_ran, ran=True, held_gib=peak - ema_state)
    assert MemoryPlan.from_dict(_fitted(chain["compile"], Budget(22.0, "gpu_memory_gib"), held).extra[PLAN]).probe \
        == compiled.probe
    # no larger state, or a larger budget: it starts where the rung below ran
    regional = MemoryPlan.from_dict(_fitted(chain["regional"], Budget(22.0, "gpu_memory_gib"), held).extra[PLAN])
    assert regional.probe[0] == ema_ran and not regional.started_past and regional.start_needs_gib == 0
    roomier = MemoryPlan.from_dict(_fitted(chain["compile"], Budget(25.0, "gpu_memory_gib"), held).extra[PLAN])
    assert roomier.probe[0] == ema_ran and not roomier.started_past


def test_of_the_rungs_below_the_start_furthest_down_the_settings_wins():
    """On an H100 at 22 GiB the bf16 rung had only run out of memory at batch 48 checkpointed (its first try would be
    24 x 2) while the EMA rung below it ran at 12 x 4 checkpointed: the compile rung above both starts at 12 x 4,
    since every rung between frees no memory. A rung that ran at a setting wins over one that would try it next; a
    start at another global batch (fused attention's batch 8) tells nothing about this rung's settings."""
    from types import SimpleNamespace

    from gallery_lib.recipes.ladder import Start, _furthest
    from gallery_lib.run.memory_plan import Candidate

    compile_rung = SimpleNamespace(batch_size=48, gradient_accumulation_steps=1)
    bf16, ema = Start(Candidate(24, 2, False), ran=False), Start(Candidate(12, 4, True), ran=True)
    attention = Start(Candidate(8, 1, True), ran=True)
    assert _furthest([bf16, ema, None, attention], compile_rung) == ema
    assert _furthest([None, bf16, attention], compile_rung) == bf16
    assert _furthest([attention], compile_rung) is None
    assert _furthest([Start(Candidate(12, 4, True), ran=False), ema], compile_rung) == ema
    assert _furthest([Start(Candidate(8, 6, False), ran=False), ema], compile_rung).setting == Candidate(8, 6, False)
