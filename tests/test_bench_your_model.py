"""``gallery bench --timm-model`` and ``--diffusers-model``: a model's eager, peer and accelerated variants through one
loop, the files it writes, its refusal of bad input before anything is built, and where result files go by
default."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from matplotlib.axes import Axes

from gallery_lib.app import bench_your_model
from gallery_lib.app.bench import out_path
from gallery_lib.app.bench_workloads import Workload
from gallery_lib.app.bench_your_model import ModelBench, apply_variant, model_table, resolve_bench
from gallery_lib.app.cli import main
from gallery_lib.config import ConfigError
from gallery_lib.reports.comparison import CPU_TIMINGS

ROW_FIELDS = {"model", "variant", "batch_size", "image_size", "samples_per_s", "median_step_ms", "p20_step_ms",
              "p80_step_ms", "setup_s", "warmup_s", "peak_reserved_gib", "final_loss", "loss_difference", "over_peer",
              "timed_steps", "warmup_steps", "changes", "losses"}
RATIO = re.compile(r"\d\.\d\dx")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as each xdist worker has: on 2 shared cores two threads can wait on each other for a
    second a step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def traced_not_compiled(monkeypatch):
    """``module.compile`` (the peer's call, and ``accelerate``'s for each block) traced by Dynamo and AOTAutograd but
    run without Inductor's C++ code: the same graphs, seconds instead of a minute on 2 cores."""
    compile_module = torch.nn.Module.compile

    def traced(self, *args, mode=None, **kwargs):
        return compile_module(self, *args, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", traced)


@pytest.fixture
def no_speed_bars(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a bar was drawn on a CPU")

    monkeypatch.setattr(Axes, "bar", refuse)


@pytest.mark.slow  # over 20 s on 2 cores: left out of the fast tier
def test_cpu_bench_writes_three_variants_a_table_and_a_figure(traced_not_compiled, no_speed_bars, tmp_path, capsys):
    model = "test_resnet"  # timm's own tiny ResNet: the three variants' tracing in seconds
    out = tmp_path / "timm.json"
    argv = ["bench", "--timm-model", model, "--batch-size", "2", "--image-size", "32", "--steps", "3",
            "--warmup-steps", "1", "--out", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["command"] == "gallery " + " ".join(argv) and record["source_sha256"] and "commit" in record
    assert record["device"] == "CPU" and record["timm_model"] == model and record["torch"] and record["date"]
    assert record["accelerated_over_peer"] is None and record["note"] == f"{CPU_TIMINGS}."
    rows = record["rows"]
    assert [r["variant"] for r in rows] == ["eager", "peer", "accelerated"]
    for r in rows:
        assert ROW_FIELDS <= set(r) and r["model"] == model and (r["batch_size"], r["image_size"]) == (2, 32)
        assert r["samples_per_s"] > 0 and r["p20_step_ms"] <= r["median_step_ms"] <= r["p80_step_ms"]
        assert (r["timed_steps"], r["warmup_steps"]) == (2, 1) and r["warmup_s"] > 0
        assert r["peak_reserved_gib"] is None and r["over_peer"] is None  # no GPU memory, no ratio on a CPU
        assert math.isfinite(r["final_loss"]) and r["loss_difference"] < 1e-2  # the same weights, the same batches
        assert len(r["losses"]) == 3 and r["losses"][-1] == pytest.approx(r["final_loss"], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(rows[0]["losses"], rows[2]["losses"])) == pytest.approx(
        rows[2]["loss_difference"], abs=1e-4)  # the largest step-wise difference is read from them
    assert rows[0]["changes"] == [] and rows[1]["changes"] == ["torch.compile of the whole model"]
    # accelerate's, as it said them, each timed on the first batch
    assert [c.split(":")[0] for c in rows[2]["changes"]] == ["compiled blocks", "compiled whole"]
    assert all(" ms with it, " in c and "(this model, batch 2, cpu)" in c for c in rows[2]["changes"])
    assert rows[2]["setup_s"] > rows[1]["setup_s"] >= 0
    table = out.with_suffix(".md").read_text()
    assert table == model_table(record) + "\n" and "| accelerated |" in table and "n/a on CPU" in table
    assert CPU_TIMINGS in table and not RATIO.search(table)
    assert out.with_suffix(".png").stat().st_size > 10_000  # step times step by step, and the losses
    printed = capsys.readouterr().out
    assert table.strip() in printed and f"wrote {out}" in printed


def test_a_variant_that_fails_is_a_row_with_its_error_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    def peer_out_of_memory(variant, model, device, batch, workload, progress=None):
        if variant == "peer":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return []

    monkeypatch.setattr(bench_your_model, "apply_variant", peer_out_of_memory)
    out = tmp_path / "timm.json"
    assert main(["bench", "--timm-model", "test_vit", "--batch-size", "2", "--steps", "2", "--warmup-steps", "1",
                 "--out", str(out)]) == 1  # as `gallery run` ends when a recipe failed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r.get("error")) for r in rows] == [
        ("eager", None), ("peer", "out of memory"), ("accelerated", None)]
    assert "| peer | error: out of memory |" in out.with_suffix(".md").read_text()
    assert capsys.readouterr().err == "gallery: peer: out of memory\n"


def test_a_vit_is_built_at_the_bench_size_and_trains_through_its_loop():
    """The notebook's CPU model at 32 px (its position embeddings sized by it): 2x2 patches of 16 px."""
    bench = resolve_bench("vit_tiny_patch16_224", batch_size=2, image_size=32, steps=3, warmup_steps=1)
    model = bench_your_model.build_model(bench)
    assert model.patch_embed.grid_size == (2, 2)
    batches = bench_your_model.make_batches(bench, model)
    losses, times_ms, profile = bench_your_model.train(model, bench.workload, batches, bench.steps, bench.device)
    assert len(losses) == len(times_ms) == 3 and all(math.isfinite(loss) for loss in losses) and profile is None


def test_profiled_steps_come_after_the_timed_ones_and_give_each_variant_its_kernel_table(tmp_path, monkeypatch):
    """``--profile-steps 2``: two more steps under torch.profiler after the timed ones, out of their timing; each
    variant's row holds the table of where those steps' time went (on a CPU, its ops)."""
    monkeypatch.setattr(bench_your_model, "apply_variant", lambda *args, **kwargs: [])  # the loop alone, three times
    out = tmp_path / "timm.json"
    assert main(["bench", "--timm-model", "test_vit", "--batch-size", "2", "--steps", "3", "--warmup-steps", "1",
                 "--profile-steps", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["note"] == f"{CPU_TIMINGS}."  # on a GPU: that the variants after a profiled one may time slower
    gpu_record = {**record, "device": "NVIDIA H200", "note": f"{bench_your_model.PROFILED_TIMINGS}."}
    assert model_table(gpu_record).endswith("take speeds and ratios from a run without --profile-steps.")
    rows = record["rows"]
    for row in rows:
        profile = row["profile"]
        assert (profile["profiled_steps"], profile["device"]) == (2, "cpu") and row["timed_steps"] == 2
        assert profile["kernel_ms_per_step"] > 0 and "matmul" in profile["by_kind_ms"]
        assert sum(profile["by_kind_ms"].values()) == pytest.approx(profile["kernel_ms_per_step"])
    bench = resolve_bench("test_vit", batch_size=2, image_size=32, steps=3, warmup_steps=1, profile_steps=2)
    model = bench_your_model.build_model(bench)
    batches = bench_your_model.make_batches(bench, model)
    losses, times_ms, profile = bench_your_model.train(model, bench.workload, batches, 3, "cpu", profile_steps=2)
    assert len(losses) == len(times_ms) == 3 and profile["profiled_steps"] == 2  # the profiled steps: untimed


@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for bad input")

    monkeypatch.setattr("timm.create_model", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--timm-model", "resnet181"], "--timm-model 'resnet181' is no timm model; did you mean resnet18 or "),
    (["--timm-model", "resnet_typo"], "did you mean resnet"),  # a resnet, not tresnet_m
    (["--timm-model", "vit_tiny_patch16"], "is no timm model; did you mean vit_tiny_patch16_"),
    (["--timm-model", "resnet18", "--models", "sd"], "nor another model: leave out --models"),
    (["--timm-model", "resnet18", "--recipes", "peer", "--set", "lr=1"], "leave out --recipes, --set;"),
    (["--timm-model", "resnet18", "--batch-size", "4,8"], "--batch-size '4,8' with --timm-model or --diffusers-model"),
    (["--timm-model", "resnet18", "--steps", "3", "--warmup-steps", "3"], "there must be more of them than"),
    (["--timm-model", "resnet18", "--image-size", "0"], "--image-size 0 is invalid"),
    (["--models", "swin", "--image-size", "64"], "--image-size is for --timm-model or --diffusers-model"),
    (["--models", "swin", "--model-config", "num_layers=2"], "--model-config is for --timm-model or --diffusers"),
    (["--models", "swin", "--profile-steps", "5"], "a family's runs profile with --set profile_steps=5"),
    (["--timm-model", "resnet18", "--profile-steps", "-1"], "--profile-steps -1 is invalid"),
    (["--diffusers-model", "UNet2DConditionModel"], "the bench builds UNet2DModel, DiTTransformer2DModel"),
    (["--diffusers-model", "DiTTransformer2D"], "did you mean DiTTransformer2DModel?"),
    (["--diffusers-model", "UNet2DModel", "--model-config", "num_layer=2"], "UNet2DModel has no such config value"),
    (["--diffusers-model", "UNet2DModel", "--model-config", "layers"], "expected KEY=VALUE"),
    (["--diffusers-model", "UNet2DModel", "--model-config", "sample_size=16"], "the sample size is --image-size"),
    (["--timm-model", "resnet18", "--model-config", "depth=2"], "--model-config is for --diffusers-model"),
    (["--timm-model", "resnet18", "--diffusers-model", "UNet2DModel"], "leave out --diffusers-model"),
])
def test_bad_input_is_refused_in_one_line_before_anything_is_built(argv, message, nothing_built, capsys, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr("diffusers.UNet2DModel.__init__", lambda *args, **kwargs: pytest.fail("a model was built"))
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert main(["bench", *argv]) == 2  # as `gallery run` answers a ConfigError
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert err.startswith("gallery: error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_timm_bench_result_goes_under_output_by_default_named_after_the_model(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert out_path(None, "NVIDIA H200", name="timm-resnet18").parent == Path("output/bench")
    assert out_path(None, None, name="timm-resnet18").name.startswith("timm-resnet18-cpu-")
    assert out_path("benchmarks/results/mine.json", None) == Path("benchmarks/results/mine.json")


def test_on_a_gpu_the_peer_adds_cuda_graphs_and_channels_last_for_a_convnet():
    """Decided without a GPU: the calls only mark the model (compilation happens at its first step)."""
    from gallery_lib.models import create_timm_model

    resnet = create_timm_model("resnet18", num_classes=10)
    said = apply_variant("peer", resnet, "cuda")
    assert said == ["channels_last: 20 conv weights in NHWC layout",
                    'torch.compile of the whole model, mode="reduce-overhead" (CUDA graphs)']
    assert resnet.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    vit = create_timm_model("vit_tiny_patch16_224", image_size=32, num_classes=10)
    assert apply_variant("peer", vit, "cuda") == ['torch.compile of the whole model, mode="reduce-overhead" '
                                                  '(CUDA graphs)']  # its one conv is the patch embedding
    assert apply_variant("eager", resnet, "cuda") == []


def test_gpu_sizes_are_the_notebooks_full_profile_with_at_least_30_timed_steps():
    resnet = Workload("timm", "resnet18")
    assert resolve_bench("resnet18", device="cuda") == ModelBench(resnet, "cuda", 128, 224, 60, 25)
    assert resolve_bench("resnet18", device="cpu") == ModelBench(resnet, "cpu", 4, 32, 6, 3)
    dit = Workload("diffusers", "DiTTransformer2DModel")
    assert resolve_bench(dit, device="cuda") == ModelBench(dit, "cuda", 64, 32, 60, 25)  # DiT's 256 px latents
    # on a CPU, DiT-XL/2's 675M parameters give way to its layout at a CPU's size, unless a config is given
    on_cpu = resolve_bench(dit, device="cpu")
    assert (on_cpu.batch_size, on_cpu.image_size) == (2, 8) and on_cpu.workload.config["num_layers"] == 2
    given = Workload("diffusers", "DiTTransformer2DModel", {"num_layers": 3})
    assert resolve_bench(given, device="cpu").workload == given
    with pytest.raises(ConfigError, match="times 20 steps: too few on a GPU"):
        resolve_bench("resnet18", steps=45, warmup_steps=25, device="cuda")
    # fewer steps given than the default, and no warm-up: a third of them warm up, as in a run's profile
    assert resolve_bench("resnet18", steps=45, device="cuda").warmup_steps == 15
    assert resolve_bench("resnet18", steps=3, device="cpu").warmup_steps == 1
    assert resolve_bench("resnet18", steps=90, device="cuda").warmup_steps == 25


def test_a_gpu_table_gives_each_variant_over_the_peer():
    rows = [dict(variant=v, samples_per_s=s, median_step_ms=1e3 * 128 / s, p20_step_ms=1.0, p80_step_ms=2.0,
                 setup_s=84.0 if v == "accelerated" else 0.0, warmup_s=30.0, peak_reserved_gib=9.5, final_loss=6.9,
                 over_peer=s / 2000.0)
            for v, s in [("eager", 1000.0), ("peer", 2000.0), ("accelerated", 2500.0)]]
    record = dict(timm_model="resnet18", image_size=224, batch_size=128, steps=60, warmup_steps=25,
                  device="NVIDIA H200", rows=rows)
    table = model_table(record)
    assert "| accelerated | 2,500.0 | 51.2 (1.0-2.0) | 1.25x | 84.0 | 30.0 | 9.50 | 6.9000 |" in table
    assert "| peer | 2,000.0 |" in table and "0.50x" in table and CPU_TIMINGS not in table
    assert "n/a on CPU" in model_table({**record, "device": "CPU"})


# A DiT of two blocks (DiT-XL/2's layout at a size a CPU trains in seconds): class-conditional, patches of 2
TINY_DIT = ["num_layers=2", "num_attention_heads=2", "attention_head_dim=8", "norm_num_groups=4"]


@pytest.mark.slow  # over 20 s on 2 cores: left out of the fast tier
def test_cpu_bench_of_a_diffusers_denoiser_trains_its_three_variants_on_the_noise(traced_not_compiled, no_speed_bars,
                                                                                 tmp_path):
    out = tmp_path / "dit.json"
    argv = ["bench", "--diffusers-model", "DiTTransformer2DModel", *[f"--model-config={kv}" for kv in TINY_DIT],
            "--batch-size", "2", "--steps", "3", "--warmup-steps", "1", "--out", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["diffusers_model"] == "DiTTransformer2DModel" and "timm_model" not in record
    assert record["model_config"] == {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8,
                                      "norm_num_groups": 4}
    assert (record["image_size"], record["batch_size"]) == (8, 2)  # the CPU's default sample size
    rows = record["rows"]
    assert [r["variant"] for r in rows] == ["eager", "peer", "accelerated"]
    for r in rows:
        assert r["model"] == "diffusers.DiTTransformer2DModel" and r["over_peer"] is None
        # the noise's MSE, the same function step by step: one seed for the label dropout DiT trains with
        assert 0.1 < r["final_loss"] < 10 and r["loss_difference"] < 1e-5
    # accelerate timed the DiT's repeated blocks compiled, then the whole model compiled, on the first batch
    assert [c.split(":")[0] for c in rows[2]["changes"]] == ["compiled blocks", "compiled whole"]
    assert all(" ms with it, " in c and "(this model, batch 2, cpu" in c for c in rows[2]["changes"])
    assert out.with_suffix(".md").read_text().startswith("`diffusers.DiTTransformer2DModel` at 8 px, batch 2, on CPU")


def test_a_unet2dmodel_gets_no_classes_and_a_dit_gets_one_per_sample():
    """The batches follow the model's forward: a UNet2DModel's ``sample`` and ``timestep`` (no class embedding in its
    default config), a DiT's ``hidden_states``, ``timestep`` and ``class_labels`` (its adaptive norm embeds 1000)."""
    from gallery_lib.app.bench_workloads import parse_model_config

    bench = resolve_bench(Workload("diffusers", "UNet2DModel"), batch_size=3, device="cpu")  # its CPU layout
    unet = bench.workload
    model = bench_your_model.build_model(bench)
    batch, = unet.batches(model, 1, 3, 8, "cpu")
    assert sorted(batch.inputs) == ["sample", "timestep"] and batch.inputs["sample"].shape == (3, 3, 8, 8)
    assert batch.target.shape == batch.inputs["sample"].shape  # the noise it predicts
    dit = Workload("diffusers", "DiTTransformer2DModel", parse_model_config(TINY_DIT))
    dit_model = dit.build(8)
    dit_batch, = dit.batches(dit_model, 1, 3, 8, "cpu")
    assert sorted(dit_batch.inputs) == ["class_labels", "hidden_states", "timestep"]
    assert int(dit_batch.inputs["class_labels"].max()) < 1000
    losses, _, _ = bench_your_model.train(model, unet, [batch], 2, "cpu")
    assert all(math.isfinite(loss) for loss in losses)
