"""The Stable Diffusion family: SD-1.5's UNet trained text-to-image with its frozen VAE and CLIP text encoder,
and ``sd_tiny``, the same diffusers/transformers classes at CPU-smoke size (its parts: ``models/sd_parts.py``)."""

from __future__ import annotations

from functools import partial

from gallery_lib.config.family import Footprint, ModelFamily, ModelSpec, SpeedGoal, WorkerMemory
from gallery_lib.models.sd_parts import SD15_UNET_PARAMETERS, build_stable_diffusion, image_size_multiple
from gallery_lib.tasks.text_to_image import TextToImageTask


def hook_diffusers_attention(model):
    """Every attention layer of a diffusers model through ``gallery_lib.accel.attention``'s backend registry, by the
    call a model of the user's takes."""
    from gallery_lib.accel.on_any_model import fuse_attention
    from gallery_lib.config.settings import ConfigError

    change = fuse_attention(model)
    if change.handle is None:
        raise ConfigError(f"fused_attention=True cannot apply to {type(model).__name__}: it has no diffusers "
                          "attention layers; run without it (--set fused_attention=false)")
    return change.note, change.handle


def _make_dataset(path, **spec):
    from data_prep.captions import make_caption_folder

    return make_caption_folder(path, **spec)


# diffusers train_text_to_image defaults: AdamW lr 1e-4, weight decay 1e-2, gradient clipping at 1.0, EMA (use_ema).
_TRAINING = dict(weight_decay=1e-2, clip_grad=1.0, ema="foreach")

FAMILY = ModelFamily(
    name="stable_diffusion",
    task=TextToImageTask,
    models=(
        ModelSpec("sd15", partial(build_stable_diffusion, "sd15"), 512, False,
                  "Stable Diffusion 1.5: UNet (860M parameters, trained), VAE and CLIP ViT-L/14 text encoder (frozen)",
                  trained_parameters=SD15_UNET_PARAMETERS, image_size_multiple=image_size_multiple("sd15")),
        ModelSpec("sd_tiny", partial(build_stable_diffusion, "sd_tiny"), 32, True,
                  "the same three diffusers/transformers classes at CPU-smoke size",
                  image_size_multiple=image_size_multiple("sd_tiny")),
    ),
    run_profiles={
        # 12 steps: on a CPU without bf16 instructions an eager step of the tiny UNet takes about a second, and the
        # ladder runs 14 rungs of them (benchmarks/RESULTS.md#cpu-gallery)
        "smoke": dict(model="sd_tiny", image_size=32, batch_size=4, steps=12, warmup_steps=4, log_every=4,
                      lr=1e-3, lr_warmup_steps=2, num_workers=1, **_TRAINING),
        "full": dict(model="sd15", image_size=512, batch_size=8, steps=100, warmup_steps=30, log_every=10,
                     lr=1e-4, lr_warmup_steps=10, **_TRAINING),
    },
    data_profiles={
        "smoke": dict(num_images=32, image_size=32),
        "full": dict(num_images=512, image_size=512),
    },
    dataset="captions",
    make_dataset=_make_dataset,
    # Each switch kept for a measured gain over compiled (benchmarks/RESULTS.md#sd15-recipes):
    # cached latents and the fused EMA kernel; the GEGLU kernel (#kernels); the blocks compiled in place, as CUDA
    # graphs precompiled in parallel on a GPU (#sd15-compile-time); channels_last, through every compiled graph but
    # the attention's tensors, and the EMA beside the next forward on a side stream, on a GPU (#bench-h100,
    # #sd15-layout, #sd15-attention-layout, #ema); the up blocks compiled whole, skip connections inside, on a GPU
    # (#sd15-up-blocks). Not kept: the LayerNorm kernel, the EMA in AdamW's pass (#adamw-ema).
    accelerated={"cache_latents": True, "ema": "fused", "kernels": True, "kernel_ops": "geglu",
                 "compile_scope": "blocks"},
    accelerated_on_gpu={"channels_last": True, "channels_last_graphs": True, "ema": "stream",
                        "compile_whole": "CrossAttnUpBlock2D,UpBlock2D"},
    # From 32 images of 512 px a step, the GroupNorm+SiLU kernel too: faster at 32 and 48, slower at 1 and 8
    # (#sd15-gn-by-batch).
    accelerated_on_large_steps={"kernel_ops": "geglu,group_norm_silu"},
    large_step_pixels=32 * 512 * 512,
    # At 512 px, CUDA graphs: 1.9x at batch 8, 1.17-1.27x at 16, +0.4-0.7% at 32; at 64 no faster, and 3-4 s more
    # of a warm start (#sd15-graphs-by-batch).
    block_graphs_below_pixels=64 * 512 * 512,
    # The plain-PyTorch peer encodes the images and captions once too, a few lines in any training script, and runs
    # channels_last as the Swin and ResNet peers do (132.1 img/s at batch 32, 131.2 without: #peer-layout).
    peer={"cache_latents": True, "channels_last": True},
    # Matched by class name, outermost first: a Transformer2DModel compiles whole, its blocks not again.
    block_types=("Transformer2DModel", "BasicTransformerBlock", "ResnetBlock2D"),
    block_modules=("diffusers.models.unets.unet_2d_blocks", "gallery_lib.accel.kernels.patch"),
    attention_hook=hook_diffusers_attention,
    # set for one H100: the speed over the peer at batch 32, the best throughput, the EMA's cost, the time to
    # steady speed with cold and warm caches (benchmarks/RESULTS.md#peer, #bench-h100)
    # Peak reserved GiB by batch at 512 px, one H200 or H100, torch 2.11 (benchmarks/RESULTS.md#memory-plan)
    memory_footprints=(
        Footprint("sd15", "accelerated", {4: 20.06, 8: 23.72, 16: 28.60, 32: 42.29, 48: 54.85, 64: 68.06},
                  samples_per_s={4: 74.8, 8: 108.8}, source="memory_plan_h200/bench_sdmem_1.json, "
                  "memory_plan_h200/caps_sd_38_acc.json, bench_h100/sd15_graphs_by_batch/, sd_up_blocks_h200/"),
        Footprint("sd15", "peer", {8: 21.83, 32: 40.85}, samples_per_s={8: 101.5, 32: 132.1},
                  source="memory_plan_h200/caps_sd_38_all.json, peer_layout_h200/bench_sd_b32_cl.json"),
        # checkpointed, compiled whole, under a 22 GiB cap (batch 8 unchecked needs more: 21.8-25.0 under a 38 GiB cap)
        Footprint("sd15", "accelerated", {8: 20.32}, gradient_checkpointing=True, samples_per_s={8: 52.8},
                  source="memory_plan_h200/caps_sd_22_acc.json"),
        Footprint("sd15", "peer", {8: 20.30}, gradient_checkpointing=True, samples_per_s={8: 52.8},
                  source="memory_plan_h200/caps_sd_22_pair.json, memory_plan_h200/caps_sd_22_peer_ckpt2.json"),
        # in 16 GiB, the EMA offloaded: only eager steps fit, checkpointed (the compiled ones ran out of memory); the
        # baseline's (15.57, its update one tensor at a time) is left out: with the headroom it would rule out batch 8
        # checkpointed, which ran (#memory-plan)
        Footprint("sd15", "accelerated", {8: 15.16}, gradient_checkpointing=True, uncompiled=True, ema_offloaded=True,
                  samples_per_s={8: 36.7}, source="memory_plan_h200/caps_sd_16_all.json, "
                  "memory_plan_h100/caps_sd_16_stream_a.json"),
        Footprint("sd15", "peer", {8: 15.14}, gradient_checkpointing=True, uncompiled=True, ema_offloaded=True,
                  samples_per_s={8: 26.6}, source="memory_plan_h200/caps_sd_16_peer_eager_ckpt.json"),
        Footprint("sd15", "compiled", {8: 14.88}, gradient_checkpointing=True, uncompiled=True, ema_offloaded=True,
                  samples_per_s={8: 22.3}, source="notebooks_caps_h100/notebook_sd_16.json"),
        Footprint("sd15", "baseline", {4: 22.12, 8: 25.01}, samples_per_s={8: 39.2},
                  source="memory_plan_h200/bench_sdmem_1.json, memory_plan_h200/caps_sd_38_all.json"),
        Footprint("sd15", "compiled", {8: 21.26}, samples_per_s={8: 57.8}, source="memory_plan_h200/caps_sd_22.json"),
        # the ladder's rungs at their own batch, on an H200 without a cap: on a smaller card the plan skips those
        # settings instead of trying each (a compiled rung's try costs its compilation; #optimization-ladder)
        *(Footprint("sd15", rung, {batch: gib}, source="ladder_h200_2c5160a/ladder.json")
          for rung, batch, gib in (("ladder-00-tf32", 8, 83.28), ("ladder-01-amp", 8, 59.88),
                                   ("ladder-02-loader", 8, 59.88), ("ladder-03-fused", 8, 56.88),
                                   ("ladder-04-attention", 8, 21.17), ("ladder-05-batch", 48, 51.69),
                                   ("ladder-06-ema", 48, 51.69), ("ladder-07-zero2", 48, 58.38),
                                   ("ladder-08-bf16", 48, 51.69), ("ladder-09-compile", 48, 61.47),
                                   ("ladder-10-regional", 48, 58.51), ("ladder-11-cuda_graphs", 48, 77.85),
                                   ("ladder-12-cached_latents", 48, 54.86), ("ladder-13-channels_last", 48, 55.12),
                                   ("ladder-14-kernels", 48, 55.18))),
        # checkpointed, under a 38 GiB cap on an H100: on a 24 GB card the plan skips these without a try. TF32's and
        # the compile rung's (37.99, 37.59) ran at the cap's edge: left out, their 4% headroom would rule them out there
        *(Footprint("sd15", rung, {batch: gib}, gradient_checkpointing=True,
                    source=f"notebooks_caps_h100/notebook_ladder_38_{part}.json")
          for rung, batch, gib, part in (("ladder-01-amp", 8, 33.58, "a"), ("ladder-02-loader", 8, 33.58, "a"),
                                         ("ladder-03-fused", 8, 33.40, "a"), ("ladder-05-batch", 48, 34.64, "a"),
                                         ("ladder-06-ema", 48, 34.65, "a"), ("ladder-07-zero2", 48, 34.85, "a"),
                                         ("ladder-08-bf16", 48, 34.65, "b"), ("ladder-10-regional", 48, 34.62, "b"),
                                         ("ladder-15-checkpointing", 96, 35.96, "c"))),
    ),
    # 8 workers of 1.3-3.5 GiB beside a training process at up to 11.8 GiB (nvidia-smi, #memory-plan)
    worker_memory=WorkerMemory(trainer_gib=11.8, per_worker_gib=3.5, source="memory_plan_h200/smi_apps_sdmem.csv.gz"),
    speed_goals=(SpeedGoal("speedup", "sd15", dict(batch_size=32, min_ratio=1.15)),
                 SpeedGoal("throughput", "sd15", dict(min_samples_per_s=150.0)),
                 SpeedGoal("ema_cost", "sd15", dict(max_cost=0.01)),
                 SpeedGoal("compile_time", "sd15", dict(caches="cold", max_s=45.0)),
                 SpeedGoal("compile_time", "sd15", dict(caches="warm", max_s=15.0))),
)
