"""Tests of the device image pipelines (gallery_lib.data.device_decode): crop / resize / flip against PyTorch
references, bad files skipped and counted wherever they fail, odd files decoded by PIL, and the loader around them.
The device is the CPU here (the same code; torchvision's CPU decode_jpeg); the `gpu` test runs it on CUDA."""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from data_prep import make_imagenet_like
from gallery_lib.data import RobustImageFolder, build_train_loader
from gallery_lib.data.device_decode import (DeviceBatches, EncodedImageFolder, EncodedSample, collate_encoded,
                                            crop_resize_flip, random_resized_box, read_jpeg_bytes)
from gallery_lib.config.settings import ConfigError


def _image(seed, width, height):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (3, height, width), dtype=np.uint8))


def test_crop_without_resize_is_the_slice_and_flip_mirrors_it():
    a, b = _image(0, 37, 29), _image(1, 23, 31)  # two sizes: two roi_align groups
    boxes = [(3, 5, 12, 12), (0, 0, 12, 12)]
    out = crop_resize_flip([(a[None], [0]), (b[None], [1])], boxes, [False, True], 12)
    torch.testing.assert_close(out[0], a[:, 3:15, 5:17].float())
    torch.testing.assert_close(out[1], b[:, :12, :12].float().flip(-1))


def test_downscaled_crop_matches_area_interpolation():
    """Shrinking by an integer factor averages that many bilinear samples per output pixel: area interpolation."""
    img = _image(2, 64, 48)
    out = crop_resize_flip([(img[None], [0])], [(8, 4, 40, 40)], [False], 10)[0]
    ref = F.interpolate(img[None, :, 8:48, 4:44].float(), size=(10, 10), mode="area")[0]
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)


def test_boxes_follow_random_resized_crop_statistics():
    """Inside the image, scale 0.08-1 and ratio 3/4-4/3 up to rounding, with the area's mean near torchvision's."""
    import random

    random.seed(0)
    areas = []
    for _ in range(2000):
        top, left, h, w = random_resized_box(41, 67)
        assert 0 <= top and top + h <= 41 and 0 <= left and left + w <= 67 and h > 0 and w > 0
        areas.append(h * w / (41 * 67))
        assert 0.08 * 0.8 <= areas[-1] <= 1.0 and (3 / 4) * 0.8 <= w / h <= (4 / 3) * 1.25
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    reference = [(lambda b: b[2] * b[3] / (41 * 67))(RandomResizedCrop.get_params(torch.empty(0, 41, 67),
                                                                               [0.08, 1.0], [3 / 4, 4 / 3]))
                 for _ in range(2000)]
    assert abs(np.mean(areas) - np.mean(reference)) < 0.03
    assert random_resized_box(2, 200) == (0, 98, 2, 3)  # too wide for any try: the centre crop at ratio 4/3


def _jpeg(img, **kw):
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def odd_root(tmp_path_factory):
    """Good JPEGs of two sizes, a grey JPEG, a PNG, a CMYK JPEG, an EXIF-rotated one and a truncated one whose
    header still opens (only the decoder finds it bad)."""
    root = tmp_path_factory.mktemp("odd")
    folder = root / "train"
    for cls in "ab":
        (folder / cls).mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        size = (40, 32) if i % 2 else (24, 24)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
            folder / "a" / f"img_{i}.jpg", quality=90)
    Image.fromarray(rng.integers(0, 256, (20, 20), dtype=np.uint8), "L").save(folder / "b" / "grey.jpg")
    Image.new("RGB", (16, 16), (200, 10, 10)).save(folder / "b" / "red.png")
    Image.new("CMYK", (20, 16), (0, 255, 255, 0)).save(folder / "b" / "cmyk.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(rng.integers(0, 256, (20, 40, 3), dtype=np.uint8)).save(folder / "b" / "rotated.jpg", exif=exif)
    big = _jpeg(Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)), quality=95)
    (folder / "b" / "zz_truncated.jpg").write_bytes(big[: len(big) // 3])
    return root


def test_workers_send_jpeg_bytes_and_decode_the_rest_with_pil(odd_root):
    folder = odd_root / "train"
    encoded, decoded, size = read_jpeg_bytes(folder / "a" / "img_1.jpg")
    assert decoded is None and encoded.dtype == torch.uint8 and size == (32, 40)
    for name, expected in (("red.png", (16, 16)), ("cmyk.jpg", (16, 20)), ("rotated.jpg", (40, 20))):
        encoded, decoded, size = read_jpeg_bytes(folder / "b" / name)
        assert encoded is None and decoded.shape == (3, *expected) and size == expected, name  # upright RGB
    assert read_jpeg_bytes(folder / "b" / "grey.jpg")[0] is not None  # grey JPEGs decode as RGB on the device


@pytest.mark.parametrize("decode_in_worker", [True, False], ids=["gpu_augment", "gpu_decode"])
def test_a_file_only_the_decoder_finds_bad_is_skipped_counted_and_replaced(odd_root, caplog, decode_in_worker):
    folder = RobustImageFolder(odd_root)
    samples = [EncodedImageFolder(folder, decode_in_worker)[i] for i in range(len(folder))]
    bad = [k for k, s in enumerate(samples) if folder._image_path(s.index).name == "zz_truncated.jpg"]
    assert len(bad) == 1  # its header opened: the worker passed it on
    if not decode_in_worker:
        assert samples[bad[0]].encoded is not None and folder.skipped == 0  # found bad on the device
    images, labels = DeviceBatches(folder, image_size=16, device="cpu")(collate_encoded(samples))
    assert images.shape == (len(samples), 3, 16, 16) and images.dtype == torch.float32
    assert 0 <= images.min() and images.max() <= 255
    assert folder.skipped == 1 and folder.skipped_paths[-1].name == "zz_truncated.jpg"
    assert "zz_truncated.jpg" in caplog.text
    # Its place holds another image of the batch, with that image's label.
    twins = [k for k in range(len(samples)) if k != bad[0] and torch.equal(images[k], images[bad[0]])]
    assert twins and labels[twins[0]] == labels[bad[0]]


def test_decoded_pixels_match_pil(odd_root):
    """The whole-image box at its own size gives back the decoded image: torchvision's decoder against PIL's."""
    path = odd_root / "train" / "a" / "img_0.jpg"
    encoded, _, (h, w) = read_jpeg_bytes(path)
    sample = EncodedSample(encoded, None, (0, 0, h, w), False, 0, 0)
    images, _ = DeviceBatches(RobustImageFolder(odd_root), image_size=h, device="cpu")(collate_encoded([sample]))
    pil = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float()
    assert (images[0] - pil).abs().mean() < 2.0  # libjpeg builds differ by rounding in the IDCT / upsampling


@pytest.fixture(scope="module")
def mock_root(tmp_path_factory):
    return make_imagenet_like(tmp_path_factory.mktemp("mock"), num_classes=4, train_per_class=12, val_per_class=1,
                              image_size=32, progress=False)


def test_device_pipelines_give_normalised_batches_the_same_whoever_decodes(mock_root):
    kw = dict(batch_size=8, image_size=24, device="cpu", label_smoothing=0.1, color_jitter=0.0, channels_last=True)
    loader = build_train_loader(RobustImageFolder(mock_root), num_workers=0, pipeline="gpu_augment", **kw)
    batches = [b for _, b in zip(range(7), loader)]  # past the first epoch (6 batches)
    x, y = batches[0]
    assert x.shape == (8, 3, 24, 24) and x.is_contiguous(memory_format=torch.channels_last)
    assert -2.2 <= x.min() and x.max() <= 2.7 and y.shape == (8, 4)
    torch.testing.assert_close(y.sum(1), torch.ones(8))
    assert loader.epoch == 1 and loader.skipped == 0
    # Crops and flips are drawn per sample in the workers: the same stream with a worker process, and with the
    # decoding moved to the device (the same libjpeg on a CPU).
    for pipeline, workers in (("gpu_augment", 1), ("gpu_decode", 1)):
        other = build_train_loader(RobustImageFolder(mock_root), num_workers=workers, pipeline=pipeline, **kw)
        for (xa, ya), (xb, yb) in zip(batches, (b for _, b in zip(range(7), other))):
            torch.testing.assert_close(xa, xb)
            torch.testing.assert_close(ya, yb)


def test_cpu_transforms_are_refused_with_device_decoding(mock_root):
    with pytest.raises(ValueError, match="auto_augment and color_jitter"):
        build_train_loader(RobustImageFolder(mock_root), batch_size=8, image_size=24, device="cpu",
                           num_workers=0, pipeline="gpu_augment")  # colour jitter at timm's default
    from gallery_lib.recipes.profiles import base_config

    with pytest.raises(ConfigError, match="image_pipeline='gpu_decode' crops and flips on the GPU"):
        base_config("smoke", model="resnet_micro", image_pipeline="gpu_decode", auto_augment="rand-m9-mstd0.5")


@pytest.mark.gpu
def test_gpu_pipelines_match_the_cpu_device(mock_root):
    """Both pipelines on the GPU (nvjpeg for gpu_decode) against the same crops finished on the CPU."""
    folder = RobustImageFolder(mock_root)
    for decode_in_worker in (True, False):
        samples = [EncodedImageFolder(folder, decode_in_worker)[i] for i in range(16)]
        cpu, cpu_labels = DeviceBatches(folder, image_size=24, device="cpu")(collate_encoded(samples))
        gpu, gpu_labels = DeviceBatches(folder, image_size=24, device="cuda")(collate_encoded(samples))
        assert gpu.is_cuda and torch.equal(gpu_labels.cpu(), cpu_labels)
        difference = (gpu.cpu() - cpu).abs().mean().item()
        # a wrong crop differs by tens; nvjpeg's chroma upsampling differs from libjpeg-turbo's (3.6 on an H100)
        assert difference < (2.0 if decode_in_worker else 6.0), (decode_in_worker, difference)
