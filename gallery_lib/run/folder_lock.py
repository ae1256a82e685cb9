"""One run at a time in a run's folder.

A second launch into the folder of a run that is still training would move that run's files to ``earlier/<N>/``
under it (the running process keeps writing its metrics and logs there, through the files it holds open) and then
put its own in their place, where the first run's exported model later lands over the second's. The launcher holds
an exclusive lock on ``<run>/.running`` while its run trains; the operating system drops the lock when the launcher
ends, however it ends, so a crash leaves no stale lock. The file stays (removing it would let two launches each lock
a file of their own).
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_FILE = ".running"


class FolderInUse(RuntimeError):
    """Another launch holds the run's folder."""


@contextmanager
def only_run_in(run_dir: Path) -> Iterator[None]:
    """Holds ``run_dir`` for this launch until the block ends; ``FolderInUse`` when another launch holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text(encoding="utf-8").strip() or "a process"
            raise FolderInUse(f"another run is training in {run_dir} ({holder}): wait for it to end, or give this "
                              "run a folder of its own (--output-dir, output_dir=...)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        yield
    finally:
        os.close(fd)  # drops the lock
