"""The memory switches train the same function as the plain run. Gradient checkpointing: the same losses (it
recomputes, it does not change the function), switched on through each library's own method, refused with a clear
error for a model without one. Gradient accumulation: k batches of b, the same losses as one batch of k*b."""

from __future__ import annotations

import pytest
import torch

from gallery_lib.accel.accelerate import enable_gradient_checkpointing
from gallery_lib.config import ConfigError
from gallery_lib.recipes.profiles import base_config
from gallery_lib.recipes import apply_recipe
from gallery_lib.run.metrics import read_metrics
from gallery_lib.run.train import run
from gallery_lib.app.workflow import prepare


@pytest.mark.parametrize("family, extra", [
    ("stable_diffusion", {}),
    ("swin_transformer", {}),
    ("resnet50", {}),
    ("dreambooth", {"train_text_encoder": True}),
])
def test_checkpointing_trains_the_same_losses(family, extra, tmp_path):
    pytest.importorskip("diffusers")
    base = base_config("smoke", family=family, data_root=str(tmp_path / "data"), output_dir=str(tmp_path / "out"),
                       device="cpu", num_workers=0, steps=5, warmup_steps=1, log_every=5, export_model=False,
                       amp_level="O0", **extra)
    prepare(base, progress=False)
    plain = apply_recipe("baseline", base).replace(amp_level="O0")
    checkpointed = plain.replace(recipe="baseline+gradient_checkpointing", gradient_checkpointing=True)
    losses = []
    for cfg in (plain, checkpointed):
        summary = run(cfg)
        losses.append(torch.tensor([s["loss"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    notes = " ".join(summary["notes"])
    assert "gradient checkpointing:" in notes
    if extra.get("train_text_encoder"):  # the UNet and the text encoder trained together: both checkpoint
        assert "unet (enable_gradient_checkpointing)" in notes and "text_encoder (" in notes


def test_a_model_without_checkpointing_is_refused():
    with pytest.raises(ConfigError, match="Sequential has no gradient checkpointing of its own"):
        enable_gradient_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("recipe", ["baseline", pytest.param("compiled", marks=pytest.mark.slow)])  # compiled: 30 s
def test_accumulated_batches_train_like_one_large_batch(recipe, tmp_path, monkeypatch):
    """swin_micro without Mixup and drop-path (nothing random per batch): 2 x 4 accumulated against 8 at once. The
    compiled recipe's model is captured by Dynamo and differentiated by AOTAutograd without Inductor's kernels: the
    gradients add up outside the graph, which is what accumulation puts to the test."""
    from compile_testing import compile_without_codegen

    compile_without_codegen(monkeypatch)
    base = base_config("smoke", family="swin_transformer", data_root=str(tmp_path / "data"),
                       output_dir=str(tmp_path / "out"), device="cpu", num_workers=0, steps=6, warmup_steps=1,
                       log_every=3, amp_level="O0", mixup_alpha=0.0, cutmix_alpha=0.0, batch_size=8)
    prepare(base, progress=False)
    large = apply_recipe(recipe, base).replace(amp_level="O0")
    accumulated = large.replace(recipe=f"{recipe}+accumulated", batch_size=4, gradient_accumulation_steps=2)
    assert accumulated.global_batch_size == large.global_batch_size == 8
    assert accumulated.peak_lr == large.peak_lr  # the schedule follows the samples per optimizer step
    # Compiled: the batch of 8 runs eager, with the recipe's fused optimizer and EMA. The micro-batches add up in the
    # loop, outside the compiled model, so the compiled batches of 4 are held to the same losses as one eager batch
    # of 8, and only one graph compiles instead of two.
    large = large.replace(recipe=f"{recipe}+eager", compile=False) if large.compile else large
    losses = []
    for cfg in (large, accumulated):
        # Each run as a fresh process compiles it: without the reset, Dynamo would see a batch of 4 as a changed
        # size of code an earlier test compiled at 8 and compile a graph with a symbolic batch, which no
        # `gallery train` at batch 4 runs (and which compiles slower).
        torch._dynamo.reset()
        summary = run(cfg)
        losses.append(torch.tensor([s["loss"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]]))
        assert summary["global_batch_size"] == 8
    assert ("torch.compile" in " ".join(summary["notes"])) == (recipe == "compiled")  # the batches of 4 compiled
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert (losses[0][0] - losses[0][-1]).abs() > 1e-3  # it trains


@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_pre_ampere_gpus_get_float16_with_a_scaler_and_a_note(monkeypatch, capability, expected):
    from gallery_lib.accel.precision import Precision, resolve_amp_dtype

    cfg = apply_recipe("compiled", base_config("smoke", family="swin_transformer"))  # asks for bfloat16
    assert cfg.amp_dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_amp_dtype(cfg.sections.precision, "cuda") == expected
    assert resolve_amp_dtype(cfg.sections.precision, "cpu") == torch.bfloat16
    precision = Precision.from_settings(cfg.sections.precision, "cuda")
    described = precision.describe()
    assert ("has no bfloat16 tensor cores" in described) == (expected == torch.float16)
    assert (precision.scaler is not None) == (expected == torch.float16)
    # the baseline asks for float16 itself (amp_dtype auto): nothing was replaced, so nothing is said
    baseline = Precision.from_settings(apply_recipe("baseline", cfg).sections.precision, "cuda")
    assert baseline.dtype == torch.float16 and "bfloat16" not in baseline.describe()


def test_checkpointed_blocks_can_go_to_the_precompile_workers(tmp_path):
    """The precompile workers get the blocks pickled (``torch.save`` of meta copies): with checkpointing on, a block
    holds the checkpoint function, which diffusers defines as a closure that pickle refuses."""
    import io

    from gallery_lib.accel.compile.precompile.record import meta_copy
    from gallery_lib.families import get_family

    unet = get_family("stable_diffusion").build("sd_tiny", pretrained=None, prediction_type="epsilon",
                                                image_size=32).unet
    enable_gradient_checkpointing(unet)
    blocks = [m for m in unet.modules() if type(m).__name__ in ("Transformer2DModel", "CrossAttnDownBlock2D")]
    assert blocks and any(getattr(m, "gradient_checkpointing", False) for m in unet.modules())
    for block in blocks:
        torch.save(meta_copy(block), io.BytesIO())  # raised "Can't pickle local object" before


def test_checkpointing_with_cuda_graphs_is_refused_with_the_fix():
    """Recomputing a block in the backward records CUDA graphs inside the backward: cuDNN's search fails in the
    capture (seen on an H100, benchmarks/results/ladder_h100/ladder_part6.log)."""
    from gallery_lib.config import RunConfig

    with pytest.raises(ConfigError, match="gradient_checkpointing=True cannot run with compile_mode='reduce-overhead'"
                                          ".*compile_mode='default'"):
        RunConfig(model="sd_tiny", gradient_checkpointing=True, compile=True, compile_mode="reduce-overhead")
    RunConfig(model="sd_tiny", gradient_checkpointing=True, compile=True, compile_mode="default")


def test_accelerated_with_checkpointing_leaves_out_its_cuda_graphs(monkeypatch):
    """On a GPU the accelerated SD recipe replays its blocks as CUDA graphs; asked for checkpointing (the 24 GB GPU
    case), it compiles them without graphs instead of failing."""
    from gallery_lib.recipes import recipe_config

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    base = base_config("full", family="stable_diffusion", data_root="/data")
    assert apply_recipe("accelerated", base).resolved_compile_mode == "reduce-overhead"
    cfg = recipe_config(base, "accelerated", {"gradient_checkpointing": True})
    assert (cfg.gradient_checkpointing, cfg.compile, cfg.resolved_compile_mode, cfg.recipe) == (
        True, True, "default", "accelerated+gradient_checkpointing")
    assert cfg.compile_whole == ""  # only the measured path compiles containers whole
    assert apply_recipe("accelerated", base.replace(gradient_checkpointing=True)).resolved_compile_mode == "default"


@pytest.mark.parametrize("family", ["stable_diffusion", "swin_transformer"])
def test_accelerated_with_zero2_leaves_out_its_cuda_graphs_and_precompile_workers(family, monkeypatch):
    """Multi-GPU runs: `--recipe accelerated --set data_parallel=zero2` on GPUs compiles without CUDA graphs (ZeRO-2's
    all-gathers run in hooks outside them) and without precompile workers (sharded blocks cannot be copied to them),
    instead of stopping at RunConfig's refusal of both."""
    from gallery_lib.recipes import recipe_config

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    base = base_config("full", family=family, data_root="/data")
    assert apply_recipe("accelerated", base).resolved_compile_mode == "reduce-overhead"
    cfg = recipe_config(base, "accelerated", {"data_parallel": "zero2"})
    assert (cfg.data_parallel, cfg.compile, cfg.resolved_compile_mode, cfg.precompile_workers) == (
        "zero2", True, "default", 0)
    assert cfg.recipe == "accelerated+data_parallel=zero2" and cfg.compile_whole == ""
    assert cfg.fused_attention == apply_recipe("accelerated", base).fused_attention  # the other switches stay


def test_accelerated_with_the_whole_model_compiled_leaves_out_its_precompile_workers(monkeypatch):
    """`--set compile_scope=model` on a GPU machine: the recipe's precompile workers (which compile repeated blocks)
    are left out instead of RunConfig refusing a setting the user never named; the CUDA graphs stay."""
    from gallery_lib.recipes import recipe_config

    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    monkeypatch.setattr("gallery_lib.recipes.named.precompile_workers_for_machine", lambda: 8)
    base = base_config("full", family="stable_diffusion", data_root="/data", batch_size=32)
    assert apply_recipe("accelerated", base).precompile_workers == 8
    assert apply_recipe("accelerated", base).compile_whole == "CrossAttnUpBlock2D,UpBlock2D"
    cfg = recipe_config(base, "accelerated", {"compile_scope": "model"})
    assert (cfg.compile_scope, cfg.precompile_workers, cfg.resolved_compile_mode) == ("model", 0, "reduce-overhead")
    assert cfg.compile_whole == ""  # the up blocks are in the one graph anyway
    with pytest.raises(ConfigError, match="precompile_workers=4 needs"):  # named by the user: still refused
        recipe_config(base, "accelerated", {"compile_scope": "model", "precompile_workers": 4})
