"""Image batches finished on the training device: crop, resize and flip there, and optionally decode there too.

At several thousand images a second, PIL's crop-and-resize on the CPU cores cannot feed one H100. Two pipelines
move work to the device (``image_pipeline``):

- ``gpu_augment``: DataLoader workers only decode each JPEG (libjpeg-turbo through ``torchvision.io.decode_jpeg``)
  and draw its crop box and flip; same-size images travel stacked, in one pinned copy per size, and the device
  crops and resizes the whole batch with one ``roi_align`` per image size (area-averaged bilinear samples, so large
  crops are antialiased) and flips it.
- ``gpu_decode``: the workers only read the bytes; the device decodes the batch as well (nvjpeg through
  ``decode_jpeg(device="cuda")``).

Which is faster depends on the machine (benchmarks/RESULTS.md#resnet50). Both draw the same boxes and flips per
sample (seeded like the CPU path's transforms), so a run trains on the same crops with either. The float batch then
goes through the CPU path's normalise / erase / mix steps (``ClassificationBatches``).

Files the JPEG decoder cannot take are decoded by PIL in the worker, exactly as the CPU path decodes them: PNGs and
other formats, CMYK JPEGs, EXIF-rotated JPEGs. A file that fails to decode, in the worker or on the device (its
header opened, its data is broken), is a bad file: logged, counted in the dataset's skip counters
(``max_bad_fraction`` applies as on the CPU path) and replaced by another image of the batch, label and all.

The augmentation is timm's default training crop without colour jitter (random-resized crop with scale 0.08-1 and
ratio 3/4-4/3, horizontal flip): the torchvision ResNet recipe. RandAugment and colour jitter are CPU transforms;
asking for them with a device pipeline is a config error.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from gallery_lib.data.image_folder import RobustImageFolder, load_rgb

_logger = logging.getLogger(__name__)
_EXIF_ORIENTATION = 0x0112
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
PIPELINES = ("cpu", "gpu_augment", "gpu_decode")


@dataclass
class EncodedSample:
    """One sample as a worker hands it over: the JPEG's bytes (``encoded``, for the device to decode) or the decoded
    uint8 CHW image (``decoded``, ``None`` when even the worker could not decode it); its crop box
    ``(top, left, height, width)``, flip and label, and the dataset index."""

    encoded: torch.Tensor | None
    decoded: torch.Tensor | None
    box: tuple[int, int, int, int]
    flip: bool
    label: int
    index: int


def read_jpeg_bytes(path) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, int]]:
    """``(jpeg_bytes, None, (height, width))`` for an RGB or grey JPEG that needs no rotation, ``(None, rgb_chw_uint8,
    size)`` for anything else (decoded here by PIL, upright RGB); raises on a file PIL cannot open."""
    data = open(path, "rb").read()
    with Image.open(io.BytesIO(data)) as img:
        upright = img.getexif().get(_EXIF_ORIENTATION, 1) == 1
        if img.format == "JPEG" and img.mode in ("RGB", "L") and upright:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), None, (img.height, img.width)
    rgb = load_rgb(io.BytesIO(data))  # the bytes already read, decoded as the CPU path decodes them
    return None, _chw(rgb), (rgb.height, rgb.width)


def _chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def random_resized_box(height: int, width: int) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a random-resized crop (scale 0.08-1, log-uniform ratio 3/4-4/3, ten tries
    then the centre crop: torchvision's ``RandomResizedCrop.get_params``, drawn from ``random`` like timm's)."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * random.uniform(*SCALE)
        ratio = math.exp(random.uniform(*log_ratio))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, height - h), random.randint(0, width - w), h, w
    ratio = width / height
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class EncodedImageFolder(torch.utils.data.Dataset):
    """Worker side: ``dataset[i]`` is an ``EncodedSample`` of the class folder's image ``i``, decoded here unless
    ``decode_in_worker`` is False (a file PIL cannot open is skipped, counted and replaced by the next one, as
    ``RobustImageFolder`` does; one whose data then fails to decode is left for the batch to replace)."""

    def __init__(self, folder: RobustImageFolder, decode_in_worker: bool) -> None:
        self.folder = folder
        self.decode_in_worker = decode_in_worker

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> EncodedSample:
        i, (encoded, decoded, (height, width)) = self.folder._load_image(index, load=read_jpeg_bytes)
        if encoded is not None and self.decode_in_worker:
            encoded, decoded = None, decode_one(encoded, "cpu", self.folder, i)
        return EncodedSample(encoded, decoded, random_resized_box(height, width), random.random() < 0.5,
                             self.folder.samples[i][1], i)


@dataclass
class HostBatch:
    """A collated batch: decoded images stacked by size (``groups``: (uint8 N x 3 x H x W, their batch positions)),
    the JPEG bytes left for the device (``encoded``: position -> bytes), and every sample's box, flip, label and
    dataset index. ``pin_memory`` is what the DataLoader's pinning thread calls on it."""

    groups: list[tuple[torch.Tensor, list[int]]]
    encoded: dict[int, torch.Tensor]
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    labels: list[int]
    indices: list[int]

    def pin_memory(self) -> HostBatch:
        return dataclasses.replace(self, groups=[(images.pin_memory(), members) for images, members in self.groups])


def collate_encoded(samples: list[EncodedSample]) -> HostBatch:
    """Stacks the decoded images by size (a sample the worker failed to decode is in no group: the batch replaces
    it); the JPEG bytes stay a list."""
    encoded = {k: s.encoded for k, s in enumerate(samples) if s.encoded is not None}
    decoded = {k: s.decoded for k, s in enumerate(samples) if s.decoded is not None}
    return HostBatch(stacked_by_size(decoded, stack=_stack_shared), encoded, [s.box for s in samples],
                     [s.flip for s in samples], [s.label for s in samples], [s.index for s in samples])


def stacked_by_size(images: dict[int, torch.Tensor | None], stack=torch.stack) -> list[tuple[torch.Tensor, list[int]]]:
    """Images (batch position -> CHW tensor, ``None`` for a bad file, which joins no group) stacked by size:
    ``(N x 3 x H x W, their positions)`` per distinct size."""
    by_size: dict[tuple[int, ...], list[int]] = {}
    for k, image in images.items():
        if image is not None:
            by_size.setdefault(tuple(image.shape), []).append(k)
    return [(stack([images[k] for k in members]), members) for members in by_size.values()]


def _stack_shared(images: list[torch.Tensor]) -> torch.Tensor:
    """In a worker, stacked straight into shared memory, where the batch travels (not copied there afterwards)."""
    out = torch.empty((len(images), *images[0].shape), dtype=images[0].dtype)
    if torch.utils.data.get_worker_info() is not None:
        out.share_memory_()
    return torch.stack(images, out=out)


def decode_one(encoded: torch.Tensor, device, dataset: RobustImageFolder, index: int) -> torch.Tensor | None:
    """One JPEG decoded on ``device``, else by PIL (what a decoder rejects PIL may still read, as the CPU path would);
    ``None`` for a bad file, which is logged and counted as skipped."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as decoder_error:
        try:
            return _chw(load_rgb(io.BytesIO(encoded.numpy().tobytes()))).to(device)
        except Exception as exc:  # noqa: BLE001 - any decode error means "bad file"
            _logger.warning("Skipped sample %d (%s): %s (JPEG decoder: %s)", index, dataset._image_path(index), exc,
                            decoder_error)
            dataset._count_skip(index)
            return None


class DeviceBatches:
    """Training-process side: a ``HostBatch`` -> ``(float images 0-255 N x 3 x S x S on device, labels)``."""

    def __init__(self, dataset: RobustImageFolder, *, image_size: int, device: torch.device) -> None:
        self.dataset = dataset
        self.image_size = image_size
        self.device = torch.device(device)

    def __call__(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        groups = [(images.to(self.device, non_blocking=True), members) for images, members in batch.groups]
        groups += self._decode(batch)
        good = sorted(k for _, members in groups for k in members)
        if not good:
            raise RuntimeError(f"no image of a batch of {len(batch.labels)} could be decoded (the last: "
                               f"{self.dataset._image_path(batch.indices[-1])}): the dataset looks broken")
        out = crop_resize_flip(groups, batch.boxes, batch.flips, self.image_size)
        labels = torch.tensor(batch.labels)
        bad = sorted(set(range(len(batch.labels))) - set(good))
        if bad:  # a bad file's place goes to a good image of the batch, label and all: the batch keeps its size
            twins = [good[k % len(good)] for k in bad]
            out[bad] = out[twins]
            labels[bad] = labels[twins]
        return out, labels.to(self.device, non_blocking=True)

    def _decode(self, batch: HostBatch) -> list[tuple[torch.Tensor, list[int]]]:
        """The batch's JPEG bytes decoded on the device, stacked by size like the host groups."""
        from torchvision.io import ImageReadMode, decode_jpeg

        if not batch.encoded:
            return []
        positions = list(batch.encoded)
        try:
            images = decode_jpeg([batch.encoded[k] for k in positions], mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:  # one bad file fails the whole call: decode one by one to find it
            images = [decode_one(batch.encoded[k], self.device, self.dataset, batch.indices[k])
                      for k in positions]
        return stacked_by_size(dict(zip(positions, images)))


def crop_resize_flip(groups: list[tuple[torch.Tensor, list[int]]], boxes: list[tuple[int, int, int, int]],
                     flips: list[bool], size: int) -> torch.Tensor:
    """Crops ``boxes[k]`` (top, left, height, width) out of the images of ``groups`` (uint8 N x 3 x H x W stacks and
    the batch positions of their images), resizes each crop to ``size`` x ``size`` with ``roi_align`` (adaptive
    sampling: a large crop averages several bilinear samples per output pixel) and flips the flagged ones. Returns a
    float batch (0-255) on the groups' device; positions no group holds are left unset."""
    from torchvision.ops import roi_align

    device = groups[0][0].device
    out = torch.empty(len(boxes), 3, size, size, device=device)
    for images, members in groups:
        rois = torch.tensor([[n, boxes[k][1], boxes[k][0], boxes[k][1] + boxes[k][3], boxes[k][0] + boxes[k][2]]
                             for n, k in enumerate(members)], dtype=torch.float32).to(device, non_blocking=True)
        resized = roi_align(images.float(), rois, output_size=(size, size), spatial_scale=1.0, sampling_ratio=-1,
                            aligned=True)
        out.index_copy_(0, torch.tensor(members).to(device, non_blocking=True), resized)
    flip = torch.tensor(flips).to(device, non_blocking=True).view(-1, 1, 1, 1)
    return torch.where(flip, out.flip(-1), out)
