"""A model family that lives outside the library: a tiny convnet classifier (copy this module for your own model).

Importing this module registers it (``register_family``), and the launcher's training processes import it again, so
its runs go through the same ``gallery`` path as the built-in families. It touches no library file: this module is
the whole family.
"""

from __future__ import annotations

from torch import nn

from gallery_lib.families import register_family
from gallery_lib.config.family import ModelFamily, ModelSpec
from gallery_lib.tasks.classification import ClassificationTask


class ToyBlock(nn.Module):
    """conv -> BatchNorm -> ReLU with a residual: the repeated block ``compile_scope='blocks'`` compiles."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + nn.functional.relu(self.norm(self.conv(x)))


def build_toy_convnet(*, num_classes: int, image_size: int = 32, pretrained_file: str | None = None) -> nn.Module:
    if pretrained_file:
        raise ValueError("toy_convnet has no pretrained weights")
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), ToyBlock(16), ToyBlock(16),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def _make_dataset(path, **spec):
    from data_prep.imagenet_like import make_imagenet_like

    return make_imagenet_like(path, **spec)


FAMILY = register_family(ModelFamily(
    name="toy_convnet",
    task=ClassificationTask,
    models=(ModelSpec("toy_convnet", build_toy_convnet, 32, True, "a two-block convnet for the family tests"),),
    run_profiles={
        "smoke": dict(model="toy_convnet", image_size=32, batch_size=8, steps=6, warmup_steps=2, log_every=3,
                      lr=1e-3, lr_warmup_steps=1, num_workers=0, mixup_alpha=0.0, cutmix_alpha=0.0),
        "full": dict(model="toy_convnet", image_size=32, batch_size=256, steps=50, warmup_steps=10),
    },
    data_profiles={
        "smoke": dict(num_classes=4, train_per_class=8, val_per_class=2, image_size=40),
        "full": dict(num_classes=10, train_per_class=100, val_per_class=10, image_size=40),
    },
    dataset="toy_images",
    make_dataset=_make_dataset,
    accelerated={"channels_last": True, "compile_scope": "blocks", "fused_loss": True},
    block_types=("ToyBlock",),
    block_modules=(__name__,),
))
