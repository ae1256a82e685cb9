"""Checkpoints for exact resume, written so that a kill at any moment leaves a loadable one.

A checkpoint holds everything the next step depends on: the plain model's ``state_dict``, the optimizer,
the LR scheduler, the GradScaler, the O2 fp32 master weights, the RNG states of every rank (python, numpy,
torch CPU, this rank's CUDA device) and the data position (epoch and batches consumed in it). Resuming a
deterministic CPU run from it reproduces the uninterrupted run bitwise.

Layout and write protocol, in ``<run_dir>/checkpoints/``::

    step_<N>.pt    N = training steps completed; written as step_<N>.pt.tmp, flushed, fsynced, then os.replace'd
    latest         the name of the newest complete checkpoint, replaced atomically after the file is in place

A kill before the pointer moves leaves ``latest`` naming the previous, complete checkpoint (plus a stray
``.tmp`` that the next save removes). The newest ``keep`` checkpoints are kept; the one ``latest`` names never
goes. Loading checks the format, the config fields that must match (``RESUME_FIELDS``) and the data position,
and raises ``CheckpointError`` naming the problem: a bad checkpoint never turns into a silent fresh start.

ZeRO-2 runs (``data_parallel='zero2'``) keep this layout; their sharded model, optimizer state and EMA go into a
``step_<N>.dcp`` folder beside ``step_<N>.pt`` (``sharded_checkpoint.py``), pruned with it. A ZeRO-2 checkpoint
resumes exactly on the same process count, and also loads on another one that keeps the global batch
(``batch_size`` x processes): the data position then continues by global sample count, since each global batch holds
the same samples on any number of processes, and each process takes the RNG state of rank ``rank % saved processes``
(random draws in the model, dropout or diffusion noise, then differ from the uninterrupted run's). A DDP checkpoint
resumes on its own process count only.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed

import gallery_lib
from gallery_lib.config import RunConfig
from gallery_lib.config.sections import SECTION_OF, Checkpoint, Data, Job
from gallery_lib.config.sections.acceleration import Parallel as ParallelSettings
from gallery_lib.config.sections.training import Precision as PrecisionSettings
from gallery_lib.config.sections.training import Training as TrainingSettings
from gallery_lib.accel.distributed import DistInfo
from gallery_lib.accel.precision import Precision
from gallery_lib.run.sharded_checkpoint import SUFFIX as SHARDED_SUFFIX, load_sharded, save_sharded

FORMAT_VERSION = 1
RESUME_FIELDS = ("model", "image_size", "batch_size", "nproc_per_node", "amp_level", "amp_dtype", "seed")
"""Config fields a resumed run must share with the saved one: they shape the state or the data stream. The task
adds its own (``options.resume_fields``, e.g. ``prediction_type``). ZeRO-2 checkpoints leave out ``batch_size`` and
``nproc_per_node``, and check the global batch instead (they reshard)."""
RESHARDABLE = ("batch_size", "nproc_per_node")
LATEST = "latest"
_STEP_FILE = re.compile(r"^step_(\d+)(\.pt|" + re.escape(SHARDED_SUFFIX) + ")$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not belong to this config; the message says what to do."""

    for_the_user = True
    """The message names its fix: a stopped run shows it whole (``failure.failure_from_exception``)."""


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def resume_signature(*, job: Job, data: Data, training: TrainingSettings, parallel: ParallelSettings,
                     precision: PrecisionSettings, options: Any) -> dict[str, Any]:
    """The values a resumed run must share with its checkpoint: ``RESUME_FIELDS``, each read from its section, then
    the task's ``options.resume_fields`` (ZeRO-2 leaves out ``RESHARDABLE``)."""
    sections = {"job": job, "data": data, "training": training, "parallel": parallel, "precision": precision}
    fields = RESUME_FIELDS + options.resume_fields
    if parallel.data_parallel == "zero2":
        fields = tuple(name for name in fields if name not in RESHARDABLE)
    return {name: getattr(sections[SECTION_OF[name]], name) if name in SECTION_OF else getattr(options, name)
            for name in fields}


def config_hash(signature: dict[str, Any]) -> str:
    """A short hash of a run's ``resume_signature``."""
    text = json.dumps(signature, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_fresh_start(run_dir: Path, checkpoint: Checkpoint) -> None:
    """A fresh run that writes checkpoints refuses to mix them with those of an earlier run."""
    directory = checkpoint_dir(run_dir)
    if checkpoint.checkpoint_every > 0 and (directory / LATEST).exists():
        raise CheckpointError(f"{directory} holds checkpoints of an earlier run: set resume=True (--resume) "
                              "to continue it, or delete that folder to start over.")


def latest_checkpoint(directory: str | os.PathLike) -> Path:
    """The checkpoint file ``<directory>/latest`` names; ``CheckpointError`` if there is none."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.is_file():
        found = sorted(p.name for p in directory.glob("step_*.pt")) if directory.is_dir() else []
        hint = (f"it holds {', '.join(found)} but no pointer: write the name of the one to resume from into {pointer}"
                if found else "run without resume to start fresh, and set checkpoint_every > 0 to write checkpoints")
        raise CheckpointError(f"no checkpoint to resume from: {pointer} does not exist ({hint}).")
    path = directory / pointer.read_text(encoding="utf-8").strip()
    if not path.is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist: point it at an existing "
                              f"step_<N>.pt in {directory} or delete the folder to start fresh.")
    return path


def write_checkpoint(state: dict[str, Any], directory: str | os.PathLike, step: int, keep: int) -> Path:
    """Atomically writes ``state`` as ``step_<step>.pt``, moves ``latest`` to it, then prunes to ``keep`` files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.tmp"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    path = directory / f"step_{step}.pt"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)
    pointer_tmp = directory / (LATEST + ".tmp")
    with open(pointer_tmp, "w", encoding="utf-8") as f:
        f.write(path.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, directory / LATEST)
    _fsync_dir(directory)
    _prune(directory, keep, protect=path.name)
    return path


def resume_source(run_dir: Path, checkpoint: Checkpoint, restarted: bool = False) -> Path | None:
    """The checkpoint file a run continues from, ``None`` for a fresh start: after a torchrun restart the run's own
    latest, once it wrote one; else ``resume_from``'s; else, with ``resume``, the run's own latest.
    ``CheckpointError`` (saying what to pass) when the asked-for checkpoint is not there."""
    own = checkpoint_dir(run_dir)
    if restarted and (own / LATEST).is_file():
        return latest_checkpoint(own)
    if checkpoint.resume_from:
        return checkpoint_at(checkpoint.resume_from)
    return latest_checkpoint(own) if checkpoint.resume else None


def checkpoint_at(location: str | os.PathLike) -> Path:
    """The checkpoint ``location`` names: a ``step_<N>.pt`` file, or a checkpoints folder or a run folder (the file
    its ``latest`` names)."""
    path = Path(location).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        return latest_checkpoint(folder)
    raise CheckpointError(f"resume_from={str(location)!r}: no such file or folder. Pass a step_<N>.pt checkpoint, "
                          "the checkpoints folder that holds it, or the run folder (output/<model>/<recipe>).")


def is_own_checkpoint(run_dir: Path, path: Path) -> bool:
    """Whether ``path`` is in the run's own checkpoints folder (the run continues itself, appending its metrics)."""
    return path.resolve().parent == checkpoint_dir(run_dir).resolve()


def continues_itself(run_dir: Path, checkpoint: Checkpoint) -> bool:
    """Whether the run starts from a checkpoint of its own folder (``resume``, or ``resume_from`` pointing there)."""
    source = resume_source(run_dir, checkpoint)
    return source is not None and is_own_checkpoint(run_dir, source)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Loads a checkpoint file on the CPU; ``CheckpointError`` if it is missing, truncated or not ours."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if found is None:  # not a refused global: a damaged file
            raise _unreadable(path, exc) from exc
        # torch's own advice (allow the global) is the wrong one for a file that may not be yours
        raise CheckpointError(
            f"checkpoint {path} was refused: it holds a Python call to run on loading ({found.group(1)}), which no "
            "gallery checkpoint holds. Load such a file only if you made it; otherwise delete it, or resume from "
            "another checkpoint.") from None
    except Exception as exc:  # torch raises several types for a truncated zip or pickle
        raise _unreadable(path, exc) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a gallery_lib checkpoint of format {FORMAT_VERSION}.")
    return state


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    others = sorted(p.name for p in path.parent.glob("step_*.pt") if p != path)
    # torch's first sentence names the damage; a damaged pickle's goes on to advise weights_only=False: not here
    cause = "the pickled data is damaged" if isinstance(exc, pickle.UnpicklingError) else \
        (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
    return CheckpointError(
        f"checkpoint {path} cannot be read: truncated, corrupt or not a checkpoint ({type(exc).__name__}: {cause}). "
        f"Write the name of an earlier checkpoint ({', '.join(others) or 'none left'}) into "
        f"{path.parent / LATEST}, or delete {path.parent} to start fresh.")


def check_compatible(meta: dict[str, Any], ours: dict[str, Any], path: Path) -> None:
    """``CheckpointError`` where the checkpoint at ``path`` (its ``meta``) was written by a run whose
    ``resume_signature`` differs from ``ours``."""
    if meta["config_hash"] == config_hash(ours):
        return
    diffs = [f"{k}: saved {meta['signature'].get(k)!r}, now {ours[k]!r}" for k in ours
             if meta["signature"].get(k) != ours[k]]
    if not diffs:  # saved before a field moved out of the signature (prediction_type of classifiers)
        return
    raise CheckpointError(f"checkpoint {path} was written by an incompatible run ({'; '.join(diffs)}). Resume with "
                          "the saved values, or start a fresh run (another recipe name or output_dir).")


@dataclass
class Checkpointer:
    """Saves and restores one run's training state; called from the loop in ``train.py``.

    Every rank calls ``save`` (it gathers the per-rank RNG states, with ZeRO-2 every rank writes its shards, rank 0
    writes the file, all ranks wait at a barrier) and ``restore`` (each rank reads the file, and its shards, and takes
    its own RNG state).
    """

    cfg: RunConfig
    dist: DistInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    loader: Any
    ema: Any = None
    """The run's ``ModelEma`` (``None`` without EMA); its weights and update count are saved and restored."""

    @property
    def directory(self) -> Path:
        return checkpoint_dir(self.cfg.run_dir)

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is written after ``step`` completed steps."""
        return self.cfg.checkpoint_every > 0 and step % self.cfg.checkpoint_every == 0

    def check_fresh_start(self) -> None:
        check_fresh_start(self.cfg.run_dir, self.cfg.sections.checkpoint)

    @property
    def sharded(self) -> bool:
        """ZeRO-2: the model, optimizer and EMA are saved as shards (``sharded_checkpoint.py``)."""
        return self.cfg.data_parallel == "zero2"

    def save(self, step: int, counters: dict[str, int]) -> Path | None:
        """Writes the state after ``step`` completed steps; returns the file on rank 0, ``None`` elsewhere."""
        rng = _rng_state(self.dist.device)
        if self.dist.world_size > 1:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, rng)
        else:
            gathered = [rng]
        shards = (save_sharded(self.directory, step, self.model, self.optimizer, self.ema, self.dist)
                  if self.sharded else None)
        path = None
        if self.dist.is_main:
            state = self._state(step, counters, gathered, shards)
            path = write_checkpoint(state, self.directory, step, self.cfg.keep_checkpoints)
        if self.dist.world_size > 1:
            torch.distributed.barrier()
        return path

    def _state(self, step: int, counters: dict[str, int], rng: list[Any], shards: str | None) -> dict[str, Any]:
        """What ``step_<step>.pt`` holds; with ``shards`` (the shard folder's name) the model, optimizer and EMA are
        there instead."""
        masters = list(self.precision.master_params.values())
        signature = self._signature()
        state = {
            "format": FORMAT_VERSION,
            "meta": {"step": step, "torch_version": str(torch.__version__),
                     "gallery_lib_version": gallery_lib.__version__, "config_hash": config_hash(signature),
                     "signature": signature, "world_size": self.dist.world_size,
                     "data_parallel": self.cfg.data_parallel,
                     "global_batch": self.cfg.batch_size * self.dist.world_size},
            "model": None if shards else self.model.state_dict(),
            "optimizer": None if shards else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "master_params": masters or None,
            "ema": self.ema.state_dict() if self.ema is not None and not shards else None,
            "rng": rng,
            "data": self.loader.state_dict(),
            "counters": dict(counters),
        }
        if shards:
            state.update(sharded=shards, ema_step=self.ema.step if self.ema is not None else None)
        return state

    def restore(self, path: str | os.PathLike | None = None) -> tuple[int, dict[str, int]]:
        """Loads ``path`` (default: the ``latest`` one) into every part; returns ``(steps done, counters)``."""
        path = Path(path) if path is not None else latest_checkpoint(self.directory)
        state = read_checkpoint(path)
        meta = state["meta"]
        self._check_fits(meta, path)
        try:
            if "sharded" in state:
                saved_ema = state["ema_step"] is not None
                self._check_ema(saved_ema)
                load_sharded(path.parent / state["sharded"], self.model, self.optimizer, self.ema, state["ema_step"])
            else:
                self._check_ema(state.get("ema") is not None)
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                if self.ema is not None:
                    self.ema.load_state_dict(state["ema"])
            self.scheduler.load_state_dict(state["scheduler"])
            if (state["scaler"] is None) != (self.precision.scaler is None):
                raise ValueError("one of the saved run and this run uses a GradScaler and the other does not")
            if self.precision.scaler:
                self.precision.scaler.load_state_dict(state["scaler"])
            masters = list(self.precision.master_params.values())
            if (state["master_params"] is None) != (not masters):
                raise ValueError("one of the saved run and this run keeps O2 master weights and the other does not")
            with torch.no_grad():
                for master, saved in zip(masters, state["master_params"] or ()):
                    master.copy_(saved)  # in place: the optimizer holds these tensors
            self.loader.load_state_dict(state["data"])
        except (RuntimeError, ValueError, KeyError, FileNotFoundError) as exc:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {exc}") from exc
        saved_rng = state["rng"]  # one per saved rank; a resharded ZeRO-2 run reuses them round-robin
        _set_rng_state(saved_rng[self.dist.rank % len(saved_rng)], self.dist.device)
        return meta["step"], dict(state["counters"])

    def _signature(self) -> dict[str, Any]:
        """This run's ``resume_signature``."""
        sections = self.cfg.sections
        return resume_signature(job=sections.job, data=sections.data, training=sections.training,
                                parallel=sections.parallel, precision=sections.precision, options=self.cfg.options)

    def _check_fits(self, meta: dict[str, Any], path: Path) -> None:
        """``CheckpointError`` unless the checkpoint at ``path`` (its ``meta``) can continue this run."""
        saved_mode = meta.get("data_parallel", "ddp")
        if saved_mode != self.cfg.data_parallel:
            raise CheckpointError(f"{path} was written by a data_parallel={saved_mode!r} run and this run is "
                                  f"data_parallel={self.cfg.data_parallel!r} (their checkpoints differ): resume with "
                                  f"data_parallel={saved_mode!r}.")
        check_compatible(meta, self._signature(), path)
        world, batch = self.dist.world_size, self.cfg.batch_size
        if self.sharded and meta["global_batch"] != batch * world:
            fix = (f"set batch_size={meta['global_batch'] // world}" if meta["global_batch"] % world == 0
                   else f"use a process count that divides {meta['global_batch']}")
            raise CheckpointError(f"{path} was written with a global batch of {meta['global_batch']} "
                                  f"({meta['world_size']} process(es)); this run's is {batch * world} ({world} x "
                                  f"batch_size {batch}). A ZeRO-2 checkpoint resumes on another process count with "
                                  f"the same global batch: {fix}.")
        if not self.sharded and meta["world_size"] != world:
            raise CheckpointError(f"{path} was written by {meta['world_size']} process(es), this run has "
                                  f"{world}: resume with nproc_per_node={meta['world_size']}.")
        if meta["step"] >= self.cfg.steps:
            raise CheckpointError(f"{path} is at step {meta['step']} and the run has steps={self.cfg.steps}: "
                                  "nothing is left to train; raise steps to continue training.")

    def _check_ema(self, saved: bool) -> None:
        if saved != (self.ema is not None):
            raise ValueError("one of the saved run and this run keeps an EMA of the weights and the other does not "
                             "(the ema setting differs)")


def _rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(),
            # plain ints and tensors only, so the file loads with weights_only=True
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _prune(directory: Path, keep: int, protect: str) -> None:
    """Keeps the newest ``keep`` checkpoints and ``protect``; a checkpoint is its ``.pt`` file and, for ZeRO-2, its
    shard folder (a shard folder whose file was never written goes too)."""
    parts: dict[int, list[Path]] = {}
    for path in directory.iterdir():
        if m := _STEP_FILE.match(path.name):
            parts.setdefault(int(m.group(1)), []).append(path)
    complete = sorted(step for step, paths in parts.items() if any(p.suffix == ".pt" for p in paths))
    kept = set(complete[-keep:]) | {int(m.group(1)) for m in [_STEP_FILE.match(protect)] if m}
    for step, paths in parts.items():
        if step not in kept:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # directories cannot be opened on Windows; os.replace is atomic there anyway
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
