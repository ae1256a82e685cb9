"""Tests of the caption mock-data generator (data_prep/captions.py) and the CaptionFolder dataset."""

import io
import json
import logging
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from data_prep import make_caption_folder, make_imagenet_like
from data_prep.captions import COLOURS, caption_vocabulary, main
from gallery_lib.data import CaptionFolder, caption_image_transform, load_rgb

TINY = dict(num_images=6, image_size=32, progress=False)
_PALETTE = np.array(list(COLOURS.values()), dtype=np.int32)
_NAMES = list(COLOURS)


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted((root / "train").iterdir())}


def _metadata(root):
    return [json.loads(line) for line in (root / "train" / "metadata.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------------------
# Generator


def test_layout_metadata_and_manifest(tmp_path):
    root = make_caption_folder(tmp_path / "ds", num_images=10, image_size=40, progress=False)
    assert root == tmp_path / "ds"
    rows = _metadata(root)
    assert len(rows) == 10 and all(set(r) == {"file_name", "text"} for r in rows)
    pngs = sorted(p.name for p in (root / "train").glob("*.png"))
    assert [r["file_name"] for r in rows] == pngs
    for r in rows:
        with Image.open(root / "train" / r["file_name"]) as img:
            assert img.format == "PNG" and img.mode == "RGB" and img.size == (40, 40)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["params"] == {"num_images": 10, "image_size": 40, "seed": 0}
    assert sorted(manifest["files"]) == sorted([f"train/{n}" for n in pngs] + ["train/metadata.jsonl"])
    vocabulary = set(caption_vocabulary())
    for r in rows:
        assert set(r["text"].split()) <= vocabulary, r["text"]
        assert re.fullmatch(r"an? .+ on an? \w+ background", r["text"]), r["text"]


def _parse(caption):
    """(background colour, [(size, colour, shape, position words)]) of a generated caption."""
    body, background = re.fullmatch(r"(.+) on an? (\w+) background", caption).groups()
    objects = []
    for phrase in body.split(" and "):
        words = phrase.split()[1:]  # drop the article
        size = words.pop(0) if words[0] in ("small", "large") else ""
        objects.append((size, words[0], words[1], set(words[2:])))
    return background, objects


def _shape_of(mask):
    """Names the shape in a boolean mask from its fill ratio and the width of its rows."""
    rows, cols = np.nonzero(mask)
    crop = mask[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    h, w = crop.shape
    fill = crop.mean()
    if fill > 0.9:
        return "square"
    if 0.7 < fill < 0.85:
        return "circle"
    top, low = crop[int(0.15 * h)].mean(), crop[int(0.75 * h)].mean()
    if top > 0.25 and abs(top - low) < 0.1:
        return "cross"  # the vertical bar: the same width high and low
    return "triangle" if low > 0.62 else "diamond"


def test_captions_describe_the_pixels(tmp_path):
    """Every named colour, shape and position is checked against the picture, never only against the string."""
    size = 96
    root = make_caption_folder(tmp_path / "ds", num_images=48, image_size=size, seed=1, progress=False)
    seen_shapes, two_shapes = set(), 0
    for row in _metadata(root):
        pixels = np.asarray(Image.open(root / "train" / row["file_name"]), dtype=np.int32)
        nearest = np.argmin(((pixels[:, :, None, :] - _PALETTE) ** 2).sum(-1), axis=-1)  # H x W colour index
        background, objects = _parse(row["text"])
        counts = np.bincount(nearest.ravel(), minlength=len(_NAMES))
        assert _NAMES[counts.argmax()] == background, row
        drawn = {_NAMES[k] for k in np.nonzero(counts > 0.005 * size * size)[0]} - {background}
        assert drawn == {colour for _, colour, _, _ in objects}, row
        two_shapes += len(objects) == 2
        for size_word, colour, shape, where in objects:
            if sum(c == colour for _, c, _, _ in objects) > 1:
                continue  # two shapes of one colour: their pixels cannot be told apart
            mask = nearest == _NAMES.index(colour)
            ys, xs = np.nonzero(mask)
            row_third = 0 if "top" in where else 2 if "bottom" in where else 1
            col_third = 0 if "left" in where else 2 if "right" in where else 1
            assert int(3 * ys.mean() / size) == row_third and int(3 * xs.mean() / size) == col_third, (row, colour)
            side = max(ys.max() - ys.min(), xs.max() - xs.min()) + 1  # bounding box: the drawn side for every shape
            nominal = {"small": 0.24, "": 0.36, "large": 0.6}[size_word] * size  # drawn at 0.9x to 1.1x, +1 px edge
            assert 0.9 * nominal - 1 <= side <= 1.1 * nominal + 2, (row, colour, side)
            if len(objects) == 1:
                assert _shape_of(mask) == shape, row
                seen_shapes.add(shape)
    assert seen_shapes == {"circle", "square", "triangle", "diamond", "cross"} and two_shapes >= 5


def test_deterministic_bytes(tmp_path):
    a = _files(make_caption_folder(tmp_path / "a", seed=5, **TINY))
    b = _files(make_caption_folder(tmp_path / "b", seed=5, **TINY))
    c = _files(make_caption_folder(tmp_path / "c", seed=6, **TINY))
    assert a == b
    assert a.keys() == c.keys()
    assert sum(a[k] != c[k] for k in a if k.endswith(".png")) == len(a) - 1  # every picture depends on the seed


def test_second_call_reuses_files(tmp_path):
    root = make_caption_folder(tmp_path / "ds", **TINY)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    start = time.perf_counter()
    assert make_caption_folder(root, **TINY) == root
    assert time.perf_counter() - start < 0.5
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == stamps


def test_changed_params_regenerate_and_keep_user_files(tmp_path):
    root = make_caption_folder(tmp_path / "ds", **TINY)
    before = _files(root)
    user_files = [root / "README.md", root / "train" / "notes.txt"]
    for f in user_files:
        f.write_text("user data")
    make_caption_folder(root, **{**TINY, "num_images": 4, "image_size": 24})
    assert all(f.read_text() == "user data" for f in user_files)
    assert sorted(p.name for p in (root / "train").glob("*.png")) == [f"{i:05d}.png" for i in range(4)]
    assert len(_metadata(root)) == 4
    after = _files(root)
    assert all(after[k] != before[k] for k in after if k.endswith(".png"))  # rewritten at the new size
    with Image.open(root / "train" / "00000.png") as img:
        assert img.size == (24, 24)
    assert json.loads((root / "manifest.json").read_text())["params"]["num_images"] == 4


def test_missing_file_is_regenerated(tmp_path):
    root = make_caption_folder(tmp_path / "ds", **TINY)
    reference = _files(root)
    (root / "train" / "00003.png").unlink()
    make_caption_folder(root, **TINY)
    assert _files(root) == reference


def test_refuses_foreign_data(tmp_path):
    real = tmp_path / "real" / "train"
    real.mkdir(parents=True)
    (real / "metadata.jsonl").write_text('{"file_name": "cat.png", "text": "a cat"}\n')
    with pytest.raises(FileExistsError, match="did not write"):
        make_caption_folder(tmp_path / "real", **TINY)
    assert (real / "metadata.jsonl").read_text() == '{"file_name": "cat.png", "text": "a cat"}\n'
    assert not (tmp_path / "real" / "manifest.json").exists()
    other = make_imagenet_like(tmp_path / "other", num_classes=1, train_per_class=1, val_per_class=1, image_size=16,
                               progress=False)
    with pytest.raises(ValueError, match="was not written by data_prep.captions"):
        make_caption_folder(other, **TINY)


@pytest.mark.parametrize("bad, match", [
    (dict(num_images=0), "num_images must be >= 1"),
    (dict(image_size=8), "image_size must be >= 16"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(num_images=2.0), "num_images must be an integer"),
])
def test_bad_arguments(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make_caption_folder(tmp_path / "ds", **{**TINY, **bad})
    assert not (tmp_path / "ds").exists()


def test_cli_and_module_entry_point(tmp_path, capsys):
    main(["--root", str(tmp_path / "ds"), "--num-images", "3", "--image-size", "16", "--seed", "2", "--no-progress"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "ds")
    assert len(_metadata(tmp_path / "ds")) == 3
    with pytest.raises(SystemExit) as exc:
        main(["--root", str(tmp_path / "bad"), "--num-images", "0"])
    assert exc.value.code == 2 and "num_images must be >= 1" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "data_prep.captions", "--root", str(tmp_path / "m"), "--num-images",
                           "2", "--image-size", "16", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    assert len(list((tmp_path / "m" / "train").glob("*.png"))) == 2


def test_large_images_are_fast(tmp_path):
    # 512 images of 512 px take ~6 s here; this eighth of them must stay far below the one-minute budget.
    start = time.perf_counter()
    make_caption_folder(tmp_path / "ds", num_images=64, image_size=512, progress=False)
    assert time.perf_counter() - start < 6.0


# ----------------------------------------------------------------------------------------------------------------
# CaptionFolder


@pytest.fixture(scope="module")
def caption_root(tmp_path_factory):
    return make_caption_folder(tmp_path_factory.mktemp("captions"), num_images=12, image_size=32, progress=False)


def test_samples_and_captions(caption_root):
    rows = _metadata(caption_root)
    ds = CaptionFolder(caption_root)
    assert len(ds) == 12 and ds.captions == [r["text"] for r in rows]
    assert ds.folder == caption_root / "train"
    img, meta = ds[5]
    assert meta == {"text": rows[5]["text"], "index": 5}
    assert np.array_equal(np.asarray(img), np.asarray(Image.open(caption_root / "train" / rows[5]["file_name"])))
    assert ds.skipped == 0 and ds.loads == 1


def test_transform_output(caption_root):
    ds = CaptionFolder(caption_root, transform=caption_image_transform(24, center_crop=False, random_flip=True))
    x, _ = ds[0]
    assert x.shape == (3, 24, 24) and x.dtype == torch.uint8


def test_transform_resizes_short_side_then_crops():
    stripes = np.zeros((20, 60, 3), np.uint8)
    stripes[:, :20] = (255, 0, 0)
    stripes[:, 20:40] = (0, 255, 0)
    stripes[:, 40:] = (0, 0, 255)
    img = Image.fromarray(stripes)
    x = caption_image_transform(10)(img)  # 60x20 -> 30x10, centre 10x10 is the green stripe
    assert x.shape == (3, 10, 10) and (x[1] > 200).all() and (x[0] < 60).all() and (x[2] < 60).all()
    torch.manual_seed(0)
    crops = [caption_image_transform(10, center_crop=False)(img) for _ in range(40)]
    assert all(c.shape == (3, 10, 10) for c in crops)
    # The crop moves: some show red at their left edge, some blue at their right edge (the centre crop shows neither).
    assert any((c[0, :, 0] > 200).all() for c in crops) and any((c[2, :, -1] > 200).all() for c in crops)
    halves = Image.fromarray(np.concatenate([np.full((8, 4, 3), 255, np.uint8), np.zeros((8, 4, 3), np.uint8)], 1))
    flips = [caption_image_transform(8, random_flip=True)(halves)[0, 0, 0].item() for _ in range(40)]
    assert set(flips) == {0, 255}
    assert {caption_image_transform(8)(halves)[0, 0, 0].item() for _ in range(10)} == {255}
    with pytest.raises(ValueError, match="resolution must be a positive integer"):
        caption_image_transform(0)


def _write_folder(folder, rows, images=()):
    folder.mkdir(parents=True, exist_ok=True)
    for name in images:
        Image.new("RGB", (12, 10), (10 * len(name), 40, 90)).save(folder / name)
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_list_captions_and_root_without_split(tmp_path):
    options = ["a red circle", "a circle in red", "red round thing"]
    _write_folder(tmp_path, [{"file_name": "a.png", "text": options}, {"file_name": "sub/b.png", "text": ""}],
                  ["a.png"])
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "sub" / "b.png")
    ds = CaptionFolder(tmp_path)  # no train/ folder: metadata.jsonl in the root
    assert ds.folder == tmp_path and ds.captions == [options, ""]
    assert ds[1][1]["text"] == ""  # the unconditional caption is valid
    random.seed(3)
    first = [ds[0][1]["text"] for _ in range(30)]
    random.seed(3)
    assert [ds[0][1]["text"] for _ in range(30)] == first  # the pick follows python's `random`
    assert set(first) == set(options)


BAD_ROWS = {1: "missing.png", 3: "truncated.png", 4: "text.png"}  # 3 and 4 are neighbours


@pytest.fixture()
def messy_captions(tmp_path):
    folder = tmp_path / "train"
    rows = [{"file_name": BAD_ROWS.get(i, f"good_{i}.png"), "text": f"caption {i}"} for i in range(8)]
    _write_folder(folder, rows, [r["file_name"] for i, r in enumerate(rows) if i not in BAD_ROWS])
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    (folder / "truncated.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (folder / "text.png").write_text("this is not an image\n")
    return tmp_path


def test_bad_files_are_skipped_counted_and_replaced(messy_captions, caplog):
    ds = CaptionFolder(messy_captions, transform=caption_image_transform(8))
    folder = messy_captions / "train"
    with caplog.at_level(logging.WARNING):
        x, meta = ds[1]
        assert meta == {"text": "caption 2", "index": 2} and x.shape == (3, 8, 8)
        assert ds[3][1] == {"text": "caption 5", "index": 5}  # two bad files in a row
        assert ds.skipped == 3 and ds.loads == 5
    assert ds.skipped_paths == [folder / "missing.png", folder / "truncated.png", folder / "text.png"]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped sample")]
    assert len(logged) == 3 and all(f"({p})" in m for p, m in zip(ds.skipped_paths, logged))
    assert np.array_equal(x.permute(1, 2, 0).numpy(), np.asarray(load_rgb(folder / "good_2.png").resize((8, 8))))


def test_dataloader_workers_share_the_counts(messy_captions):
    ds = CaptionFolder(messy_captions, transform=caption_image_transform(8))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, shuffle=False)
    batches = list(loader)
    x, meta = batches[0]
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.uint8
    assert isinstance(meta["text"], list) and all(isinstance(t, str) for t in meta["text"])
    assert meta["index"].dtype == torch.int64 and meta["index"].tolist() == [0, 2, 2, 5]
    assert batches[1][1]["index"].tolist() == [5, 5, 6, 7]
    assert ds.skipped == 1 + 2 + 1 and ds.loads == 8 + 4  # counted in the workers, read in the main process


def test_spawned_worker_shares_the_counts(messy_captions):
    # forkserver is the Linux default from Python 3.14: the dataset and its shared counters must pickle to a worker.
    ds = CaptionFolder(messy_captions, transform=caption_image_transform(8))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn")
    (x, meta), = list(loader)
    assert x.shape == (8, 3, 8, 8) and meta["text"][3] == "caption 5"
    assert ds.skipped == 4 and len(ds.skipped_paths) == 4


def test_consecutive_failure_limit_and_bad_fraction(tmp_path):
    rows = [{"file_name": f"{i}.png", "text": "x"} for i in range(60)]
    good = [f"{i}.png" for i in range(60) if i % 5 == 0]  # 80% missing, at most 4 in a row
    _write_folder(tmp_path / "train", rows, good)
    ds = CaptionFolder(tmp_path, max_consecutive_errors=3)
    with pytest.raises(RuntimeError, match="3 consecutive samples") as exc:
        ds[1]
    assert "train/3.png" in str(exc.value) and "metadata.jsonl" in str(exc.value) and "sd_tiny" in str(exc.value)
    assert ds.loads == ds.skipped == 3  # stopped at the limit, 4.png never tried
    ds = CaptionFolder(tmp_path)
    for i in range(len(ds)):
        ds[i]
    assert ds.loads == 12 * (1 + 5 + 4 + 3 + 2) and ds.skipped == ds.loads - 60  # per block of 5: the good file, then
    # the four bad ones each try the files up to the next good one (wrapping from 59 to 0)
    ds.check_bad_fraction(0.9)
    with pytest.raises(RuntimeError, match=r"120 of 180 image loads .*more than max_bad_fraction=0\.5") as exc:
        ds.check_bad_fraction(0.5)
    assert str(tmp_path / "train") in str(exc.value) and "their lines in metadata.jsonl" in str(exc.value)


@pytest.mark.parametrize("lines, error, match", [
    (['{"file_name": "a.png", "text": "x"}', "{not json", ""], ValueError, r"line 2 is not valid JSON"),
    (['{"file_name": "a.png", "text": "x"}', "", '{"file_name": "b.png"}'], ValueError,
     r"line 3 lacks the column\(s\) \['text'\]; it has \['file_name'\]"),
    (['{"image": "a.png", "text": "x"}'], ValueError, r"line 1 lacks the column\(s\) \['file_name'\]"),
    (['["a.png", "x"]'], ValueError, "line 1 is a JSON list"),
    (['{"file_name": "a.png", "text": 3}'], ValueError, r"line 1: 'text' must be a string or a non-empty list"),
    (['{"file_name": "a.png", "text": []}'], ValueError, r"line 1: 'text' must be a string"),
    (['{"file_name": "/etc/a.png", "text": "x"}'], ValueError, r"line 1: 'file_name' must be a non-empty path"),
    (["", "  "], ValueError, "lists no images"),
])
def test_bad_metadata_names_the_line(tmp_path, lines, error, match):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(error, match=match) as exc:
        CaptionFolder(tmp_path)
    assert str(tmp_path / "train" / "metadata.jsonl") in str(exc.value)


def test_other_column_names(tmp_path):
    _write_folder(tmp_path / "train", [{"image": "a.png", "caption": "hi"}], ["a.png"])
    ds = CaptionFolder(tmp_path, image_column="image", caption_column="caption")
    assert ds[0][1] == {"text": "hi", "index": 0}


def test_missing_folders_and_metadata(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as exc:
        CaptionFolder(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(exc.value) and "gallery prepare --model sd_tiny" in str(exc.value)
    (tmp_path / "train").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "a.png")
    with pytest.raises(FileNotFoundError, match="metadata.jsonl does not exist") as exc:
        CaptionFolder(tmp_path)
    assert str(tmp_path / "train" / "metadata.jsonl") in str(exc.value) and "data_dir" in str(exc.value)
    with pytest.raises(FileNotFoundError, match="Neither") as exc:
        CaptionFolder(tmp_path, split="val")
    assert str(tmp_path / "val" / "metadata.jsonl") in str(exc.value)
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        CaptionFolder(tmp_path, max_consecutive_errors=0)
