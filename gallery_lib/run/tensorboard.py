"""TensorBoard beside ``metrics.jsonl`` (``report_to='tensorboard'``): the run's step records as scalars, its summary
as text, the report's figure as an image.

``metrics.jsonl`` stays the source of truth: the reports read it, and TensorBoard gets a copy as the run goes, in
``<run_dir>/tensorboard/``, so ``tensorboard --logdir output/`` follows and compares runs while they train. A resumed
run purges the events after its checkpoint's step, as ``metrics.jsonl`` moves the superseded lines aside.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gallery_lib.config.run_config import flat_config
from gallery_lib.config.settings import ConfigError

SCALARS = ("loss", "lr", "samples_per_s", "step_time_ms", "peak_mem_mb")
"""The step record's fields shown as ``train/<field>`` curves."""
SUMMARY_FIELDS = ("samples_per_s", "median_step_time_ms", "p20_step_time_ms", "p80_step_time_ms", "warmup_time_s",
                  "peak_mem_mb", "final_loss", "global_batch_size", "device_name")


def summary_writer(log_dir: str | Path, purge_step: int | None = None):
    """``torch.utils.tensorboard.SummaryWriter`` for ``log_dir``, or a ``ConfigError`` naming the install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module needs the tensorboard package
        raise ConfigError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard (or the "
                          "gallery's tracking extra: pip install -e '.[tracking]'), or set report_to='none'.") from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class TensorBoardWriter:
    """Takes the records ``MetricsWriter`` takes (``write``/``close``) and logs them to TensorBoard."""

    def __init__(self, log_dir: str | Path, *, start_step: int = 0) -> None:
        self._writer = summary_writer(log_dir, purge_step=start_step or None)

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") == "step":
            for name in SCALARS:
                value = record.get(name)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(f"train/{name}", value, record["step"])
        elif record.get("type") == "summary":
            rows = [f"| {name} | {record[name]} |" for name in SUMMARY_FIELDS if record.get(name) is not None]
            self._writer.add_text("summary", "| field | value |\n|---|---|\n" + "\n".join(rows), record["steps"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TeeWriter:
    """Writes every record to each of several writers (``metrics.jsonl`` first: it is the record that counts)."""

    def __init__(self, *writers) -> None:
        self.writers = writers

    def write(self, record: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(record)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def log_figure(log_dir: str | Path, tag: str, figure) -> None:
    """One matplotlib figure as a TensorBoard image (the recipe comparison, a sample grid)."""
    writer = summary_writer(log_dir)
    try:
        writer.add_figure(tag, figure, close=False)
    finally:
        writer.close()


def log_to_run(run_dir: str | Path, tag: str, figure) -> bool:
    """``figure`` into the run's TensorBoard folder when its ``config.json`` says ``report_to='tensorboard'``; whether
    it was logged."""
    import json

    config = Path(run_dir) / "config.json"
    if not config.is_file() or flat_config(json.loads(config.read_text())).get("report_to") != "tensorboard":
        return False
    log_figure(Path(run_dir) / "tensorboard", tag, figure)
    return True
