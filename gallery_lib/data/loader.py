"""The endless, resumable training loader that every task shares.

``TrainLoader`` + ``sampled_loader``: seeded sharded order, per-sample seeded augmentation, epoch rollover, a data
position to resume from. What a batch holds and how it is finished on the device is the task's
(``classification.py`` for images with labels; the text-to-image task has its own).

Training is counted in steps, so ``TrainLoader`` never stops: its sampler moves to the next epoch
(``set_epoch``) by itself, in one DataLoader iteration, so the workers never drain at an epoch boundary. The
transfer runs on the current stream with ``non_blocking=True`` from pinned memory; timm's ``PrefetchLoader``
side-stream overlap is not used because a uint8 batch copy is a few milliseconds at most
against a training step of a hundred or more, and the single stream needs no cross-stream memory bookkeeping.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import DataLoader, DistributedSampler


class TrainLoader:
    """Endless iterator of finished batches on the device; see the module docstring.

    Generic over what a batch holds: ``finish`` turns one collated host batch into what the training step consumes
    (``classification.ClassificationBatches`` for images with labels; the text-to-image task has its own).

    Attributes:
        dataset: The dataset given to the builder (``len(loader.dataset)`` samples).
        sampler: The ``DistributedSampler`` (one replica when not distributed).
        steps_per_epoch: Batches per epoch on this process (incomplete batches are dropped).
        epoch: Epoch of the batch most recently yielded (starts at 0).
        batches_in_epoch: Batches of ``epoch`` yielded so far (``state_dict`` saves it to resume at the next one).
        batch_size: Samples per batch on this process.
        finish: Host batch -> device batch.
    """

    def __init__(self, loader: DataLoader, dataset, *, finish: Callable[[Any], Any]) -> None:
        self._loader = loader
        self.dataset = dataset
        self.sampler: DistributedSampler = loader.sampler.sampler
        self.batch_size: int = loader.batch_size
        self.steps_per_epoch = len(loader)
        self.epoch = 0
        self.batches_in_epoch = 0
        self._resume_offset = 0
        self.finish = finish
        self._batches: Iterator[Any] | None = None  # the DataLoader iteration running now, for ``close``

    @property
    def skipped(self) -> int:
        """Unreadable samples skipped so far, over all workers (0 if the dataset does not count skips)."""
        return getattr(self.dataset, "skipped", 0)

    def __iter__(self) -> Iterator[Any]:
        # One endless DataLoader iteration across epochs: the workers run on into the next epoch instead of
        # draining and restarting at every boundary (a stall of one batch per worker, each epoch).
        self.batches_in_epoch, self._resume_offset = self._resume_offset, 0
        self._loader.sampler.begin(self.epoch, self.batches_in_epoch * self.batch_size,
                                   per_epoch=self.steps_per_epoch * self.batch_size)
        self._batches = iter(self._loader)
        for batch in self._batches:
            if self.batches_in_epoch == self.steps_per_epoch:
                self.epoch, self.batches_in_epoch = self.epoch + 1, 0
            self.batches_in_epoch += 1
            yield self.finish(batch)

    def close(self) -> None:
        """Stops the worker processes now; the loader is not iterated again. Left to interpreter exit, persistent
        workers with pinned memory take 5 s each to stop (pytorch/pytorch#81794): 70 s with 14 workers."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)  # none in the one-process iteration (no workers)
        if shutdown is not None:
            shutdown()

    def state_dict(self) -> dict[str, int]:
        """The data position: the next batch is batch ``batches_in_epoch`` of ``epoch``."""
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "steps_per_epoch": self.steps_per_epoch, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the batch after ``state`` (call before iterating).

        The sampler order is a function of (seed, epoch) and each sample's augmentation of (seed, epoch, index),
        so starting the sampler past the consumed batches reproduces the rest of the stream without decoding them.
        """
        here = {"steps_per_epoch": self.steps_per_epoch, "dataset_size": len(self.dataset)}
        for key, value in here.items():
            if state[key] != value:
                raise ValueError(f"the saved data position has {key}={state[key]} but this loader has {value}: "
                                 "resume with the same dataset, batch size and number of processes")
        epoch, done = state["epoch"], state["batches_in_epoch"]
        if done >= self.steps_per_epoch:
            epoch, done = epoch + 1, 0
        self.epoch, self.batches_in_epoch, self._resume_offset = epoch, done, done

    def to_device(self, *batch: Any) -> Any:
        """Finishes one host batch (the collated fields, in order) on the device."""
        return self.finish(batch)


def sampled_loader(dataset: torch.utils.data.Dataset, *, batch_size: int, device: torch.device, num_workers: int,
                   seed: int, world_size: int = 1, rank: int = 0, pin_memory: bool | None = None,
                   persistent_workers: bool = True, prefetch_factor: int | None = None,
                   collate_fn: Callable | None = None) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` for ``TrainLoader``: seeded, sharded, resumable, per-sample seeded.

    One seeded sampler for both cases: with a single replica it is a plain seeded shuffle with set_epoch. Each
    sample's augmentation is seeded from (seed, epoch, index), so a run sees the same crops and augmentations
    whatever its number of workers (recipes that tune num_workers stay comparable).
    """
    sampler = EpochTaggedSampler(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                                     seed=seed, drop_last=True))
    workers_kw = {}
    if num_workers > 0:
        workers_kw = {"persistent_workers": persistent_workers, "worker_init_fn": _seed_worker}
        if prefetch_factor is not None:
            workers_kw["prefetch_factor"] = prefetch_factor
    return DataLoader(
        SampleSeeded(dataset, seed), batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        drop_last=True, pin_memory=device.type == "cuda" if pin_memory is None else pin_memory, collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(_rank_seed(seed, rank)), **workers_kw)


class EpochTaggedSampler(torch.utils.data.Sampler):
    """Yields ``(index, epoch)`` pairs from a ``DistributedSampler``, epoch after epoch without end once ``begin``
    has set where to start; ``len`` is one epoch's."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler = sampler
        self._epoch, self._start, self._per_epoch = 0, 0, None

    def begin(self, epoch: int, start: int, per_epoch: int) -> None:
        """The next iteration starts at index ``start`` of ``epoch`` and takes ``per_epoch`` indices of each epoch
        (the ones that fill whole batches, so no batch spans two epochs)."""
        self._epoch, self._start, self._per_epoch = epoch, start, per_epoch

    def __iter__(self):
        epoch, start = self._epoch, self._start
        while True:
            self.sampler.set_epoch(epoch)
            yield from ((index, epoch) for index in itertools.islice(self.sampler, start, self._per_epoch))
            if self._per_epoch is None:  # iterated without begin(): one epoch, as a plain sampler
                return
            epoch, start = epoch + 1, 0

    def __len__(self) -> int:
        return len(self.sampler)


class SampleSeeded(torch.utils.data.Dataset):
    """Seeds python, numpy and torch (CPU) from ``(seed, epoch, index)`` while loading each sample.

    The previous random states are restored afterwards: with ``num_workers=0`` samples load in the training process,
    whose random streams (the diffusion noise, dropout) must not depend on where the data was loaded. Only the CPU
    generator is seeded: ``torch.manual_seed`` would also reseed every CUDA generator.
    """

    def __init__(self, dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        sample_seed = int(np.random.SeedSequence([self.seed, epoch, index]).generate_state(1)[0])
        saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        random.seed(sample_seed)
        np.random.seed(sample_seed)
        torch.random.default_generator.manual_seed(sample_seed)
        try:
            return self.dataset[index]
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.random.set_rng_state(saved[2])


def _seed_worker(worker_id: int) -> None:
    # PyTorch seeds each worker's torch RNG from the loader's generator; derive python and numpy from it so
    # augmentations that use them (timm's RandAugment uses `random`) are reproducible too.
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def _rank_seed(seed: int, rank: int) -> int:
    """A seed for this rank's augmentation stream: distinct per (seed, rank), the same on every run."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)

