"""The ResNet family: timm's ResNet-50 for GPU runs and a micro ResNet for CPU smoke runs.

Trained the torchvision / NVIDIA way: Nesterov SGD with a cosine schedule, label smoothing 0.1, random-resized
crop and flip only (no Mixup, no colour jitter), no weight decay on BatchNorm and biases.
"""

from __future__ import annotations

import torch

from gallery_lib.config.family import Footprint, ModelFamily, ModelSpec, SpeedGoal
from gallery_lib.tasks.classification import ClassificationTask


def build_resnet50(*, num_classes: int, image_size: int = 224, pretrained_file: str | None = None) -> torch.nn.Module:
    import timm

    if pretrained_file:  # timm loads a local checkpoint through pretrained_cfg_overlay; the head is re-sized
        return timm.create_model("resnet50", pretrained=True, pretrained_cfg_overlay={"file": pretrained_file},
                                 num_classes=num_classes)
    return timm.create_model("resnet50", pretrained=False, num_classes=num_classes)


def build_resnet_micro(*, num_classes: int, image_size: int = 64, pretrained_file: str | None = None
                       ) -> torch.nn.Module:
    """One bottleneck block per stage (timm's ResNet class and ResNet-50's block) with narrow stages."""
    from timm.models.resnet import Bottleneck, ResNet

    if pretrained_file:
        raise ValueError("resnet_micro is a CPU smoke-test model with no pretrained weights; drop pretrained_file.")
    return ResNet(block=Bottleneck, layers=(1, 1, 1, 1), num_classes=num_classes, stem_width=16,
                  channels=(16, 32, 64, 128))


def _make_dataset(path, **spec):
    from data_prep.imagenet_like import make_imagenet_like

    return make_imagenet_like(path, **spec)


# The torchvision reference: label smoothing, crop and flip only; SGD's lr from the 0.1-per-256 rule.
_TRAINING = dict(optimizer="sgd", weight_decay=5e-5, clip_grad=None, mixup_alpha=0.0, cutmix_alpha=0.0,
                 label_smoothing=0.1, color_jitter=0.0)

FAMILY = ModelFamily(
    name="resnet50",
    task=ClassificationTask,
    models=(
        ModelSpec("resnet50", build_resnet50, 224, False,
                  "ResNet-50 (timm), 25.6M parameters, 4.1 GFLOP/image forward at 224 px"),
        ModelSpec("resnet_micro", build_resnet_micro, 64, True,
                  "one ResNet-50 bottleneck block per stage, 16-128 channels wide, for CPU smoke runs"),
    ),
    run_profiles={
        "smoke": dict(model="resnet_micro", image_size=64, batch_size=16, steps=16, warmup_steps=4, log_every=4,
                      lr=0.05, lr_warmup_steps=2, num_workers=1, **_TRAINING),
        "full": dict(model="resnet50", image_size=224, batch_size=256, steps=100, warmup_steps=30, log_every=10,
                     lr_warmup_steps=10, num_workers=12, **_TRAINING),
    },
    data_profiles={
        "smoke": dict(num_classes=10, train_per_class=32, val_per_class=4, image_size=72),
        # ImageNet's JPEGs average about 400 x 350 px: the loader decodes that much per image.
        "full": dict(num_classes=100, train_per_class=100, val_per_class=10, image_size=384),
    },
    dataset="imagenet_jpeg",  # not Swin's imagenet_like: other sizes
    make_dataset=_make_dataset,
    # kept: channels_last (1.79x eager), CUDA graphs (+1.5% compiled), the crops on the GPU (RESULTS.md#resnet50),
    # the norms folded into cuDNN's fused convolutions, float16 only (RESULTS.md#resnet50-conv-bn-fusion)
    accelerated={"channels_last": True, "image_pipeline": "gpu_augment"},
    accelerated_on_gpu={"compile_mode": "reduce-overhead", "kernels": True, "kernel_ops": "conv_bn_relu",
                        "amp_dtype": "float16"},
    peer={"channels_last": True},  # one line every convnet user knows
    block_types=("Bottleneck", "BasicBlock"),
    block_modules=("timm.models.resnet",),
    # against the fair peer (channels_last, CUDA graphs) at batch 256 (benchmarks/RESULTS.md#head, #resnet50)
    speed_goals=(SpeedGoal("speedup", "resnet50", dict(batch_size=256, min_ratio=1.1, min_samples_per_s=6000.0)),),
    # one H200, the larger of the runs each; the peer as it runs now, with CUDA graphs (#peer, #memory-plan)
    memory_footprints=(
        Footprint("resnet50", "accelerated", {256: 12.93}, samples_per_s={256: 6785.4},
                  source="memory_plan_h200/caps_resnet_22.json"),
        Footprint("resnet50", "peer", {256: 14.70}, samples_per_s={256: 6713.0},
                  source="memory_plan_h200/caps_resnet_22.json"),
        Footprint("resnet50", "compiled", {256: 12.70}, samples_per_s={256: 6572.8},
                  source="memory_plan_h200/caps_resnet_22.json"),
        Footprint("resnet50", "baseline", {256: 13.25}, samples_per_s={256: 2922.1},
                  source="memory_plan_h200/caps_resnet_22.json"),
    ),
)
