"""Shared fixtures and test-run plumbing.

- ``examples/`` on ``sys.path`` (its family module is imported by name).
- A session-wide smoke dataset, seeding, and compile caches of the test run's own (shared by its xdist workers), where
  ``optimize(model)``'s cached choices go too.
- The ``gpu`` marker's skip rule; ``--isa-only`` keeps the tests marked ``isa`` (ci/test.sh's pass under another
  vector ISA).
- ``GALLERY_CPU_AMP=1``: bf16 recipes compute in bf16 on every CPU, as the tests expect.
- Under pytest-xdist each worker uses one core (``OMP_NUM_THREADS=1``, for its training subprocesses too).
- In CI on a CPU, every skip must be one ``tests/expected_skips.json`` lists (``skip_check.py``).
- ``tests/durations.json`` (the seconds each test took in CI) orders the run longest first, so that the workers
  finish together; ``--record-durations PATH`` writes that file, and the summary ends with the run's total. The
  ``--isa-only`` pass has its own, ``tests/durations.isa.json`` (``PATH.isa``): its tests compile again for the other
  ISA, so they take other times than in the first pass.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

DURATIONS = Path(__file__).with_name("durations.json")
ISA_DURATIONS = Path(__file__).with_name("durations.isa.json")
# examples/ holds a family module that lives outside the library (toy_family.py): the tests import it by name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
BUDGET_WARNING_S = 45 * 60  # CI allows 90 minutes: past 45 a slow addition still has room, and is seen
# The mixed-precision recipes compute in bf16 on every CPU the tests run on, an AVX2-only one too (where a run would
# fall back to fp32: accel/precision.py), so that their numerics are checked everywhere; test_cpu_precision.py
# checks the fallback itself. Training subprocesses inherit it.
os.environ.setdefault("GALLERY_CPU_AMP", "1")


def pytest_addoption(parser):
    parser.addoption("--isa-only", action="store_true",
                     help="run only the tests marked isa (ci/test.sh's second pass, with AVX2 kernels)")
    parser.addoption("--record-durations", metavar="PATH",
                     help="write each test's seconds (setup + call + teardown) as JSON, as tests/durations.json holds")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # several workers share the cores: one thread each
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:  # the controller (or a run without xdist) sees every test's reports
        record_to = config.getoption("--record-durations")
        if record_to and config.getoption("--isa-only"):  # the second pass keeps the first pass's file
            record_to += ".isa"
        config.pluginmanager.register(_RunClock(record_to), "gallery-run-clock")
        expected_skips = Path(__file__).with_name("expected_skips.json")
        if (os.environ.get("CI") == "true" and expected_skips.is_file() and not config.getoption("--isa-only")
                and not torch.cuda.is_available()):
            from skip_check import SkipCheck

            config.pluginmanager.register(SkipCheck(expected_skips), "gallery-skip-check")  # every CPU skip listed


def pytest_collection_modifyitems(config, items):
    if config.getoption("--isa-only"):
        kept = [item for item in items if "isa" in item.keywords]
        config.hook.pytest_deselected(items=[item for item in items if "isa" not in item.keywords])
        items[:] = kept
    durations = ISA_DURATIONS if config.getoption("--isa-only") and ISA_DURATIONS.is_file() else DURATIONS
    if durations.is_file():  # a test not in the file (a new one) counts as quick
        _longest_first(items, json.loads(durations.read_text()))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _longest_first(items, seconds: dict[str, float]) -> None:
    """Longest first, so that the workers finish together. The tests of one ``xdist_group`` run in one worker, one
    after the other (they share what the first one compiles): they sort as one unit by their total, the longest of
    them first. ci/test.sh keeps this order (``--no-loadscope-reorder``)."""
    def unit(item) -> str:
        marker = item.get_closest_marker("xdist_group")
        return (marker.args[0] if marker.args else marker.kwargs["name"]) if marker else item.nodeid

    def own(item) -> float:
        return seconds.get(_without_group(item.nodeid), 0.0)

    totals: dict[str, float] = {}
    for item in items:
        totals[unit(item)] = totals.get(unit(item), 0.0) + own(item)
    items.sort(key=lambda item: (-totals[unit(item)], unit(item), -own(item)))


def _without_group(nodeid: str) -> str:
    """The test's id without the ``@group`` that pytest-xdist's loadgroup appends to it."""
    return nodeid.partition("@")[0]


class _RunClock:
    """Each test's seconds (setup + call + teardown) and the run's total, said at the end of the run."""

    def __init__(self, record_to: str | None) -> None:
        self.record_to = record_to
        self.seconds: dict[str, float] = {}
        self.start = time.monotonic()

    def pytest_runtest_logreport(self, report) -> None:
        nodeid = _without_group(report.nodeid)
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        total = time.monotonic() - self.start
        if self.record_to and self.seconds:
            Path(self.record_to).write_text(json.dumps({k: round(v, 2) for k, v in sorted(self.seconds.items())},
                                                       indent=0) + "\n")
        terminalreporter.write_line(f"[tests] {len(self.seconds)} tests in {total / 60:.1f} min "
                                    f"({sum(self.seconds.values()) / 60:.1f} min of test time over the workers)")
        if total > BUDGET_WARNING_S:
            terminalreporter.write_line(
                f"[tests] WARNING: this run took {total / 60:.1f} min, past the {BUDGET_WARNING_S // 60} min CI "
                "keeps for growth (90 allowed): make new tests cheaper or pay for them elsewhere",
                yellow=True, bold=True)


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache(tmp_path_factory, request):
    """Inductor's and Triton's caches in a fresh folder of this test run: what an earlier run on the same machine
    compiled (and the warm-start markers it left) must not decide whether this one's runs compile or load. The
    xdist workers of one run share it, so that a graph one compiled, another loads; ci/test.sh's two passes share
    one through ``GALLERY_TEST_COMPILE_CACHE``."""
    from compile_testing import compile_cache_at

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    cache = Path(os.environ.get("GALLERY_TEST_COMPILE_CACHE") or root / "inductor-cache")
    if request.config.getoption("--isa-only"):
        # ci/test.sh's AVX2 pass shares the first pass's cache (GALLERY_TEST_COMPILE_CACHE). Inductor's cache keys
        # hold its config but not ATEN_CPU_CAPABILITY: naming the AVX2 width keys this pass's graphs apart from
        # AVX-512 ones, and loads those the first pass compiled at this width (where the CPU compile check chose it).
        import torch._inductor.config

        torch._inductor.config.cpp.simdlen = 256
    # What optimize(model) chose goes there too, not to the user's ~/.cache: a test run decides afresh, once
    # (the ResNet notebook's two runs share it as they share the graphs).
    os.environ["GALLERY_CACHE_DIR"] = str(cache / "gallery_lib")
    with compile_cache_at(cache):
        yield cache


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
