"""The compile plan of one run, owned in one place: what is compiled, whether it was precompiled, what the caches did.

A run opens it first (``with CompilePlan(cfg, dist) as plan``): with ``precompile_workers`` its worker processes start
then, so that their imports, CUDA context and compile pool come up while the model and the data are set up.
``apply_accelerations`` compiles the model's repeated blocks through it (``compile_blocks``), the loop has it
precompile them from one recorded forward before the first step (``precompile``), and the summary reads what it did
(``summary``: the precompile report and the compile-cache statistics of this run alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

from torch import nn

from gallery_lib.accel.distributed import DistInfo


class CompilePlan(contextlib.AbstractContextManager):
    def __init__(self, cfg, dist: DistInfo) -> None:
        self.cfg = cfg
        self.workers = None
        if cfg.precompile_workers:  # RunConfig allows it only with compile=True and compile_scope='blocks'
            from gallery_lib.accel.precompile import CompileWorkers

            # Every rank compiles the same graphs for its own device: the machine's workers are shared out.
            self.workers = CompileWorkers(max(1, cfg.precompile_workers // dist.world_size), dist.device,
                                          imports=cfg.model_family.block_modules)
        self.blocks: list[str] = []
        """Qualified names of the blocks compiled in place (``compile_scope='blocks'``)."""
        self.compile_kwargs: dict[str, Any] = {}
        """What those blocks were compiled with."""
        self.report = None
        """The ``PrecompileReport`` once precompiled."""
        from gallery_lib.accel.compile import compile_cache_stats

        # Dynamo's counters live as long as the process (torch._dynamo.reset keeps them): the run reports its own part.
        self._cache_at_start = compile_cache_stats()

    def __exit__(self, *exc: object) -> None:
        if self.workers is not None:
            self.workers.close()

    def compile_blocks(self, model: nn.Module, **compile_kwargs: Any) -> list[str]:
        """Compiles each of the model family's repeated blocks in place (``regional_compile``); returns their names."""
        from gallery_lib.accel.compile import regional_compile

        self.blocks = regional_compile(model, self.cfg.model_family.block_types, **compile_kwargs)
        self.compile_kwargs = compile_kwargs
        return self.blocks

    def precompile(self, model: nn.Module, forward: Callable[[], Any], log: Callable[[str], Any],
                   meanwhile: Callable[[], Any]) -> bool:
        """Has the workers compile the blocks' distinct graphs from one recorded ``forward`` of the plain ``model``
        (not a DDP wrapper: a forward without its backward would leave DDP's reducer waiting), running ``meanwhile``
        while they compile; returns False, without running ``meanwhile``, when there is nothing to precompile."""
        if self.workers is None or not self.blocks:
            return False
        from gallery_lib.accel.precompile import precompile_blocks

        self.report = precompile_blocks(model, forward, self.blocks, workers=self.workers,
                                        compile_kwargs=self.compile_kwargs, log=log,
                                        load=self.cfg.precompile_overlap, meanwhile=meanwhile)
        return True

    @property
    def precompile_seconds(self) -> float:
        return self.report.seconds if self.report is not None else 0.0

    def summary(self, log: Callable[[str], Any]) -> dict[str, Any]:
        """The run summary's compile records: ``precompile`` (when it ran) and ``compile_cache`` (compiled runs:
        did the run load its graphs, precompiled or from an earlier run, or compile them itself?)."""
        record: dict[str, Any] = {}
        if self.report is not None:
            record["precompile"] = dataclasses.asdict(self.report)
        if self.cfg.compile:
            from gallery_lib.accel.compile import compile_cache_stats, describe_compile_cache

            now = compile_cache_stats()
            record["compile_cache"] = {key: now[key] - self._cache_at_start.get(key, 0) for key in now}
            log(f"[gallery] compilation in this run: {describe_compile_cache(record['compile_cache'])}")
        return record
