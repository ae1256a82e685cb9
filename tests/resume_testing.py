"""Shared set-up of the resume tests: a run continued from one of another run's checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

from gallery_lib.run.checkpoint import LATEST
from gallery_lib.config import RunConfig


def resume_from_copy(cfg: RunConfig, step: int, out: Path) -> RunConfig:
    """``cfg`` with ``resume=True`` in ``out``, holding only ``cfg``'s step-``step`` checkpoint (as ``latest``): what
    a run stopped right after that checkpoint leaves behind."""
    resumed = cfg.replace(output_dir=str(out), resume=True)
    ckpt_dir = resumed.run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    shutil.copy(cfg.run_dir / "checkpoints" / f"step_{step}.pt", ckpt_dir)
    (ckpt_dir / LATEST).write_text(f"step_{step}.pt\n")
    return resumed
