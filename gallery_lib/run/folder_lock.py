"""One run at a time in a run's folder.

A second launch into the folder of a run that is still training would move that run's files to ``earlier/<N>/``
under it (the running process keeps writing its metrics and logs there, through the files it holds open) and then
put its own in their place, where the first run's exported model later lands over the second's. The launcher holds
an exclusive lock on ``<run>/.running`` while its run trains; the operating system drops the lock when the launcher
ends, however it ends, so a crash leaves no stale lock. The files stay (removing one would let two launches each lock
a file of their own).

A training process can outlive its launcher (a notebook's kernel restarted: the launcher and torchrun end, the
workers, in sessions of their own, train on until their next line of output finds no reader). Each holds a shared
lock on ``<run>/.training`` for as long as it lives, and a launch into the folder waits for none of them: it stops.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_FILE = ".running"
TRAINING_FILE = ".training"
LOCK_FILES = (LOCK_FILE, TRAINING_FILE)


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
        if _still_training(run_dir):
            raise FolderInUse(f"a training process of an earlier launch still runs in {run_dir} (its launcher ended): "
                              "wait for it to end or stop it, or give this run a folder of its own (--output-dir, "
                              "output_dir=...)")
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        yield
    finally:
        os.close(fd)  # drops the lock


def hold_while_training(run_dir: Path) -> None:
    """In a training process: holds a shared lock on ``<run>/.training`` until the process ends (every rank holds
    one), which a later launch into the folder finds taken. Where the file system offers no locks, nothing."""
    try:
        fd = os.open(run_dir / TRAINING_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)  # the descriptor stays open: the operating system drops the lock at exit
    except OSError:
        pass


def _still_training(run_dir: Path, patience_s: float = 3.0) -> bool:
    """Whether a training process holds ``<run>/.training`` (``hold_while_training``) for ``patience_s``: the data
    loader's workers of a run that just ended hold its descriptor until they are shut down."""
    fd = os.open(run_dir / TRAINING_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + patience_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return True
                time.sleep(0.1)
    finally:
        os.close(fd)  # drops the probe's lock
