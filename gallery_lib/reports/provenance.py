"""Where a result came from: the commit of the code that ran, and whether its tracked files had changed."""

from __future__ import annotations

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


def source_version(repo: Path = Path(__file__).resolve().parents[2]) -> dict[str, Any]:
    """The ``commit`` of the code that ran and whether its tracked files had changes (``dirty``): as
    ``GALLERY_COMMIT=<commit>[+dirty]`` names them where set (a copy of a checkout, as on a GPU machine, whose
    ``.git`` may be older than its files), else from git; both ``None`` where neither knows."""
    named = os.environ.get("GALLERY_COMMIT")
    if named:
        commit, _, dirty = named.partition("+")
        return {"commit": commit, "dirty": dirty == "dirty"}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
