"""Where a result came from: the commit of the code that ran, whether its tracked files had changed, and a hash of
the code itself that ``verify_source`` checks against the commit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def result_header() -> dict[str, Any]:
    """What a benchmark's result file opens with: the exact command, when it ran, and ``source_version``."""
    return {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            **source_version()}


def write_result(path: str | os.PathLike | None, **fields: Any) -> dict[str, Any]:
    """``fields`` after ``result_header`` and torch's version, written as JSON to ``path`` where one is given."""
    import torch

    record = {**result_header(), "torch": torch.__version__, **fields}
    if path:
        Path(path).write_text(json.dumps(record, indent=1), encoding="utf-8")
    return record


SOURCE_FOLDERS = ("gallery_lib", "data_prep")
"""The code a result depends on: ``source_sha256`` hashes these folders' files."""


def source_version(repo: Path = Path(__file__).resolve().parents[2]) -> dict[str, Any]:
    """The ``commit`` of the code that ran, whether its tracked files had changes (``dirty``), and ``source_sha256``,
    the hash of the code itself, which ``verify_source`` checks against the commit. The commit is
    as ``GALLERY_COMMIT=<commit>[+dirty]`` names it where set (a copy of a checkout, as on a GPU machine, whose ``.git``
    may be older than its files), else from the package's own git checkout (never an outer repository's it sits
    in); ``None`` where neither knows, the hash then saying what ran."""
    own = _own_checkout(repo)
    code = {"source_sha256": _source_sha256(repo, own)}
    named = os.environ.get("GALLERY_COMMIT")
    if named:
        commit, _, dirty = named.partition("+")
        return {"commit": commit, "dirty": dirty == "dirty", **code}
    commit = _git(repo, "rev-parse", "HEAD") if own else None
    if commit is None:  # no checkout of its own (an outer repository's commit would name other code)
        return {"commit": None, "dirty": None, **code}
    return {"commit": commit, "dirty": bool(_git(repo, "status", "--porcelain", "--untracked-files=no")), **code}


def source_sha256(repo: Path = Path(__file__).resolve().parents[2]) -> str:
    """SHA-256 of the code in ``SOURCE_FOLDERS`` as it is on disk: each file's path and bytes, in path order (the
    files git tracks in a checkout of its own, else every file but compiled caches)."""
    return _source_sha256(repo, _own_checkout(repo))


def _source_sha256(repo: Path, own_checkout: bool) -> str:
    listed = _git(repo, "ls-files", "-z", "--", *SOURCE_FOLDERS) if own_checkout else None
    if listed is not None:
        names = [name for name in listed.split("\0") if name and (repo / name).is_file()]
    else:
        names = [path.relative_to(repo).as_posix() for folder in SOURCE_FOLDERS for path in (repo / folder).rglob("*")
                 if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path)]
    return _hash((name, (repo / name).read_bytes()) for name in names)


def source_sha256_at(commit: str, repo: Path = Path(__file__).resolve().parents[2]) -> str | None:
    """``source_sha256`` of the code at ``commit`` in ``repo``'s history; ``None`` where git does not know it."""
    import io
    import tarfile

    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit, "--", *SOURCE_FOLDERS],
                                 capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if archive.returncode != 0:
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        files = [(member.name, tar.extractfile(member).read()) for member in tar.getmembers() if member.isfile()]
    return _hash(files)


def verify_source(record: dict[str, Any], repo: Path = Path(__file__).resolve().parents[2]) -> str:
    """``verified``, ``mismatch`` (the code that ran is not the commit it names), ``no hash`` (a file written before
    the hash was recorded) or ``unknown commit``, for a result file's header."""
    if not record.get("source_sha256"):
        return "no hash"
    expected = source_sha256_at(record["commit"], repo) if record.get("commit") else None
    if expected is None:
        return "unknown commit"
    return "verified" if expected == record["source_sha256"] else "mismatch"


def _hash(files) -> str:
    digest = hashlib.sha256()
    for name, data in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _own_checkout(repo: Path) -> bool:
    return _git(repo, "rev-parse", "--show-toplevel") == str(repo.resolve())


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
