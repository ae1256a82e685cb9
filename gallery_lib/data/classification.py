"""The image-classification training batches: timm augmentation on the CPU, uint8 transfer, float work on the device.

Workers run timm's training transforms up to a uint8 CHW tensor (``create_transform(use_prefetcher=True)``): no
float conversion or normalisation on the CPU, and a quarter of the bytes over PCIe. On the device each batch is
converted to float and normalised (ImageNet mean / std), randomly erased (timm ``RandomErasing``, which expects
normalised input), mixed (timm ``Mixup`` / CutMix) and optionally made channels-last.

With ``pipeline="gpu_augment"`` (or ``"gpu_decode"``) the batch is cropped, resized and flipped (and decoded) on the
device (``device_decode.py``): the paths for GPUs that train faster than CPU cores can crop and resize.

Targets are always soft (``batch x num_classes``): mixed ones from Mixup, otherwise one-hot with label smoothing, so
the loss is always ``timm.loss.SoftTargetCrossEntropy``. The batches flow through the shared ``loader.TrainLoader``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch
import torch.utils.data
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup, auto_augment as timm_aa, create_transform
from timm.data.random_erasing import RandomErasing

from gallery_lib.data.image_folder import RobustImageFolder
from gallery_lib.data.loader import TrainLoader, sampled_loader


class ClassificationBatches:
    """Finishes an ``(uint8 images, labels)`` batch on the device: float, normalise, erase, mix, layout."""

    def __init__(self, *, device: torch.device, num_classes: int, label_smoothing: float, mixup: Mixup | None,
                 random_erasing: RandomErasing | None, channels_last: bool) -> None:
        self.device = device
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.mixup = mixup
        self.random_erasing = random_erasing
        self.channels_last = channels_last
        # Scaled by 255 so uint8 input is normalised in one sub / div.
        self._mean = torch.tensor([255 * m for m in IMAGENET_DEFAULT_MEAN], device=device).view(1, 3, 1, 1)
        self._std = torch.tensor([255 * s for s in IMAGENET_DEFAULT_STD], device=device).view(1, 3, 1, 1)

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        images = images.float().sub_(self._mean).div_(self._std)
        if self.random_erasing is not None:
            images = self.random_erasing(images)
        if self.mixup is not None:
            images, targets = self.mixup(images, labels)
        else:
            targets = smooth_one_hot(labels, self.num_classes, self.label_smoothing)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, targets


def smooth_one_hot(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """One-hot float targets with label smoothing, timm's convention: ``smoothing`` spread over all classes."""
    off = smoothing / num_classes
    targets = torch.full((labels.shape[0], num_classes), off, device=labels.device)
    return targets.scatter_(1, labels.long().view(-1, 1), 1.0 - smoothing + off)


def build_train_loader(
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    image_size: int,
    device: torch.device | str,
    num_workers: int = 2,
    seed: int = 0,
    world_size: int = 1,
    rank: int = 0,
    auto_augment: str | None = None,
    re_prob: float = 0.0,
    mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
    label_smoothing: float = 0.0,
    color_jitter: float = 0.4,
    channels_last: bool = False,
    pipeline: str = "cpu",
    interpolation: str = "bicubic",
    pin_memory: bool | None = None,
    persistent_workers: bool = True,
    prefetch_factor: int | None = None,
    num_classes: int | None = None,
) -> TrainLoader:
    """Build the endless training loader for a class-folder dataset.

    Args:
        dataset: Map-style dataset with a ``transform`` attribute left at ``None`` (e.g. ``RobustImageFolder``):
            this function installs timm's training transform on a shallow copy, the given object is not changed.
        batch_size: Images per batch on this process (the global batch is ``batch_size * world_size``).
        image_size: Side of the random-resized crop.
        device: Where batches are delivered and the float work happens.
        num_workers: DataLoader worker processes (0 decodes in the main process).
        seed: Seed of the shuffling order (same on all ranks) and of the worker augmentation streams.
        world_size: Number of data-parallel processes; each draws a disjoint ``1 / world_size`` of every epoch.
        rank: This process's index in ``[0, world_size)``.
        auto_augment: timm auto-augment policy, e.g. ``"rand-m9-mstd0.5-inc1"``; ``None`` uses colour jitter.
        re_prob: Random-erasing probability per image (applied on the device, after normalisation).
        mixup_alpha: Mixup alpha; mixing is on when this or ``cutmix_alpha`` is > 0. Needs an even batch (the run
            config checks that and the other settings' ranges).
        cutmix_alpha: CutMix alpha.
        label_smoothing: Smoothing of the soft targets, with or without mixing.
        color_jitter: Colour-jitter strength when there is no ``auto_augment`` (timm's default 0.4; 0 turns it off).
        channels_last: Deliver images in ``torch.channels_last`` memory format.
        pipeline: ``cpu`` (timm's transforms in the workers), ``gpu_augment`` (the workers decode, ``device`` crops,
            resizes and flips) or ``gpu_decode`` (``device`` decodes too): ``gallery_lib.data.device_decode``, which
            takes no ``auto_augment`` or ``color_jitter``.
        interpolation: Resize interpolation of the crop (``"bicubic"``, ``"bilinear"``, ``"random"``).
        pin_memory: Pin host batches; ``None`` pins when ``device`` is CUDA.
        persistent_workers: Keep workers alive between epochs (only when ``num_workers > 0``).
        prefetch_factor: Batches prefetched per worker; ``None`` keeps PyTorch's default.
        num_classes: Width of the targets; defaults to ``dataset.num_classes``.
    """
    device = torch.device(device)
    # batch_size, num_workers and the augmentation settings are checked where they are declared (RunConfig).
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    use_mixup = mixup_alpha > 0 or cutmix_alpha > 0
    num_classes = num_classes if num_classes is not None else getattr(dataset, "num_classes", None)
    if num_classes is None:
        raise ValueError(f"{type(dataset).__name__} has no num_classes attribute: pass num_classes=")
    if not hasattr(dataset, "transform"):
        raise ValueError(f"{type(dataset).__name__} has no transform attribute; build_train_loader needs a dataset "
                         "that applies `dataset.transform` to a PIL image, such as RobustImageFolder")
    if dataset.transform is not None:
        raise ValueError(f"{type(dataset).__name__}.transform is already set; build_train_loader installs timm's "
                         "training transform itself, so create the dataset with transform=None")
    if len(dataset) < batch_size * world_size:
        raise ValueError(f"The dataset has {len(dataset)} images, fewer than one global batch "
                         f"(batch_size {batch_size} x world_size {world_size} = {batch_size * world_size}): "
                         "lower the batch size or generate more images (e.g. a larger train_per_class)")

    on_device = None
    if pipeline != "cpu":
        from gallery_lib.data.device_decode import PIPELINES, DeviceBatches, EncodedImageFolder, collate_encoded

        if pipeline not in PIPELINES:
            raise ValueError(f"pipeline={pipeline!r}: choose one of {PIPELINES}")
        if auto_augment or color_jitter:
            raise ValueError(f"pipeline={pipeline!r} crops and flips on the device; auto_augment and color_jitter are "
                             "CPU transforms: set auto_augment=None and color_jitter=0, or use pipeline='cpu'")
        train_set = EncodedImageFolder(dataset, decode_in_worker=pipeline == "gpu_augment")
        collate, on_device = collate_encoded, DeviceBatches(dataset, image_size=image_size, device=device)
    else:
        train_set, collate = copy.copy(dataset), None  # the copy shares the sample list and the skip counters
        train_set.transform = create_transform(
            input_size=image_size, is_training=True, auto_augment=auto_augment, color_jitter=color_jitter,
            interpolation=interpolation, use_prefetcher=True)  # stops at uint8: normalise and erase on the device
        _make_posterize_pillow_safe(train_set.transform)
    loader = sampled_loader(train_set, batch_size=batch_size, device=device, num_workers=num_workers, seed=seed,
                            world_size=world_size, rank=rank, pin_memory=pin_memory,
                            persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                            collate_fn=collate)
    mixup = None
    if use_mixup:
        mixup = Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, label_smoothing=label_smoothing,
                      num_classes=num_classes)
    random_erasing = RandomErasing(re_prob, mode="pixel", device=device) if re_prob > 0 else None
    finish = ClassificationBatches(device=device, num_classes=num_classes, label_smoothing=label_smoothing,
                                   mixup=mixup, random_erasing=random_erasing, channels_last=channels_last)
    if on_device is not None:
        finish = _then(on_device, finish)
    return TrainLoader(loader, dataset, finish=finish)


def _then(first: Callable, second: Callable) -> Callable:
    return lambda batch: second(first(batch))


def _make_posterize_pillow_safe(transform) -> None:
    """Swap, on this transform's own augment ops only, timm's posterize for one that accepts 0 bits.

    timm's "inc" RandAugment levels (``rand-m9-mstd0.5-inc1``) ask for 0 bits at the top magnitude; Pillow 13's
    ``ImageOps.posterize`` rejects that with a ValueError that kills the worker a few hundred images into a run.
    Older Pillow returned an all-black image for 0 bits, which is what this restores.
    """
    for t in getattr(transform, "transforms", ()):
        ops = list(getattr(t, "ops", ())) + [op for sub in getattr(t, "policy", ()) for op in sub]
        for op in ops:
            if getattr(op, "aug_fn", None) is timm_aa.posterize:
                op.aug_fn = _posterize_any_bits


def _posterize_any_bits(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # keeping no bit leaves every channel at 0
    return timm_aa.posterize(img, bits_to_keep, **kwargs)


def validation_loader(data_dir: str, *, image_size: int, batch_size: int,
                      channels_last: bool = False) -> torch.utils.data.DataLoader | None:
    """The ``val`` split as float, normalised batches through timm's eval transform (resize, centre crop), in the
    training process; ``None`` when ``data_dir`` has no ``val`` split."""
    if not (Path(data_dir) / "val").is_dir():
        return None
    dataset = RobustImageFolder(data_dir, split="val", transform=create_transform(image_size, is_training=False))
    collate = None
    if channels_last:
        def collate(batch):
            images, labels = torch.utils.data.default_collate(batch)
            return images.contiguous(memory_format=torch.channels_last), labels
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0,
                                       collate_fn=collate)

