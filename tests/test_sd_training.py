"""Stable Diffusion training on the tiny config: recipes learn the same function, EMA, export, resume."""

from __future__ import annotations

import pytest
import torch

from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.run.metrics import read_metrics
from gallery_lib.recipes.profiles import base_config
from gallery_lib.recipes import apply_recipe, recipe_config
from gallery_lib.run.batch_size import trial_config
from gallery_lib.run.train import run
from resume_testing import resume_from_copy

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def caption_data(tmp_path_factory):
    from data_prep.captions import make_caption_folder

    return make_caption_folder(tmp_path_factory.mktemp("captions"), num_images=24, image_size=32, seed=0,
                               progress=False)


# The fp32 step-by-step tests of SD and DreamBooth compile the same UNet block graphs: in one worker, one after the
# other, the second loads what the first compiled, and the precompile tests' cold graph cache gets its C++ kernels.
SD_UNET_FP32 = "sd_unet_fp32"


def tiny(data, tmp_path, **kw) -> RunConfig:
    values = dict(data_dir=str(data), output_dir=str(tmp_path / "out"), device="cpu", num_workers=0, steps=6,
                  warmup_steps=2, log_every=3, export_model=False, max_nonfinite_steps=0)
    values.update(kw)
    return base_config("smoke", family="stable_diffusion", **values)


def losses_of(cfg: RunConfig) -> list[float]:
    return [s["loss"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]]


@pytest.mark.parametrize("reuse_batch", [False, True])
def test_a_run_stops_its_loader_workers_as_it_ends(caption_data, tmp_path, reuse_batch):
    """Left to interpreter exit, persistent workers with pinned memory take 5 s each to stop (70 s a run on a GPU
    with 14 workers): the run stops them itself, also when it trained on one reused batch. (The SD task's loader
    outlives the run function's frame, so nothing else would stop them sooner.)"""
    import multiprocessing

    before = set(multiprocessing.active_children())
    run(tiny(caption_data, tmp_path, num_workers=2, steps=3, warmup_steps=1, reuse_batch=reuse_batch))
    assert set(multiprocessing.active_children()) - before == set()


def test_recipes_resolve_the_sd_switches(caption_data, tmp_path, monkeypatch):
    base = tiny(caption_data, tmp_path)
    baseline, compiled, accelerated = (apply_recipe(r, base) for r in ("baseline", "compiled", "accelerated"))
    assert (baseline.ema, baseline.cache_latents, baseline.compile) == ("loop", False, False)
    assert (compiled.ema, compiled.cache_latents, compiled.compile) == ("foreach", False, True)
    assert accelerated.cache_latents and accelerated.compile and accelerated.ema == "fused"
    assert accelerated.kernels and accelerated.kernel_op_names == ("geglu",)
    # Blocks compiled in place; on a GPU they replay as CUDA graphs, precompiled by half the cores (at most 8).
    assert (accelerated.compile_scope, accelerated.compile_mode, accelerated.precompile_workers) == (
        "blocks", "default", 0)
    for cores, workers in ((16, 8), (64, 8), (6, 3), (2, 0)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        gpu = apply_recipe("accelerated", base.replace(device="cuda"))
        assert (gpu.resolved_compile_mode, gpu.precompile_workers) == ("reduce-overhead", workers), cores
        # stated as intent in the config, resolved for the step as it is read; no note in extra decides it
        assert (gpu.compile_mode, gpu.kernel_ops) == ("auto", "auto") and gpu.extra == base.extra
        assert gpu.channels_last  # +1.1 to +1.6% on an H100 (benchmarks/RESULTS.md#bench-h100)
        assert gpu.compile_whole_types == ("CrossAttnUpBlock2D", "UpBlock2D") and not accelerated.compile_whole
    # From 64 images of 512 px a step, the GPU sets the step time: the blocks run without CUDA graphs.
    at_512 = base.replace(device="cuda", image_size=512)
    for batch in (16, 32, 48):
        small = apply_recipe("accelerated", at_512.replace(batch_size=batch))
        assert small.resolved_compile_mode == "reduce-overhead" and small.cuda_graphs, batch
    for batch in (64, 96):
        large = apply_recipe("accelerated", at_512.replace(batch_size=batch))
        assert (large.resolved_compile_mode, large.compile_scope, large.precompile_workers) == ("default", "blocks", 0)
    smaller_images = apply_recipe("accelerated", at_512.replace(batch_size=96, image_size=256))
    assert smaller_images.resolved_compile_mode == "reduce-overhead"
    # From 32 images of 512 px a step, the GroupNorm+SiLU kernel too; on a CPU never (measured on GPUs only).
    for batch, ops in ((1, ("geglu",)), (16, ("geglu",)), (31, ("geglu",)), (32, ("geglu", "group_norm_silu")),
                       (96, ("geglu", "group_norm_silu"))):
        assert apply_recipe("accelerated", at_512.replace(batch_size=batch)).kernel_op_names == ops, batch
    assert apply_recipe("accelerated", at_512.replace(batch_size=32, device="cpu")).kernel_op_names == ("geglu",)
    assert trial_config(apply_recipe("accelerated", at_512.replace(batch_size=8)), 64).kernel_op_names == (
        "geglu", "group_norm_silu")
    assert trial_config(apply_recipe("accelerated", at_512.replace(batch_size=64)), 8).kernel_op_names == ("geglu",)
    # kernels named by the user stay at every batch size, and the CUDA graphs the recipe chose resolve at each
    named_ops = recipe_config(at_512.replace(batch_size=64), "accelerated", {"kernel_ops": "geglu"})
    assert trial_config(named_ops, 64).kernel_op_names == ("geglu",)
    assert trial_config(named_ops, 8).resolved_compile_mode == "reduce-overhead"
    # Overrides: a batch size is read before the recipe resolves; CUDA graphs asked for by name stay.
    assert recipe_config(at_512, "accelerated", {"batch_size": 64}).resolved_compile_mode == "default"
    assert recipe_config(at_512.replace(batch_size=64), "accelerated",
                         {"compile_mode": "reduce-overhead"}).resolved_compile_mode == "reduce-overhead"
    # The batch-size search's trials resolve the recipe's intent at each size they try, unless the mode was named or
    # checkpointing rules out the graphs.
    searched = apply_recipe("accelerated", at_512.replace(batch_size=96))
    assert [trial_config(searched, b).resolved_compile_mode for b in (96, 64, 62, 32)] == [
        "default", "default", "reduce-overhead", "reduce-overhead"]
    assert trial_config(searched, 32).resolved_compile_mode == "reduce-overhead"
    named = recipe_config(at_512.replace(batch_size=96), "accelerated", {"compile_mode": "default"})
    assert trial_config(named, 32).resolved_compile_mode == "default"
    recomputed = apply_recipe("accelerated", at_512.replace(batch_size=96, gradient_checkpointing=True))
    assert trial_config(recomputed, 32).resolved_compile_mode == "default"
    # checkpointed, compiled whole as the peer is, not as blocks wrapped in eager recomputation
    assert (recomputed.compile_scope, recomputed.precompile_workers, recomputed.compile_whole) == ("model", 0, "")
    assert not accelerated.channels_last  # measured on GPUs only
    assert apply_recipe("peer", base.replace(device="cuda")).channels_last  # as a skilled user writes it
    no_ema = apply_recipe("accelerated", base.replace(ema="off"))
    assert no_ema.ema == "off"  # the profile decides whether there is an EMA; the recipe only how it runs
    with pytest.raises(ConfigError, match="cache_latents=True applies to text-to-image and dreambooth models"):
        base_config("smoke", cache_latents=True)


# Not in the AVX2 pass, where each compiled the tiny UNet's graphs again (5 min of CI's 2 cores): there
# test_cpu_codegen.py compiles its kinds of block, transformer, resnet and upsample, against eager (RESULTS.md#ci).
@pytest.mark.slow
@pytest.mark.parametrize("amp_level, rtol", [
    pytest.param("O0", 1e-4, id="O0-0.0001", marks=pytest.mark.xdist_group(SD_UNET_FP32)),
    pytest.param("O1", 3e-2, id="O1-0.03")])
def test_accelerated_recipe_matches_baseline_step_by_step(caption_data, tmp_path, amp_level, rtol, monkeypatch):
    """30 steps of the baseline (online VAE/text encoder, eager, loop EMA) and the accelerated recipe (cached
    latents, torch.compile, fused/foreach EMA) from the same seed and data: the per-step losses agree to ``rtol``.
    fp32: 1e-4 relative (compiled kernels reorder sums), with Inductor's code (the fp32 group's graphs); bf16
    autocast: 3e-2 (bf16 keeps 8 bits of mantissa), compiled without Inductor's code, which would cost minutes of CI
    for graphs whose kinds of block test_cpu_codegen.py holds to eager in bf16."""
    from compile_testing import compile_without_codegen

    base = tiny(caption_data, tmp_path, steps=30, warmup_steps=2, log_every=10, amp_level=amp_level)
    runs = [apply_recipe(name, base).replace(amp_level=amp_level, amp_dtype="bfloat16" if amp_level != "O0"
                                             else "auto") for name in ("baseline", "accelerated")]
    if amp_level != "O0":
        compile_without_codegen(monkeypatch)
    curves = []
    for cfg in runs:
        run(cfg)
        curves.append(losses_of(cfg))
    baseline, accelerated = (torch.tensor(c) for c in curves)
    assert len(baseline) == len(accelerated) == 30
    torch.testing.assert_close(accelerated, baseline, rtol=rtol, atol=rtol * 0.1)
    # and it is not trivially equal because nothing trains: the loss moves over the run
    assert (baseline[:5].mean() - baseline[-5:].mean()).abs() > 10 * rtol * baseline[:5].mean()


def test_cached_and_online_latents_draw_the_same_steps(caption_data, tmp_path):
    """cache_latents alone (eager, fp32): the same losses as encoding every step, to float rounding."""
    online = tiny(caption_data, tmp_path / "a", amp_level="O0", ema="off")
    cached = online.replace(cache_latents=True, output_dir=str(tmp_path / "b"))
    summary = run(cached)
    run(online)
    torch.testing.assert_close(torch.tensor(losses_of(cached)), torch.tensor(losses_of(online)), rtol=1e-5,
                               atol=1e-6)
    assert summary["cache_time_s"] > 0
    # diffusers calls F.scaled_dot_product_attention: the run says what PyTorch ran for self- and cross-attention
    from gallery_lib.accel.attention import BACKENDS

    assert summary["attention"], "no attention record"
    assert summary["attention_probe_time_s"] > 0
    for key, choice in summary["attention"].items():
        name, _, how = choice.partition(" ")
        assert name in BACKENDS and how == "(PyTorch's own SDPA choice)" and key.endswith("|CPU|bias=False"), key
    assert any(key.split("|")[0] != key.split("|")[1] for key in summary["attention"])  # cross-attention: text tokens


def test_channels_last_draws_the_same_steps_and_exports_a_contiguous_pipeline(caption_data, tmp_path):
    """channels_last alone (eager, fp32, EMA on): the same losses as the default layout, to float rounding, and the
    exported UNet is back in the layout safetensors stores."""
    plain = tiny(caption_data, tmp_path / "a", amp_level="O0", cache_latents=True)
    nhwc = plain.replace(channels_last=True, output_dir=str(tmp_path / "b"), export_model=True)
    summary = run(nhwc)
    run(plain)
    torch.testing.assert_close(torch.tensor(losses_of(nhwc)), torch.tensor(losses_of(plain)), rtol=1e-5, atol=1e-6)
    assert any("channels_last" in note for note in summary["notes"])
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(summary["exported_to"], subfolder="unet")
    assert all(p.is_contiguous() for p in unet.parameters())


def test_export_gives_a_diffusers_pipeline_with_the_ema_unet(caption_data, tmp_path, capfd):
    from diffusers import StableDiffusionPipeline

    from gallery_lib.run.checkpoint import latest_checkpoint, read_checkpoint

    cfg = tiny(caption_data, tmp_path, steps=4, warmup_steps=1, log_every=2, checkpoint_every=4, ema="foreach",
               export_model=True, amp_level="O0")
    summary = run(cfg)
    printed = "".join(capfd.readouterr())  # the run's log says nothing the libraries add without meaning
    assert "should be kept in float32" not in printed and "Writing model shards" not in printed
    pipe = StableDiffusionPipeline.from_pretrained(summary["exported_to"])
    state = read_checkpoint(latest_checkpoint(cfg.run_dir / "checkpoints"))
    ema_weights, trained = state["ema"]["module"], state["model"]
    assert state["ema"]["step"] == 4
    exported = pipe.unet.state_dict()
    name = "conv_in.weight"
    torch.testing.assert_close(exported[name], ema_weights[name].float())
    assert not torch.equal(exported[name], trained[name])  # the EMA, not the last weights
    images = pipe(["a red circle on a blue background"], num_inference_steps=2, height=32, width=32,
                  output_type="np").images
    assert images.shape == (1, 32, 32, 3)


def test_resume_continues_the_ema_exactly(caption_data, tmp_path):
    """A run stopped after its step-3 checkpoint and resumed ends in the uninterrupted run's state, EMA included."""
    from gallery_lib.run.checkpoint import read_checkpoint

    whole = tiny(caption_data, tmp_path / "whole", steps=6, amp_level="O0", ema="foreach", checkpoint_every=3,
                 deterministic=True)
    run(whole)
    resumed = resume_from_copy(whole, 3, tmp_path / "resumed")
    lines = (whole.run_dir / "metrics.jsonl").read_text().splitlines()[:3]
    (resumed.run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run(resumed)
    a = read_checkpoint(whole.run_dir / "checkpoints" / "step_6.pt")
    b = read_checkpoint(resumed.run_dir / "checkpoints" / "step_6.pt")
    assert a["ema"]["step"] == b["ema"]["step"] == 6
    for key, value in a["ema"]["module"].items():
        assert torch.equal(b["ema"]["module"][key], value), key
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key
    assert losses_of(whole) == losses_of(resumed)


@pytest.fixture(scope="module")
def precompiled(caption_data, tmp_path_factory, _session_compile_cache):
    """The accelerated recipe in fp32 with its blocks precompiled by 2 worker processes, run once in a compile cache
    of its own without graphs (kept for the second run of the test below), and the baseline it must train like. The
    workers trace and compile every block graph; of their C++ kernels, those the session's runs built already (the
    group's fp32 tests ran these blocks) are linked in: the C++ compiler runs once per kernel in the test run."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from compile_testing import compile_cache_at, copy_kernel_builds

    tmp = tmp_path_factory.mktemp("precompiled")
    base = tiny(caption_data, tmp, steps=8, amp_level="O0")
    accelerated = apply_recipe("accelerated", base).replace(amp_level="O0", precompile_workers=2)
    assert accelerated.precompile_overlap  # the default
    assert accelerated.compile_scope == "blocks"
    run(baseline := apply_recipe("baseline", base).replace(amp_level="O0"))
    # A run is a fresh process; in this one an earlier test may have compiled the same blocks, and Dynamo would reuse
    # that code without looking at any cache. Forget it, so the run must trace and go to the on-disk caches. Those are
    # fresh too: an earlier test's workers (where os.cpu_count() gives the recipe some) would leave a warm-start marker.
    torch._dynamo.reset()
    counters.clear()
    copy_kernel_builds(_session_compile_cache, tmp / "inductor")
    with compile_cache_at(tmp / "inductor") as cache:
        summary = run(accelerated)
    return SimpleNamespace(accelerated=accelerated, baseline=baseline, summary=summary, cache=cache)


@pytest.mark.slow
@pytest.mark.xdist_group(SD_UNET_FP32)  # after the group's fp32 runs, whose kernels the fixture links in
def test_precompiled_blocks_train_like_the_baseline_and_only_load_in_the_run(precompiled):
    """The accelerated recipe with its blocks precompiled by 2 worker processes: the training process finds every
    block graph in Inductor's cache (no graph compiled by the run itself), loads each while the workers compile the
    others (its training steps then trace nothing), and the losses are the baseline's."""
    summary = precompiled.summary
    assert summary["precompile_time_s"] > 0
    assert any("precompiled by 2 processes" in note for note in summary["notes"])
    cache = summary["compile_cache"]  # what the run logs: every graph loaded, none compiled here
    assert cache["aot_autograd_hits"] + cache["fx_graph_hits"] > 0, cache
    assert cache["aot_autograd_misses"] == cache["fx_graph_misses"] == 0, cache
    loaded = summary["precompile"]["load_seconds"]
    assert sorted(loaded) and not summary["precompile"]["load_failures"]
    assert cache["graphs_traced"] == len(loaded) == summary["precompile"]["graphs"]
    assert summary["attention"] and summary["attention_probe_time_s"] > 0  # probed while the workers compiled
    assert len(summary["warmup_step_times_ms"]) == summary["warmup_steps"]
    torch.testing.assert_close(torch.tensor(losses_of(precompiled.accelerated)),
                               torch.tensor(losses_of(precompiled.baseline)), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group(SD_UNET_FP32)
def test_a_second_run_starts_no_workers_and_trains_like_the_first(precompiled, tmp_path):
    """The accelerated recipe twice with one compile cache: the first run's 2 workers precompile the blocks, the
    second finds the marker they left, starts none, loads every graph in its first step (no cache miss) and gives
    the first run's losses step by step."""
    from compile_testing import compile_cache_at

    first = precompiled.accelerated
    second = first.replace(output_dir=str(tmp_path / "second"))
    torch._dynamo.reset()
    with compile_cache_at(precompiled.cache):
        summary = run(second)
    assert precompiled.summary["precompile"]["graphs"] > 0 and "precompile_skipped" not in precompiled.summary
    assert "precompile" not in summary and summary["precompile_skipped"]
    cache = summary["compile_cache"]
    assert cache["aot_autograd_misses"] == cache["fx_graph_misses"] == 0 and cache["aot_autograd_hits"] > 0, cache
    torch.testing.assert_close(torch.tensor(losses_of(second)), torch.tensor(losses_of(first)), rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_cuda_graph_blocks_loaded_as_they_land_train_like_blocks_the_run_compiled(caption_data, tmp_path):
    """The accelerated recipe on a GPU (blocks replayed as CUDA graphs), fp32 and deterministic algorithms: blocks
    precompiled by 2 workers and loaded by this process before the first step (run once on throwaway copies) against
    the same blocks compiled by the run itself in its first steps. The losses agree step by step: loading through a
    copy leaves the run's own CUDA graphs reading its own weights."""
    from torch._inductor.utils import fresh_cache

    base = tiny(caption_data, tmp_path, steps=8, amp_level="O0", device="cuda", deterministic=True)
    loaded = apply_recipe("accelerated", base).replace(precompile_workers=2)
    assert loaded.resolved_compile_mode == "reduce-overhead" and loaded.precompile_overlap
    compiled_here = loaded.replace(recipe="accelerated+precompile_workers=0", precompile_workers=0)
    summaries = []
    for cfg in (loaded, compiled_here):
        torch._dynamo.reset()
        with fresh_cache():
            summaries.append(run(cfg))
    assert sorted(summaries[0]["precompile"]["load_seconds"]) and not summaries[0]["precompile"]["load_failures"]
    assert summaries[0]["compile_cache"]["fx_graph_misses"] == 0  # the run compiled nothing itself
    assert summaries[1]["compile_cache"]["fx_graph_misses"] > 0
    torch.testing.assert_close(torch.tensor(losses_of(loaded)), torch.tensor(losses_of(compiled_here)),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_a_checkpointed_compiled_run_loads_its_graphs_from_the_caches_the_run_before_left(caption_data, tmp_path):
    """A checkpointed UNet compiled on a GPU, twice with one compile cache: the second run loads every graph (the
    attention in a recomputed block makes AOTAutograd save its RNG state, in the form no cache stores unless the run
    asks for the other), and trains as the first did."""
    from compile_testing import compile_cache_at

    first = apply_recipe("compiled", tiny(caption_data, tmp_path, steps=4, warmup_steps=1, device="cuda",
                                          gradient_checkpointing=True))
    assert first.compile and not first.cuda_graphs
    second = first.replace(output_dir=str(tmp_path / "second"))
    summaries = []
    with compile_cache_at(tmp_path / "inductor"):
        for cfg in (first, second):
            torch._dynamo.reset()
            summaries.append(run(cfg))
    assert any(note.startswith("compile caches: checkpointed graphs") for note in summaries[0]["notes"])
    assert "compile_cache_bypassed" not in summaries[0], summaries[0]["compile_cache_bypassed"]
    cache = summaries[1]["compile_cache"]
    assert cache["aot_autograd_hits"] > 0 and cache["aot_autograd_misses"] == cache["fx_graph_misses"] == 0, cache
    torch.testing.assert_close(torch.tensor(losses_of(second)), torch.tensor(losses_of(first)), rtol=1e-3, atol=1e-4)
