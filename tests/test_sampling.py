"""Sample grids from trained runs: one row per run, the same prompts and starting noise in every row."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gallery_lib.families import stable_diffusion as sd
from gallery_lib.models.sd_parts import assemble_pipeline
from gallery_lib.reports.sampling import compare_samples

PROMPTS = ["a red circle", "a blue square on a white background"]


def _pixels(figure) -> list[np.ndarray]:
    return [np.asarray(ax.images[0].get_array()) for ax in figure.axes if ax.images]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three run folders: two with the same exported UNet, one with a changed one, and one that exported nothing."""
    root = tmp_path_factory.mktemp("output")
    torch.manual_seed(0)
    parts = sd.build_stable_diffusion("sd_tiny")
    changed = copy.deepcopy(parts.unet)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for name, unet in (("baseline", parts.unet), ("compiled", parts.unet), ("accelerated", changed)):
        assemble_pipeline(parts, unet=unet).save_pretrained(root / name / "pipeline")
    (root / "unexported").mkdir()
    return root


def test_rows_share_their_starting_noise_so_only_the_weights_differ(runs, tmp_path):
    grid = compare_samples([runs / "baseline", runs / "compiled", runs / "accelerated", runs / "unexported"],
                           PROMPTS, steps=2, size=32, save_to=tmp_path / "samples.png")
    images = _pixels(grid)
    assert len(images) == 3 * len(PROMPTS)
    baseline, compiled, accelerated = images[:2], images[2:4], images[4:]
    assert all(np.array_equal(a, b) for a, b in zip(baseline, compiled))  # same weights, same seed: same pictures
    assert all(not np.array_equal(a, b) for a, b in zip(baseline, accelerated))
    assert not np.array_equal(baseline[0], baseline[1])  # the prompts (and their noise) differ along a row
    titles = [ax.get_title() for ax in grid.axes if ax.images]
    assert titles[0].startswith("baseline: a red circle") and titles[4].startswith("accelerated")
    assert "no exported pipeline: unexported" in grid.get_suptitle()
    assert (tmp_path / "samples.png").stat().st_size > 1000


def test_no_pipeline_at_all_is_a_clear_error(runs):
    with pytest.raises(FileNotFoundError, match="export_model=True"):
        compare_samples([runs / "unexported"], PROMPTS, steps=1, size=32)
    with pytest.raises(ValueError, match="at least one prompt"):
        compare_samples([runs / "baseline"], [], steps=1)


def test_a_grid_from_random_weights_says_so_above_its_images(runs, tmp_path):
    """A smoke run trains from random weights for a few steps: the grid says so in its title, and the title sits
    above the first row's images and their prompts instead of over them."""
    import shutil

    from gallery_lib import base_config

    run_dir = tmp_path / "baseline"
    shutil.copytree(runs / "baseline" / "pipeline", run_dir / "pipeline")
    base_config("smoke", family="stable_diffusion", device="cpu").save(run_dir / "config.json")
    grid = compare_samples([run_dir, runs / "compiled"], PROMPTS, steps=1, size=32, save_to=tmp_path / "s.png")
    title = grid.get_suptitle()
    assert "random weights (no pretrained model) trained for 12 steps in the smoke profile" in title
    assert "not what a model learned" in title
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(grid)
    canvas.draw()  # lays the figure out as savefig does
    renderer = canvas.get_renderer()
    title_bottom = grid._suptitle.get_window_extent(renderer).y0
    assert all(ax.get_tightbbox(renderer).y1 <= title_bottom for ax in grid.axes if ax.images)


def test_the_random_weights_note_is_left_out_for_pretrained_weights_trained_in_full():
    from gallery_lib.reports.sampling import random_weights_note

    assert random_weights_note([{"pretrained": "/models/sd15", "profile": "full", "steps": 100}]) == ""
    assert random_weights_note([{}]) == ""  # a run folder without its config.json: nothing known, nothing said
    said = random_weights_note([{"pretrained": "/models/sd15", "profile": "smoke", "steps": 4}])
    assert said.startswith("pretrained weights trained for 4 steps in the smoke profile")
