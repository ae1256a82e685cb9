"""Per-rank log files: every rank writes ``logs/rank<N>.log``; only rank 0 also prints.

The launcher streams rank 0's stdout into the notebook cell, so the console shows one clean log
while each rank's full output (warnings, skipped-sample lines, tracebacks) stays in its own file.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from pathlib import Path
from typing import IO, Iterator


class _Tee:
    def __init__(self, *streams: IO[str]):
        self.streams = [s for s in streams if s is not None]

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def rank_logging(log_dir: Path, rank: int) -> Iterator[Path]:
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    with open(path, "w", encoding="utf-8") as log_file:
        old_out, old_err = sys.stdout, sys.stderr
        sys.stdout = _Tee(log_file, old_out if rank == 0 else None)
        sys.stderr = _Tee(log_file, old_err if rank == 0 else None)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        try:
            yield path
        except BaseException:
            # The file gets the traceback here; the console gets it from the uncaught exception.
            traceback.print_exc(file=log_file)
            raise
        finally:
            root.removeHandler(handler)
            sys.stdout, sys.stderr = old_out, old_err
