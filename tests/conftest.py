"""Shared fixtures: a session-wide smoke dataset, seeding, a compile cache of the session's own, the ``gpu`` marker's
skip rule, and ``--isa-only`` (the tests marked ``isa``, for ci/test.sh's pass under another vector ISA)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--isa-only", action="store_true",
                     help="run only the tests marked isa (ci/test.sh's second pass under ATEN_CPU_CAPABILITY=avx2)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--isa-only"):
        kept = [item for item in items if "isa" in item.keywords]
        config.hook.pytest_deselected(items=[item for item in items if "isa" not in item.keywords])
        items[:] = kept
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache():
    """Inductor's and Triton's caches in a fresh folder for this session: what an earlier session on the same machine
    compiled (and the warm-start markers it left) must not decide whether this one's runs compile or load."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        yield


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smoke_data(tmp_path_factory):
    """A small ImageNet-like folder (10 classes x 12 images, 72 px) shared by the training tests."""
    from data_prep.imagenet_like import make_imagenet_like

    root = tmp_path_factory.mktemp("data") / "imagenet_like"
    return make_imagenet_like(root, num_classes=10, train_per_class=12, val_per_class=2, image_size=72, seed=0,
                              progress=False)
