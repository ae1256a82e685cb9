"""The manifest every mock-data generator keeps in its root: reuse an identical dataset, clean up our own files.

``root/manifest.json`` records the generator, its version, the parameters and the files written (first marked
incomplete, so an interrupted run is recognised). ``reuse_or_clear`` returns True when the folder already holds
exactly the requested dataset; otherwise it removes only the files an earlier run of the same generator listed,
and refuses to write next to data no generator of ours wrote. ``one_writer`` makes a generator take a lock beside
its root, so that processes preparing the same dataset at once (two notebooks) write it once. ``write_dataset``
writes a generator's files under that protocol.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import pathlib
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from data_prep.progress_bar import close_bar, open_bar

MANIFEST = "manifest.json"
_Maker = TypeVar("_Maker", bound=Callable[..., pathlib.Path])


def one_writer(make: _Maker) -> _Maker:
    """``make(root, ...)`` under an exclusive lock on ``root``: a second process waits, then reuses the dataset."""
    @functools.wraps(make)
    def locked(root: str | os.PathLike, *args: Any, **kwargs: Any) -> pathlib.Path:
        with _writer_lock(pathlib.Path(root)):
            return make(root, *args, **kwargs)
    return locked  # type: ignore[return-value]


@contextlib.contextmanager
def _writer_lock(root: pathlib.Path) -> Iterator[None]:
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as handle:  # beside root: root itself may not exist yet
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def reuse_or_clear(root: pathlib.Path, *, generator: str, version: int, params: dict, splits: Iterable[str],
                   writer: str) -> bool:
    """True when ``root`` holds the complete dataset of these parameters; else clears our earlier files (or
    refuses a folder whose ``splits`` hold foreign data) and returns False. ``writer`` names the function in errors."""
    old = read_manifest(root, generator)
    if old is not None and old.get("params") == params and old.get("version") == version and old.get("complete"):
        if all((root / rel).is_file() for rel in old["files"]):
            return True
    if old is not None:
        remove_own_files(root, old.get("files", []))
    else:
        refuse_foreign_data(root, splits, writer)
    return False


def read_manifest(root: pathlib.Path, generator: str) -> dict | None:
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable manifest ({exc}); delete it, and the files it listed, "
                         "or pick another --root") from exc
    if not isinstance(manifest, dict) or manifest.get("generator") != generator:
        raise ValueError(f"{path} was not written by {generator}; pick another --root")
    return manifest


def write_manifest(root: pathlib.Path, manifest: dict) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, root / MANIFEST)


def write_dataset(root: pathlib.Path, *, generator: str, version: int, params: dict,
                  files: Sequence[tuple[str, Callable[[], bytes]]], desc: str, progress: bool) -> pathlib.Path:
    """Writes ``files`` (relative path, what makes its bytes), in order, under the manifest's protocol: listed first
    as incomplete, so that an interrupted run is recognised and cleaned up by the next call, then marked complete."""
    manifest = {"generator": generator, "version": version, "params": params, "complete": False,
                "files": [rel for rel, _ in files]}
    root.mkdir(parents=True, exist_ok=True)
    write_manifest(root, manifest)
    bar, handle = open_bar(total=len(files), desc=desc, unit="file", mininterval=5.0, disable=not progress)
    try:
        for rel, make in files:
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(make())
            bar.update(1)
    finally:
        close_bar(bar, handle)  # a notebook's saved output reads the files written, not 0%
    write_manifest(root, {**manifest, "complete": True})
    return root


def remove_own_files(root: pathlib.Path, files: list[str]) -> None:
    """Delete the files a previous run listed, then the folders that became empty; nothing else."""
    dirs = set()
    for rel in files:
        if pathlib.PurePath(rel).is_absolute() or ".." in pathlib.PurePath(rel).parts:
            continue  # never follow an edited manifest outside root
        path = root / rel
        path.unlink(missing_ok=True)
        dirs.update(path.parents)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        if d != root and root in d.parents:
            try:
                d.rmdir()
            except OSError:  # not empty: it holds files we did not write
                pass
    (root / MANIFEST).unlink(missing_ok=True)


def refuse_foreign_data(root: pathlib.Path, splits: Iterable[str], writer: str) -> None:
    for split in splits:
        folder = root / split
        if folder.is_dir() and any(folder.iterdir()):
            raise FileExistsError(
                f"{folder} already holds data that {writer} did not write (no {root / MANIFEST}). "
                "Pick an empty or new --root so mock images are not mixed into a real dataset.")
