"""The recipe table a notebook shows before its runs: each recipe's settings as resolved on this machine."""

from gallery_lib import base_config, recipe_table


def test_the_table_reads_each_recipe_as_resolved_on_this_machine(monkeypatch):
    base = base_config("smoke", family="stable_diffusion", device="cpu")
    rows = {row["recipe"]: row for row in recipe_table(base, ["baseline", "accelerated"]).rows}
    # On a CPU the baseline's AMP runs bfloat16 autocast, not float16 with a GradScaler, and the fused EMA falls back.
    assert rows["baseline"]["precision"] == "bfloat16 autocast" and rows["baseline"]["compiled"] == "no (eager)"
    assert rows["accelerated"]["EMA"] == "foreach (fused needs a GPU)"
    assert "cache_latents=True" in rows["accelerated"]["family switches"]
    assert "kernel_ops" not in rows["baseline"]["family switches"]  # kernels off: their ops say nothing
    assert rows["accelerated"]["compiled"] == "repeated blocks, mode default"  # the up blocks whole: on a GPU only
    monkeypatch.setattr("gallery_lib.reports.recipe_table.visible_cuda_devices", lambda: 1)
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    gpu = recipe_table(base.replace(device="auto"), ["baseline", ("accelerated", {"batch_size": 6}),
                                                     ("peer", {"ema_offload": True}),
                                                     ("accelerated", {"ema_offload": True})])
    rows = {row["recipe"]: row for row in gpu.rows}
    # offloaded as a small GPU's plan may ask: the peer's as diffusers does it, accelerated's streamed beside the step
    assert rows["peer+ema_offload"]["EMA"] == "foreach, in the CPU's memory between updates"
    assert rows["accelerated+ema_offload"]["EMA"] == (
        "stream, in the CPU's memory between updates, streamed through the GPU in chunks")
    assert rows["baseline"]["precision"] == "float16 autocast + GradScaler"
    assert rows["accelerated+batch_size=6"]["compiled"] == (
        "repeated blocks, CrossAttnUpBlock2D whole, UpBlock2D whole, mode reduce-overhead, CUDA graphs")
    assert rows["accelerated+batch_size=6"]["EMA"] == "stream"  # on a GPU the update runs on a side stream
    # the recipe states compile_mode and kernel_ops as 'auto': the table says what they resolve to at this step
    assert "kernel_ops=geglu," in rows["accelerated+batch_size=6"]["family switches"]
    assert "(a GPU)" in gpu._repr_markdown_() and "| accelerated+batch_size=6 |" in gpu._repr_markdown_()


def test_gpu_only_switches_read_as_what_a_cpu_run_does():
    rows = recipe_table(base_config("smoke", family="resnet50", device="cpu"), ["accelerated"]).rows
    assert rows[0]["family switches"] == "channels_last=True, image_pipeline=cpu"  # the fused convolutions: GPU only
    assert rows[0]["precision"] == "bfloat16 autocast"
    assert rows[0]["optimizer"] == "fused sgd" and rows[0]["EMA"] == "none"


def test_clipping_in_the_optimizer_shows_where_it_runs():
    base = base_config("smoke", family="dreambooth", device="cpu")
    rows = recipe_table(base, ["accelerated", ("accelerated", {"clip_in_optimizer": True}),
                               ("baseline", {"clip_in_optimizer": True})]).rows
    assert [row["optimizer"] for row in rows] == ["fused adamw", "fused adamw, clipping in its pass", "adamw"]
    sharded, = recipe_table(base, [("accelerated", {"clip_in_optimizer": True, "data_parallel": "zero2",
                                                    "nproc_per_node": 2})]).rows
    assert sharded["optimizer"] == "fused adamw"  # ZeRO-2's sharded gradients: clipping runs as its own pass


def test_resnet_accelerated_on_a_gpu_reads_the_fused_convolutions_in_float16(monkeypatch):
    monkeypatch.setattr("gallery_lib.reports.recipe_table.visible_cuda_devices", lambda: 1)
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    row, = recipe_table(base_config("smoke", family="resnet50"), ["accelerated"]).rows
    assert row["precision"] == "float16 autocast + GradScaler"
    assert row["family switches"] == "channels_last=True, image_pipeline=gpu_augment, kernels=True, " \
                                     "kernel_ops=conv_bn_relu"


def test_cuda_graphs_are_named_only_where_they_replay(monkeypatch):
    """``compile_mode="reduce-overhead"`` asked for on a CPU compiles without CUDA graphs: the table does not claim
    them there, and does on a GPU."""
    base = base_config("smoke", family="swin_transformer", device="cpu")
    row, = recipe_table(base, [("accelerated", {"compile_mode": "reduce-overhead"})]).rows
    assert row["compiled"].endswith("mode reduce-overhead") and "CUDA graphs" not in row["compiled"]
    monkeypatch.setattr("gallery_lib.reports.recipe_table.visible_cuda_devices", lambda: 1)
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    row, = recipe_table(base.replace(device="auto"), ["accelerated"]).rows
    assert row["compiled"].endswith("mode reduce-overhead, CUDA graphs")
