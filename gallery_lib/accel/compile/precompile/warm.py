"""Which precompiled graph sets this machine's compile caches already hold, so that a second run starts no workers.

With warm caches the workers only find what is there, yet their start-up (imports, CUDA context, compile pool) is
the longest part of a second run's start (benchmarks/RESULTS.md#sd15-compile-time). After workers precompiled a set
of graphs without a failure, ``mark_warm`` leaves a marker in Inductor's cache directory, named by a key of
everything those graphs depend on: the recorded block calls (``record._graph_key``), the compile options, Inductor's
configuration, the backend flags, the device, the torch and Triton versions and this package's source. A run that
records the same key skips the workers, and its first step loads the graphs from the caches.

Where no workers precompile (too few cores), the run's first step compiles its blocks. ``CompileLock`` then keeps
two runs on one machine that record the same key (two notebooks at a time, two test workers) from compiling the same
graphs side by side: the second waits for the first, and its first step loads what the first compiled.

The marker is a hint, never a cache itself: a run whose caches were emptied under it compiles its graphs itself, as
without workers, and ``forget_warm`` removes the marker so that the next run uses workers again. A run also keeps a
second, coarser marker (``hint``: model, batch, recipe, ...) so that it knows before building the model whether to
start the workers at all; the exact key then decides.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Iterable

import torch

_SUBDIR = "gallery_precompiled"


def marker_dir() -> Path:
    """Where the markers live: beside the graphs, in Inductor's cache directory (emptying it empties both)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = cache_dir()
    except Exception:  # noqa: BLE001 - a private helper; its public setting is the environment variable
        root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(os.environ.get("TMPDIR", "/tmp"))
                                                                / f"torchinductor_{os.environ.get('USER', 'user')}")
    return Path(root) / _SUBDIR


@functools.cache
def _source_digest() -> str:
    """This package's Python source: a changed kernel or hook changes the graphs, and so the key."""
    root = Path(__file__).resolve().parents[2]  # gallery_lib/
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return device.type


def _inductor_settings() -> list[tuple[str, str]]:
    """Inductor's own configuration (set from the environment, ``TORCHINDUCTOR_*``, as well as in code): the same
    block graphs compile to other kernels under another one, so it is part of the key too."""
    try:
        from torch._inductor import config

        saved = config.save_config_portable()
    except Exception:  # noqa: BLE001 - a private helper; without it, the compile options still key what we set
        return []
    return sorted((k, repr(v)) for k, v in saved.items() if isinstance(v, (bool, int, float, str, type(None))))


def graph_set_key(graph_keys: Iterable[tuple], compile_kwargs: dict[str, Any], flags: dict[str, Any],
                  device: torch.device) -> str:
    """The key of one run's set of distinct block graphs as compiled on ``device``."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    parts = (sorted(repr(k) for k in graph_keys), sorted((k, repr(v)) for k, v in compile_kwargs.items()),
             sorted(flags.items()), _device_name(device), torch.__version__, triton_version, _source_digest(),
             _inductor_settings())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def hint_key(*parts: Any) -> str:
    """The coarse key a run knows before it builds its model (see the module docstring)."""
    return "hint-" + hashlib.sha256(repr((parts, torch.__version__, _source_digest())).encode()).hexdigest()[:32]


def _write(name: str, text: str) -> None:
    directory = marker_dir()
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{name}.{os.getpid()}.partial"
    partial.write_text(text)
    os.replace(partial, directory / name)  # ranks of one machine may write the same marker at once


def is_warm(key: str) -> bool:
    return (marker_dir() / key).is_file()


def mark_warm(key: str, hint: str | None = None) -> None:
    """Records that the graphs of ``key`` are in the caches, and that runs of ``hint`` record ``key``."""
    _write(key, "precompiled\n")
    if hint is not None:
        _write(hint, key + "\n")


def hinted_warm(hint: str) -> bool:
    """True when runs of ``hint`` last recorded a graph set that is still marked warm."""
    try:
        key = (marker_dir() / hint).read_text().strip()
    except OSError:
        return False
    return bool(key) and is_warm(key)


def forget_warm(key: str) -> None:
    (marker_dir() / key).unlink(missing_ok=True)


class CompileLock:
    """This machine's lock on compiling the graph set ``key`` (an advisory file lock beside the markers: the system
    releases it when its process ends, however it ends)."""

    def __init__(self, key: str) -> None:
        directory = marker_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / f"{key}.lock", "a")

    def acquire(self) -> float:
        """Takes the lock, waiting while another process holds it; returns the seconds waited (0.0: it was free)."""
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return 0.0
        except BlockingIOError:
            start = time.perf_counter()
            fcntl.flock(self._file, fcntl.LOCK_EX)
            return time.perf_counter() - start

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
