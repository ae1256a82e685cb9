"""ZeRO-2 checkpoints: the sharded model, optimizer state and EMA through ``torch.distributed.checkpoint`` (DCP).

``checkpoint.py`` keeps its layout and write protocol. ``step_<N>.pt`` (written atomically, named by ``latest``) holds
what is not sharded (scheduler, GradScaler, RNG states, data position, counters) and names the folder ``step_<N>.dcp``
beside it, into which every process writes its own shards of the model, the optimizer state and the EMA (DCP's
``__<rank>_0.distcp`` files and its ``.metadata``). The folder is written as ``step_<N>.dcp.tmp`` and renamed before
the ``.pt`` file is written, so ``latest`` never names a checkpoint with missing shards. With several nodes the
checkpoint folder must be on a filesystem they share.

``load_sharded`` asks DCP for the shards this process holds now, so a checkpoint also loads on another process count:
DCP reads, from every saved shard, the parts that overlap the new ones.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gallery_lib.accel.distributed import DistInfo

SUFFIX = ".dcp"


def shard_folder(directory: Path, step: int) -> Path:
    return directory / f"step_{step}{SUFFIX}"


def save_sharded(directory: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: Any,
                 info: DistInfo) -> str:
    """Every process writes its shards into ``step_<step>.dcp``; returns the folder's name. Call on every rank."""
    import torch.distributed.checkpoint as dcp

    folder = shard_folder(directory, step)
    tmp = folder.with_name(folder.name + ".tmp")
    if info.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    torch.distributed.barrier()
    dcp.save(_sharded_state(model, optimizer, ema), checkpoint_id=tmp)  # returns once .metadata is written
    if info.is_main:
        _replace_folder(tmp, folder)
    return folder.name


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: Any,
                 ema_step: int | None) -> None:
    """Loads the shards of ``folder`` that this process holds now into the model, the optimizer and the EMA."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} holds no complete sharded checkpoint (no .metadata)")
    state = _sharded_state(model, optimizer, ema)
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if ema is not None:
        ema.load_state_dict({"module": state["ema"], "step": ema_step})


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: Any) -> dict[str, Any]:
    """What DCP saves and loads: sharded DTensors, keyed by parameter names (so that they reshard)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    if ema is not None:
        state["ema"] = ema.module.state_dict()
    return state


def _replace_folder(tmp: Path, folder: Path) -> None:
    """Moves ``tmp`` to ``folder``; an older folder of that name (a run resumed before it) goes first."""
    if folder.exists():
        stale = folder.with_name(folder.name + ".stale.tmp")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(folder, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, folder)
