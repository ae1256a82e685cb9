"""Tests of the ImageNet-like mock dataset generator (data_prep/imagenet_like.py)."""

import json
import random
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image
from timm.loss import SoftTargetCrossEntropy

from data_prep import make_imagenet_like
from data_prep.imagenet_like import class_names, main
from gallery_lib.data import RobustImageFolder, build_train_loader

TINY = dict(num_classes=3, train_per_class=4, val_per_class=2, image_size=32, progress=False)


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.JPEG"))}


def test_layout_and_counts(tmp_path):
    root = make_imagenet_like(tmp_path / "ds", **TINY)
    assert root == tmp_path / "ds"
    for split, per_class in (("train", 4), ("val", 2)):
        classes = sorted(p.name for p in (root / split).iterdir())
        assert classes == ["n0000", "n0001", "n0002"]
        for name in classes:
            files = sorted((root / split / name).iterdir())
            assert len(files) == per_class
            assert all(f.suffix == ".JPEG" for f in files)
            with Image.open(files[0]) as img:
                assert img.format == "JPEG" and img.mode == "RGB" and img.size == (32, 32)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["params"] == {"num_classes": 3, "train_per_class": 4, "val_per_class": 2, "image_size": 32,
                                  "seed": 0}
    assert len(manifest["files"]) == 3 * (4 + 2)


def test_class_names_sort_in_label_order():
    for n in (3, 11, 10001):
        names = class_names(n)
        assert names == sorted(names) and len(set(names)) == n


def test_deterministic_bytes(tmp_path):
    a = _files(make_imagenet_like(tmp_path / "a", seed=5, **TINY))
    b = _files(make_imagenet_like(tmp_path / "b", seed=5, **TINY))
    c = _files(make_imagenet_like(tmp_path / "c", seed=6, **TINY))
    assert a == b
    assert a.keys() == c.keys()
    assert sum(a[k] != c[k] for k in a) == len(a)  # every picture depends on the seed


def test_second_call_reuses_files(tmp_path):
    root = make_imagenet_like(tmp_path / "ds", **TINY)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    start = time.perf_counter()
    make_imagenet_like(root, **TINY)
    assert time.perf_counter() - start < 0.5
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == stamps


def test_changed_params_regenerate_and_keep_user_files(tmp_path):
    root = make_imagenet_like(tmp_path / "ds", **TINY)
    user_files = [root / "README.md", root / "train" / "n0002" / "notes.txt", root / "train" / "mine.txt"]
    for f in user_files:
        f.write_text("user data")
    make_imagenet_like(root, **{**TINY, "num_classes": 2, "train_per_class": 3})
    assert all(f.read_text() == "user data" for f in user_files)
    assert sorted(p.name for p in (root / "val").iterdir()) == ["n0000", "n0001"]  # n0002 removed: it was empty
    assert list((root / "train" / "n0002").iterdir()) == [root / "train" / "n0002" / "notes.txt"]
    assert len(list((root / "train" / "n0000").glob("*.JPEG"))) == 3
    assert json.loads((root / "manifest.json").read_text())["params"]["num_classes"] == 2


def test_missing_file_or_interrupted_run_is_regenerated(tmp_path):
    root = make_imagenet_like(tmp_path / "ds", **TINY)
    reference = _files(root)
    victim = next(iter(root.rglob("*.JPEG")))
    victim.unlink()
    make_imagenet_like(root, **TINY)
    assert _files(root) == reference

    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    stamp = victim.stat().st_mtime_ns
    time.sleep(0.01)
    make_imagenet_like(root, **TINY)
    assert victim.stat().st_mtime_ns != stamp
    assert json.loads((root / "manifest.json").read_text())["complete"] is True


def test_refuses_to_write_into_foreign_dataset(tmp_path):
    real = tmp_path / "imagenet" / "train" / "n01440764"
    real.mkdir(parents=True)
    (real / "real.JPEG").write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="did not write"):
        make_imagenet_like(tmp_path / "imagenet", **TINY)
    assert (real / "real.JPEG").read_bytes() == b"not ours"


@pytest.mark.parametrize("bad, match", [
    (dict(num_classes=0), "num_classes must be >= 1"),
    (dict(train_per_class=-2), "train_per_class must be >= 1"),
    (dict(val_per_class=0), "val_per_class must be >= 1"),
    (dict(image_size=15), "image_size must be >= 16"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(num_classes=2.5), "num_classes must be an integer"),
    (dict(image_size=True), "image_size must be an integer"),
])
def test_bad_arguments(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make_imagenet_like(tmp_path / "ds", **{**TINY, **bad})
    assert not (tmp_path / "ds").exists()


def test_cli(tmp_path, capsys):
    main(["--root", str(tmp_path / "ds"), "--num-classes", "2", "--train-per-class", "2", "--val-per-class", "1",
          "--image-size", "16", "--seed", "3", "--no-progress"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "ds")
    assert len(list((tmp_path / "ds").rglob("*.JPEG"))) == 6
    with pytest.raises(SystemExit) as exc:
        main(["--root", str(tmp_path / "bad"), "--image-size", "8"])
    assert exc.value.code == 2
    assert "image_size must be >= 16" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.imagenet_like", "--root", str(tmp_path / "ds"), "--num-classes", "2",
         "--train-per-class", "1", "--val-per-class", "1", "--image-size", "16", "--no-progress"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr
    assert len(list((tmp_path / "ds").rglob("*.JPEG"))) == 4


def test_smoke_set_is_fast(tmp_path):
    start = time.perf_counter()
    make_imagenet_like(tmp_path / "ds", num_classes=10, train_per_class=32, val_per_class=8, image_size=64,
                       progress=False)
    assert time.perf_counter() - start < 5.0


def test_a_small_model_learns_it(tmp_path):
    """The class signature is learnable: a tiny CNN's loss falls clearly within 40 steps."""
    root = make_imagenet_like(tmp_path / "ds", num_classes=4, train_per_class=16, val_per_class=1, image_size=32,
                              progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only spin, 100x slower on a busy 2-core machine
    try:
        losses = _train_tiny_cnn(root, steps=40)
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 1.2, losses  # starts near chance, ln(4) = 1.39
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.6 * first, losses  # measured: 1.29 -> 0.39


def _train_tiny_cnn(root, steps):
    torch.manual_seed(0)
    random.seed(0)  # timm's crops draw from `random` when decoding in the main process
    loader = build_train_loader(RobustImageFolder(root), batch_size=16, image_size=32, device="cpu", num_workers=0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = SoftTargetCrossEntropy()
    losses = []
    for _, (x, y) in zip(range(steps), loader):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _prepare_in_a_process(root, barrier, queue):
    barrier.wait()  # both processes start writing at once
    make_imagenet_like(root, num_classes=6, train_per_class=20, val_per_class=4, image_size=48, progress=False)
    queue.put((root / "manifest.json").stat().st_mtime_ns)


def test_two_processes_preparing_one_dataset_write_it_once(tmp_path):
    """Two notebooks preparing the same data at once: the second waits for the first and reuses its files."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    root = tmp_path / "shared"
    workers = [ctx.Process(target=_prepare_in_a_process, args=(root, barrier, queue)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert queue.get() == queue.get()  # the manifest was written once, not rewritten by the second process
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["files"]) == 6 * (20 + 4)
    assert all((root / rel).is_file() for rel in manifest["files"])
