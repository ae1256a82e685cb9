"""The timing and caching machinery ``optimize(model)`` shares with ``accelerate(model, example=...)``: step marks and
their statistics, the cache key, the cache files. ``optimize``'s own trials are tested in ``tests/test_compile.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gallery_lib.accel.optimize import cache_file, cache_key, default_cache_file, read_cache, step_stats, write_cache


def test_step_stats_time_the_steps_after_the_warm_up():
    """Marks at 0, 5 s (a compiling first step), then steps of 10, 30, 20 and 40 ms: the median of the timed ones,
    their p20 and p80, and the warm-up's time beyond a steady step."""
    seconds = [0.0, 5.0, 5.010, 5.040, 5.060, 5.100]
    stats = step_stats("eager", [(s, None) for s in seconds], warmup_steps=1)
    assert stats.name == "eager" and stats.ok
    assert stats.steady_ms == pytest.approx(25.0)
    assert stats.p20_ms == pytest.approx(16.0) and stats.p80_ms == pytest.approx(34.0)
    assert stats.compile_time_s == pytest.approx(5.0 - 0.025)


def test_the_cache_key_tells_models_of_one_class_and_size_apart():
    """The key names the class, the parameter count and a hash of the structure: a copy gets the same key, a model
    of the same class and size built otherwise (a ReLU more) another; and the input shapes are in it."""
    def mlp(act: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), *([nn.ReLU()] if act else []), nn.Linear(8, 4))

    x = torch.randn(2, 4)
    key = cache_key(mlp(False), (x,), {})
    assert key == cache_key(mlp(False), (x,), {}) and "Sequential (76 parameters, structure " in key
    assert "(2, 4):float32" in key and f"torch {torch.__version__}" in key and "| cpu |" in key
    assert key != cache_key(mlp(True), (x,), {})
    assert key != cache_key(mlp(False), (torch.randn(3, 4),), {})


def test_the_cache_files_sit_in_the_gallery_cache_dir_by_name(tmp_path):
    assert default_cache_file("accelerate.json") == Path(os.environ["GALLERY_CACHE_DIR"]) / "accelerate.json"
    assert cache_file(True, "accelerate.json") == default_cache_file("accelerate.json")
    assert cache_file(False) is None and cache_file(tmp_path / "mine.json") == tmp_path / "mine.json"
    path = tmp_path / "sub" / "choices.json"
    assert read_cache(path) == {}  # no file yet: measure
    write_cache(path, "a", {"ms": 1.0})
    write_cache(path, "b", {"ms": 2.0})
    assert read_cache(path) == {"a": {"ms": 1.0}, "b": {"ms": 2.0}}
    path.write_text("{not json")
    assert read_cache(path) == {}  # a file another version wrote, or a broken one: measure again
