"""The DreamBooth family: Stable Diffusion 1.5 fine-tuned on one subject from a few pictures (``tasks/dreambooth.py``),
with ``dreambooth_tiny``, the same diffusers/transformers classes at CPU-smoke size.

The models are those of the Stable Diffusion family (``models/sd_parts.py``); what differs is the task, the data (a few
pictures of the subject plus class pictures for prior preservation) and the batch size: DreamBooth trains at batch 1
or 2, where launching kernels, the optimizer and the EMA weigh most in a step.
"""

from __future__ import annotations

from functools import partial

from gallery_lib.config.family import Footprint, ModelFamily, ModelSpec, SpeedGoal
from gallery_lib.models.sd_parts import SD15_UNET_PARAMETERS, build_stable_diffusion, image_size_multiple
from gallery_lib.families.stable_diffusion import FAMILY as STABLE_DIFFUSION
from gallery_lib.tasks.dreambooth import DreamBoothTask


def _make_dataset(path, **spec):
    from data_prep.dreambooth import make_dreambooth_folders

    return make_dreambooth_folders(path, **spec)


# diffusers train_dreambooth: AdamW with weight decay 1e-2, gradient clipping at 1.0; an EMA of the trained weights.
_TRAINING = dict(weight_decay=1e-2, clip_grad=1.0, ema="foreach")

FAMILY = ModelFamily(
    name="dreambooth",
    task=DreamBoothTask,
    models=(
        ModelSpec("dreambooth_sd15", partial(build_stable_diffusion, "sd15"), 512, False,
                  "Stable Diffusion 1.5 (UNet trained, VAE and CLIP text encoder frozen) fine-tuned on one subject",
                  trained_parameters=SD15_UNET_PARAMETERS, image_size_multiple=image_size_multiple("sd15")),
        ModelSpec("dreambooth_tiny", partial(build_stable_diffusion, "sd_tiny"), 32, True,
                  "the same three diffusers/transformers classes at CPU-smoke size",
                  image_size_multiple=image_size_multiple("sd_tiny")),
    ),
    run_profiles={
        # batch 2 (+2 class pictures): the UNet sees SD smoke's shapes, so a CPU gallery compiles them once
        "smoke": dict(model="dreambooth_tiny", image_size=32, batch_size=2, steps=12, warmup_steps=4, log_every=4,
                      lr=1e-3, lr_warmup_steps=2, num_workers=1, num_class_images=8, **_TRAINING),
        # lr: diffusers' DreamBooth example for full fine-tuning (5e-6); LoRA runs take 1e-4.
        "full": dict(model="dreambooth_sd15", image_size=512, batch_size=1, steps=200, warmup_steps=50,
                     log_every=10, lr=5e-6, lr_warmup_steps=0, num_workers=2, num_class_images=100, **_TRAINING),
    },
    data_profiles={
        "smoke": dict(num_instance_images=4, num_class_images=8, image_size=32),
        "full": dict(num_instance_images=6, num_class_images=100, image_size=512),
    },
    dataset="dreambooth",
    make_dataset=_make_dataset,
    # On a GPU at batch 1: the whole UNet as CUDA graphs, channels_last through every graph (1.25x the peer, and a
    # shorter cold start than the peer's); its blocks as graphs leave the host setting the step (0.7x the peer), and
    # start sooner only on a cold machine; the gradient clipping in the fused AdamW's pass (0.8% and 2.4% faster in
    # two calls) (benchmarks/RESULTS.md#dreambooth), and the EMA in that pass too (1.12x and 1.25x in two calls,
    # #adamw-ema). On a CPU the blocks, as for SD.
    accelerated={"cache_latents": True, "ema": "fused", "kernels": True, "kernel_ops": "geglu",
                 "compile_scope": "blocks"},
    accelerated_on_gpu={"compile_scope": "model", "channels_last": True, "channels_last_graphs": True,
                        "clip_in_optimizer": True, "ema_in_optimizer": True},
    # as for Stable Diffusion: the frozen encoders run once, in a few plain lines, and channels_last (25.4 img/s with
    # it, 21.2 without, in one call: benchmarks/RESULTS.md#peer-layout)
    peer={"cache_latents": True, "channels_last": True},
    block_graphs_below_pixels=STABLE_DIFFUSION.block_graphs_below_pixels,  # the same UNet
    block_types=STABLE_DIFFUSION.block_types,
    block_modules=STABLE_DIFFUSION.block_modules,
    attention_hook=STABLE_DIFFUSION.attention_hook,
    # against the fair peer (cached latents, channels_last, CUDA graphs) at batch 1, with steady steps
    # (benchmarks/RESULTS.md#head)
    speed_goals=(SpeedGoal("speedup", "dreambooth_sd15", dict(batch_size=1, min_ratio=1.3, max_spread=1.03)),),
    # Peak reserved GiB at batch 1, one H200, torch 2.11: the most of repeated calls (benchmarks/RESULTS.md#memory-plan)
    memory_footprints=(
        Footprint("dreambooth_sd15", "accelerated", {1: 19.71}, source="dreambooth_b1_h200/bench_db_rep2.json"),
        Footprint("dreambooth_sd15", "peer", {1: 19.17}, samples_per_s={1: 25.7},  # with channels_last
                  source="head_0537162_h200/bench_head3_db.json"),
        Footprint("dreambooth_sd15", "baseline", {1: 20.62}, samples_per_s={1: 4.05},
                  source="memory_plan_h200/caps_db_38_bc.json"),
        Footprint("dreambooth_sd15", "compiled", {1: 18.42}, samples_per_s={1: 6.87},
                  source="memory_plan_h200/caps_db_38_bc.json"),
        # each recipe's first setting that trained under a 16 GiB cap, where the plan keeps the EMA on the CPU (the
        # peer's compiled batch 1 ran out of CUDA-graph memory); the higher of two calls where there were two
        Footprint("dreambooth_sd15", "accelerated", {1: 15.24}, gradient_checkpointing=True, ema_offloaded=True,
                  samples_per_s={1: 5.36}, source="memory_plan_h200/caps_db_16_stream_acc.json"),
        Footprint("dreambooth_sd15", "peer", {1: 15.20}, gradient_checkpointing=True, ema_offloaded=True,
                  samples_per_s={1: 4.68}, source="memory_plan_h200/caps_db_16_pair.json"),
        Footprint("dreambooth_sd15", "compiled", {1: 15.38}, ema_offloaded=True, samples_per_s={1: 4.09},
                  source="memory_plan_h200/caps_db_16_cp.json"),
        Footprint("dreambooth_sd15", "baseline", {1: 15.19}, ema_offloaded=True, samples_per_s={1: 3.27},
                  source="memory_plan_h200/caps_db_16_ba.json"),
    ),
)
