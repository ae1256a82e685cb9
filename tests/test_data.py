"""Tests of the image data pipeline: RobustImageFolder (bad files, odd modes, shared skip count) and the loader."""

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision.transforms import functional as TF

from data_prep import make_imagenet_like
from gallery_lib.data import RobustImageFolder, build_train_loader, load_rgb

# ----------------------------------------------------------------------------------------------------------------
# Fixture folder: good JPEGs, odd-but-valid images and broken files (3 of 49 = 6%).


def _noisy(seed, size=(24, 20)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _jpeg_bytes(img, **kw):
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


BAD = ("a/zz_0_truncated.jpg", "a/zz_1_zero.jpg", "b/text.jpg")  # the first two are neighbours in scan order


@pytest.fixture(scope="module")
def messy_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("messy")
    split = root / "train"
    for k, cls in enumerate("abc"):
        (split / cls).mkdir(parents=True)
        for i in range(14 if cls != "c" else 12):
            _noisy(100 * k + i).save(split / cls / f"img_{i:02d}.JPEG", quality=90)
    # Broken files.
    big = _jpeg_bytes(_noisy(7, (96, 96)), quality=95)
    (split / BAD[0]).write_bytes(big[: len(big) // 2])
    (split / BAD[1]).write_bytes(b"")
    (split / BAD[2]).write_text("this is not an image\n")
    # Valid files in odd modes.
    Image.new("CMYK", (20, 16), (0, 255, 255, 0)).save(split / "a" / "cmyk.jpg")
    rgba = Image.new("RGBA", (16, 16), (255, 0, 0, 255))
    rgba.paste((0, 0, 255, 0), (0, 0, 8, 16))  # left half fully transparent blue
    rgba.save(split / "b" / "rgba.png")
    pal = Image.new("P", (16, 16), 1)
    pal.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    pal.paste(0, (0, 0, 8, 16))  # left half uses the transparent index
    pal.save(split / "b" / "palette.png", transparency=0)
    la = Image.new("LA", (16, 16), (50, 255))
    la.paste((50, 0), (0, 0, 8, 16))
    la.save(split / "c" / "la.png")
    Image.fromarray(np.full((16, 16), 30000, dtype=np.uint16)).save(split / "c" / "deep16.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    _noisy(3, (40, 20)).save(split / "c" / "rotated.jpg", exif=exif)
    # Ignored: hidden files, hidden folders, non-image extensions.
    (split / "a" / ".DS_Store").write_bytes(b"\0\1")
    (split / "a" / "._img_00.JPEG").write_bytes(b"\0\1")
    (split / "a" / "notes.txt").write_text("ignored")
    (split / ".cache").mkdir()
    _noisy(1).save(split / ".cache" / "x.jpg")
    return root


def _expected_skips(ds, bad_paths):
    """Failed loads when every index is read once: index i fails for each bad file in the run starting at i."""
    bad = [path.relative_to(ds.root / ds.split).as_posix() in bad_paths for path, _ in ds.samples]
    total = 0
    for i in range(len(bad)):
        k = i
        while bad[k % len(bad)]:
            total += 1
            k += 1
    return total


def _to_tensor_16(img):
    return TF.pil_to_tensor(img.resize((16, 16)))


def test_scan(messy_root):
    ds = RobustImageFolder(messy_root, "train")
    assert ds.classes == ["a", "b", "c"] and ds.num_classes == 3
    assert ds.class_to_idx == {"a": 0, "b": 1, "c": 2}
    assert len(ds) == 14 + 14 + 12 + 3 + 6 == 49
    names = {p.name for p, _ in ds.samples}
    assert not any(n.startswith(".") for n in names) and "notes.txt" not in names and "x.jpg" not in names
    assert all(label == ds.class_to_idx[p.parent.name] for p, label in ds.samples)


def test_every_sample_is_rgb_and_skips_are_counted(messy_root, caplog):
    ds = RobustImageFolder(messy_root, "train", transform=_to_tensor_16)
    with caplog.at_level(logging.WARNING, logger="gallery_lib.data.image_folder"):
        for i in range(len(ds)):
            x, label = ds[i]
            assert x.shape == (3, 16, 16) and x.dtype == torch.uint8
            assert 0 <= label < 3
    assert ds.skipped == _expected_skips(ds, BAD) == 4  # the two neighbours: 2 failed loads, then 1, plus 1
    bad_paths = {str(messy_root / "train" / b) for b in BAD}
    skipped_logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped sample")]
    assert len(skipped_logs) == 4
    assert all(any(f"({p})" in m for p in bad_paths) for m in skipped_logs)
    assert {str(p) for p in ds.skipped_paths} == bad_paths


def test_bad_sample_is_replaced_by_the_next(messy_root):
    ds = RobustImageFolder(messy_root, "train")
    i = next(k for k, (p, _) in enumerate(ds.samples) if p.name == "zz_0_truncated.jpg")
    img, label = ds[i]
    next_good = ds.samples[i + 2]
    assert np.array_equal(np.asarray(img), np.asarray(load_rgb(next_good[0]))) and label == next_good[1]


def test_skip_count_through_dataloader_workers(messy_root):
    ds = RobustImageFolder(messy_root, "train", transform=_to_tensor_16)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=False)
    images = torch.cat([x for x, _ in loader])
    assert images.shape == (49, 3, 16, 16)
    assert ds.skipped == _expected_skips(ds, BAD) == 4  # counted in the workers, read in the main process


def test_skip_count_through_spawned_worker(messy_root):
    # Python 3.14 makes forkserver the Linux default; the shared counter must survive being pickled to a worker.
    ds = RobustImageFolder(messy_root, "train", transform=_to_tensor_16)
    loader = torch.utils.data.DataLoader(ds, batch_size=25, num_workers=1, multiprocessing_context="spawn")
    assert sum(len(x) for x, _ in loader) == 49
    assert ds.skipped == 4
    assert len(ds.skipped_paths) == 4


def test_odd_modes(messy_root):
    split = messy_root / "train"
    cmyk = np.asarray(load_rgb(split / "a" / "cmyk.jpg")).astype(int)
    assert np.abs(cmyk[8, 10] - [255, 0, 0]).max() < 40  # CMYK red stays red
    for path, opaque in (("b/rgba.png", [255, 0, 0]), ("b/palette.png", [0, 200, 0]), ("c/la.png", [50, 50, 50])):
        img = load_rgb(split / path)
        assert img.mode == "RGB"
        px = np.asarray(img)
        assert (px[:, :8] == 255).all(), f"{path}: transparent part must be white"
        assert (px[:, 8:] == opaque).all(), path
    deep = np.asarray(load_rgb(split / "c" / "deep16.png"))
    assert (deep == round(30000 / 257)).all()  # scaled to 8 bit, not clipped to 255
    rotated = load_rgb(split / "c" / "rotated.jpg")
    assert rotated.size == (20, 40)  # stored 40x20 with orientation 6


def test_consecutive_failure_limit(tmp_path):
    folder = tmp_path / "broken" / "train" / "cls"
    folder.mkdir(parents=True)
    for i in range(6):
        (folder / f"bad_{i}.jpg").write_bytes(b"")
    _noisy(0).save(folder / "good.jpg")
    ds = RobustImageFolder(tmp_path / "broken", max_consecutive_errors=4)
    with pytest.raises(RuntimeError, match="4 consecutive samples") as exc:
        ds[0]
    assert "bad_3.jpg" in str(exc.value) and "gallery prepare" in str(exc.value)
    assert ds[3][1] == 0  # 3 failures, then the good file: under the limit
    everything_bad = RobustImageFolder(tmp_path / "broken")
    everything_bad.samples = everything_bad.samples[:6]
    with pytest.raises(RuntimeError, match="6 consecutive"):  # never loops past the dataset size
        everything_bad[0]


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="gallery prepare --model") as exc:
        RobustImageFolder(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(exc.value) and "--data-dir" in str(exc.value)
    (tmp_path / "ds" / "train" / "cls").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="val"):
        RobustImageFolder(tmp_path / "ds", "val")
    (tmp_path / "ds" / "train" / "cls" / "readme.txt").write_text("no images")
    with pytest.raises(FileNotFoundError, match="No images found"):
        RobustImageFolder(tmp_path / "ds", "train")


# ----------------------------------------------------------------------------------------------------------------
# Loader.


@pytest.fixture(scope="module")
def mock_root(tmp_path_factory):
    return make_imagenet_like(tmp_path_factory.mktemp("mock"), num_classes=4, train_per_class=12, val_per_class=1,
                              image_size=32, progress=False)


class IndexDataset(torch.utils.data.Dataset):
    """Label == index, so the soft targets reveal which samples a batch holds (with no smoothing or mixing)."""

    def __init__(self, n):
        self.n, self.num_classes, self.transform = n, n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.transform(Image.new("RGB", (8, 8), (i, 0, 0))), i


def _indices(batch):
    return batch[1].argmax(1).tolist()


def test_batch_shape_dtype_device_and_stats(mock_root):
    loader = build_train_loader(RobustImageFolder(mock_root), batch_size=8, image_size=24, device="cpu",
                                num_workers=0, channels_last=True)
    assert loader.steps_per_epoch == 6 and len(loader.dataset) == 48 and loader.skipped == 0
    batches = [b for _, b in zip(range(3), loader)]
    x, y = batches[0]
    assert x.shape == (8, 3, 24, 24) and x.dtype == torch.float32 and x.device.type == "cpu"
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert y.shape == (8, 4) and y.dtype == torch.float32
    allx = torch.cat([b[0] for b in batches])
    assert -1.0 < allx.mean() < 1.0 and 0.4 < allx.std() < 1.6
    assert allx.min() >= -2.2 and allx.max() <= 2.7  # (0 - mean) / std and (1 - mean) / std bounds


def test_normalisation_is_exact():
    loader = build_train_loader(IndexDataset(8), batch_size=4, image_size=8, device="cpu", num_workers=0)
    raw = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    x, _ = loader.to_device(raw, torch.arange(4))
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x, (raw.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)


def test_label_smoothing_targets_exact():
    loader = build_train_loader(IndexDataset(10), batch_size=5, image_size=8, device="cpu", num_workers=0,
                                label_smoothing=0.1)
    labels = torch.tensor([3, 0, 9, 3, 5])
    _, y = loader.to_device(torch.zeros(5, 3, 8, 8, dtype=torch.uint8), labels)
    expected = torch.full((5, 10), 0.01)
    expected[torch.arange(5), labels] = 0.91
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-7)
    _, y = next(iter(loader))
    assert ((y - 0.91).abs() < 1e-6).sum(1).tolist() == [1] * 5
    torch.testing.assert_close(y.sum(1), torch.ones(5))


def test_mixup_targets_are_soft_and_sum_to_one(mock_root):
    np.random.seed(0)  # timm Mixup draws lambda from numpy's global generator
    loader = build_train_loader(RobustImageFolder(mock_root), batch_size=8, image_size=24, device="cpu",
                                num_workers=0, mixup_alpha=1.0, cutmix_alpha=1.0, label_smoothing=0.1)
    for _, (x, y) in zip(range(4), loader):
        assert x.shape == (8, 3, 24, 24) and y.shape == (8, 4)
        torch.testing.assert_close(y.sum(1), torch.ones(8))
        assert (y > 0).all() and (y < 1).all()
    mixed = build_train_loader(IndexDataset(8), batch_size=8, image_size=8, device="cpu", num_workers=0,
                               mixup_alpha=1.0)
    _, y = next(iter(mixed))
    assert ((y > 0).sum(1) == 2).all()  # every image mixed with its mirror, all labels distinct


def test_random_erasing_on_device_after_normalise():
    plain = build_train_loader(IndexDataset(8), batch_size=4, image_size=32, device="cpu", num_workers=0)
    erased = build_train_loader(IndexDataset(8), batch_size=4, image_size=32, device="cpu", num_workers=0,
                                re_prob=1.0)
    raw = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    a, _ = plain.to_device(raw, torch.arange(4))
    b, _ = erased.to_device(raw, torch.arange(4))
    changed = (a != b).any(1).float().mean((1, 2))  # fraction of pixels erased per image
    assert ((changed > 0.01) & (changed < 0.34)).all(), changed


def test_runs_past_epochs_and_reshuffles():
    loader = build_train_loader(IndexDataset(24), batch_size=4, image_size=8, device="cpu", num_workers=2)
    assert loader.steps_per_epoch == 6
    it = iter(loader)
    epochs = []
    for _ in range(3):
        epochs.append([i for _ in range(6) for i in _indices(next(it))])
        assert loader.epoch == len(epochs) - 1
    next(it)
    assert loader.epoch == 3
    assert all(sorted(e) == list(range(24)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = build_train_loader(IndexDataset(24), batch_size=4, image_size=8, device="cpu", num_workers=0)
    assert [i for b in zip(range(6), again) for i in _indices(b[1])] == epochs[0]  # same seed, same order


def test_one_dataloader_iteration_spans_the_epochs(mock_root, monkeypatch):
    """The workers are not drained and restarted at each epoch boundary (a stall of a batch per worker)."""
    from torch.utils.data import DataLoader

    started = []
    original = DataLoader.__iter__
    monkeypatch.setattr(DataLoader, "__iter__", lambda self: (started.append(1), original(self))[1])
    loader = build_train_loader(RobustImageFolder(mock_root), batch_size=8, image_size=24, device="cpu",
                                num_workers=1)
    for _ in zip(range(3 * loader.steps_per_epoch + 1), loader):
        pass
    assert loader.epoch == 3 and loader.batches_in_epoch == 1 and len(started) == 1


def test_augmentation_does_not_depend_on_worker_count(mock_root):
    """Crops and RandAugment ops are seeded per sample, so recipes with different num_workers see the same images."""
    def batches(num_workers, n=5):
        loader = build_train_loader(RobustImageFolder(mock_root), batch_size=4, image_size=24, device="cpu",
                                    num_workers=num_workers, auto_augment="rand-m9-mstd0.5-inc1", seed=3)
        return [b[0] for _, b in zip(range(n), loader)]

    single, pooled = batches(0), batches(3)
    assert all(torch.equal(a, b) for a, b in zip(single, pooled))
    assert not torch.equal(single[0], single[4])


def test_ranks_draw_disjoint_shards():
    shards = []
    for rank in range(2):
        loader = build_train_loader(IndexDataset(26), batch_size=4, image_size=8, device="cpu", num_workers=0,
                                    world_size=2, rank=rank, seed=3)
        assert loader.steps_per_epoch == 3  # 13 per rank, 3 full batches
        shards.append({i for _, b in zip(range(3), loader) for i in _indices(b)})
    assert len(shards[0]) == len(shards[1]) == 12
    assert not shards[0] & shards[1]


def test_auto_augment_top_magnitude_posterize():
    # rand-m10-mstd0-inc1 asks posterize for 0 bits, which Pillow >= 13 rejects; the loader must survive it.
    loader = build_train_loader(IndexDataset(64), batch_size=16, image_size=16, device="cpu", num_workers=0,
                                auto_augment="rand-m10-n4-mstd0-inc1")
    for _, (x, _) in zip(range(8), loader):
        assert torch.isfinite(x).all()


@pytest.mark.parametrize("kwargs, match", [  # the config-field rules are tested in test_config.py
    (dict(batch_size=16, world_size=2), "fewer than one global batch"),
    (dict(batch_size=4, rank=2, world_size=2), "rank must be in"),
])
def test_bad_loader_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_train_loader(IndexDataset(20), image_size=8, device="cpu", num_workers=0, **kwargs)


def test_dataset_with_transform_is_refused(mock_root):
    with pytest.raises(ValueError, match="transform=None"):
        build_train_loader(RobustImageFolder(mock_root, transform=TF.pil_to_tensor), batch_size=4, image_size=8,
                           device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_batches(mock_root):
    loader = build_train_loader(RobustImageFolder(mock_root), batch_size=8, image_size=24, device="cuda",
                                num_workers=2, mixup_alpha=0.8, re_prob=0.25, channels_last=True)
    assert loader._loader.pin_memory
    for _, (x, y) in zip(range(8), loader):
        assert x.is_cuda and y.is_cuda and x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y.sum(1), torch.ones(8, device="cuda"))
    assert loader.epoch == 1


def test_loading_in_the_training_process_leaves_its_random_streams_alone(mock_root):
    """With num_workers=0 each sample is seeded in the training process; its own streams (diffusion noise,
    dropout, Python/numpy draws) must continue as if no data had been loaded."""
    import random

    import numpy as np

    loader = build_train_loader(RobustImageFolder(mock_root), batch_size=8, image_size=24, device="cpu",
                                num_workers=0)
    batches = iter(loader)

    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = draws()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    next(batches)
    assert draws() == expected
