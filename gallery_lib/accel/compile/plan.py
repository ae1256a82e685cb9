"""The compile plan of one run, owned in one place: what is compiled, whether it was precompiled, what the caches did.

A run opens it first (``with CompilePlan(dist, compile=..., ...) as plan``, from its compile settings): with
``precompile_workers`` its worker processes start then, so that their imports, CUDA context and compile pool come up
while the model and the data are set up.
``apply_accelerations`` compiles the model's repeated blocks through it (``compile_blocks``), the loop has it
precompile them from one recorded forward before the first step (``precompile``), and the summary reads what it did
(``summary``: the precompile report and the compile-cache statistics of this run alone).

A second run of the same graphs on the same machine starts no workers: the first left a marker beside the compiled
graphs, and its first step loads them from the caches (``precompile/warm.py``). Without workers, a run whose
first step would compile the same block graphs as another run on the machine is compiling now waits for it and loads
them instead (``first_step_done`` ends this run's own hold).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

from torch import nn

from gallery_lib.accel.distributed import DistInfo
from gallery_lib.config.family import ModelFamily
from gallery_lib.config.sections import Job
from gallery_lib.config.sections.acceleration import Compile as CompileSettings


class CompilePlan(contextlib.AbstractContextManager):
    def __init__(self, dist: DistInfo, *, compile: CompileSettings, family: ModelFamily, job: Job, batch_size: int,
                 image_size: int) -> None:
        """The plan of a run with these ``compile`` settings of a model of ``family``; with ``precompile_workers``,
        its ``job``'s model and recipe, ``batch_size`` and ``image_size`` key the hint that such a run left its graphs
        in the caches (``precompile.warm``)."""
        self.settings = compile
        """The run's compile settings."""
        self.family = family
        self.dist = dist
        self.workers = None
        self.hint = None
        """With ``precompile_workers``: the coarse key of this kind of run (``precompile.warm``)."""
        if compile.precompile_workers:  # its section allows it only with compile=True and compile_scope='blocks'
            from gallery_lib.accel.compile.precompile import warm

            self.hint = warm.hint_key(job.model, job.recipe, batch_size, image_size, dist.world_size,
                                      dist.device.type)
            if not warm.hinted_warm(self.hint):  # a second run of the same kind most likely needs no workers
                self.workers = self._start_workers()
        self.blocks: list[str] = []
        """Qualified names of the blocks compiled in place (``compile_scope='blocks'``)."""
        self.compile_kwargs: dict[str, Any] = {}
        """What those blocks were compiled with."""
        self.report = None
        """The ``PrecompileReport`` once precompiled."""
        self.cached_key = None
        """The key of the block graphs when an earlier run left them all in the caches and no worker ran."""
        self.skipped_seconds = 0.0
        """Then: the recording forward that found it out."""
        self._first_step_compiles = None
        """Without workers: (this machine's lock on the block graphs' key, the key) while the first step compiles."""
        self._settings_patched = contextlib.ExitStack()
        """Compiler settings this run changed (``cache_checkpointed_graphs``), restored when the plan closes."""
        from gallery_lib.accel.compile.regional import (cache_bypass_reasons, compile_cache_stats,
                                                        compile_phase_seconds, watch_cache_bypasses)

        # Dynamo's counters live as long as the process (torch._dynamo.reset keeps them): the run reports its own part.
        if compile.compile:  # the summary says why a cache did not keep a graph
            watch_cache_bypasses()
        self._cache_at_start = compile_cache_stats()
        self._bypasses_at_start = cache_bypass_reasons()
        self._phases_at_start = compile_phase_seconds()

    def _start_workers(self):
        from gallery_lib.accel.compile.precompile import CompileWorkers

        # Every rank compiles the same graphs for its own device: the machine's workers are shared out.
        return CompileWorkers(max(1, self.settings.precompile_workers // self.dist.world_size), self.dist.device,
                              imports=self.family.block_modules)

    def __exit__(self, *exc: object) -> None:
        self._settings_patched.close()
        if self.workers is not None:
            self.workers.close()
        if self._first_step_compiles is not None:
            self._first_step_compiles[0].release()

    def cache_checkpointed_graphs(self) -> str:
        """For a checkpointed run on a GPU: its compiled graphs keep the RNG state that a recomputed block needs in
        the form Inductor's caches can store. AOTAutograd treats attention as a random op (it takes a dropout) and,
        by default, saves its RNG state in the form CUDA graphs need, which no cache stores: each run then compiled
        every graph again (two minutes for SD-1.5). A checkpointed run replays no CUDA graphs
        (``graphs_can_replay``), so it needs no such form; the same RNG state is saved and restored."""
        from torch._functorch import config as functorch

        self._settings_patched.enter_context(functorch.patch(graphsafe_rng_functionalization=False))
        return ("compile caches: checkpointed graphs save their RNG state in the form the caches store (not CUDA "
                "graphs', which checkpointing does not replay), so the next run loads them")

    def compile_blocks(self, model: nn.Module, **compile_kwargs: Any) -> list[str]:
        """Compiles each of the model family's repeated blocks in place (``regional_compile``); returns their names."""
        from gallery_lib.accel.compile.regional import regional_compile, with_block_defaults

        whole = self.settings.compile_whole_types
        blocks = tuple(self.family.block_types)
        _refuse_absent_classes(model, whole, blocks)
        # Outermost match wins: a class compiled whole takes the family's blocks inside it into its graph.
        self.blocks = regional_compile(model, whole + blocks, **compile_kwargs)
        self.compile_kwargs = with_block_defaults(compile_kwargs)  # what was compiled: the workers compile the same
        return self.blocks

    def precompile(self, model: nn.Module, forward: Callable[[], Any], log: Callable[[str], Any],
                   meanwhile: Callable[[], Any]) -> bool:
        """Has the workers compile the blocks' distinct graphs from one recorded ``forward`` of the plain ``model``
        (not a DDP wrapper: a forward without its backward would leave DDP's reducer waiting), running ``meanwhile``
        while they compile; returns False, without running ``meanwhile``, when there is nothing to precompile, or
        when an earlier run left every graph in the caches (the first step loads them, and no worker starts).
        Without workers the first step compiles: this waits for another run on the machine compiling the same graphs,
        or else holds them for this run until ``first_step_done``."""
        if not self.blocks or not self.settings.precompile_workers and self.dist.world_size > 1:
            return False  # (ranks of one run record the same graphs: one waiting would stall the others' collectives)
        from gallery_lib.accel.compile.precompile import precompile_blocks, record_block_calls, warm
        from gallery_lib.accel.compile.precompile.record import backend_flags

        start = time.perf_counter()
        calls, _ = record_block_calls(model, forward, self.blocks)
        key = warm.graph_set_key((c.graph_key for c in calls), self.compile_kwargs, backend_flags(),
                                 self.dist.device)
        if not self.settings.precompile_workers:
            self._compile_once_on_this_machine(key, len(calls), log)
            return False
        if warm.is_warm(key):
            if self.workers is not None:
                self.workers.close()
                self.workers = None
            # The first step loads them: sooner to steady speed than loading them here first, at the same reserved
            # peak (benchmarks/RESULTS.md#sd15-compile-time).
            self.cached_key, self.skipped_seconds = key, time.perf_counter() - start
            warm.mark_warm(key, self.hint)
            log(f"[gallery] pre-compilation skipped: an earlier run left the {len(calls)} distinct block graphs (of "
                f"{len(self.blocks)} blocks) in the compile caches; no worker started, the first step loads them "
                f"(recorded in {self.skipped_seconds:.1f} s)")
            return False
        if self.workers is None:  # this kind of run had left them there, these graphs it had not
            self.workers = self._start_workers()
        self.report = precompile_blocks(model, forward, self.blocks, workers=self.workers,
                                        compile_kwargs=self.compile_kwargs, log=log,
                                        load=self.settings.precompile_overlap, meanwhile=meanwhile,
                                        warm_kernels=(self.settings.precompile_first_use
                                                      and self.dist.device.type == "cuda"),
                                        recorded=(calls, time.perf_counter() - start))
        if not self.report.failures and not self.report.load_failures:
            warm.mark_warm(key, self.hint)
        return True

    def _compile_once_on_this_machine(self, key: str, graphs: int, log: Callable[[str], Any]) -> None:
        """Holds this machine's lock on ``key`` until the first step has compiled the graphs; when another run holds
        it, waits for that run instead, whose graphs this run's first step then loads."""
        from gallery_lib.accel.compile.precompile import warm

        if warm.is_warm(key):
            return
        lock = warm.CompileLock(key)
        waited = lock.acquire()
        if waited:
            lock.release()
            log(f"[gallery] waited {waited:.0f} s for another run on this machine that was compiling the same "
                f"{graphs} distinct block graphs: the first step loads them")
        else:
            self._first_step_compiles = (lock, key)

    def first_step_done(self) -> None:
        """The loop's first step has compiled (or loaded) every block graph: marks them warm, ends the hold."""
        if self._first_step_compiles is not None:
            from gallery_lib.accel.compile.precompile import warm

            lock, key = self._first_step_compiles
            warm.mark_warm(key, self.hint)
            lock.release()
            self._first_step_compiles = None

    @property
    def precompile_seconds(self) -> float:
        return self.report.seconds if self.report is not None else self.skipped_seconds

    def summary(self, log: Callable[[str], Any]) -> dict[str, Any]:
        """The run summary's compile records: ``precompile`` (when it ran) and ``compile_cache`` (compiled runs:
        did the run load its graphs, precompiled or from an earlier run, or compile them itself?)."""
        record: dict[str, Any] = {}
        if self.report is not None:
            record["precompile"] = dataclasses.asdict(self.report)
        if self.settings.compile:
            from gallery_lib.accel.compile.regional import (cache_bypass_reasons, compile_cache_stats,
                                                            describe_compile_cache, phase_seconds_since)

            now = compile_cache_stats()
            record["compile_cache"] = {key: now[key] - self._cache_at_start.get(key, 0) for key in now}
            log(f"[gallery] compilation in this run: {describe_compile_cache(record['compile_cache'])}")
            bypassed = cache_bypass_reasons() - self._bypasses_at_start
            if bypassed:  # such graphs are compiled again by every run: the reason is what to fix
                record["compile_cache_bypassed"] = dict(bypassed)
                log("[gallery]   not cached, so compiled again by every run: " + "; ".join(
                    f"{reason} ({count}x)" for reason, count in bypassed.items()))
            # Where this process's compile time went (not the workers'): what a slow start is read from.
            record["compile_phases_s"] = phase_seconds_since(self._phases_at_start)
            if record["compile_phases_s"]:
                log("[gallery]   its longest phases (s; nested, an outer one includes the inner): " + ", ".join(
                    f"{phase} {s:.1f}" for phase, s in list(record["compile_phases_s"].items())[:6]))
            if self.cached_key is not None:
                record["precompile_skipped"] = "graphs in the compile caches from an earlier run"
                cache = record["compile_cache"]
                if cache["aot_autograd_misses"] + cache["fx_graph_misses"] + cache["fx_graph_bypasses"]:
                    from gallery_lib.accel.compile.precompile import warm

                    warm.forget_warm(self.cached_key)  # the caches were emptied: the next run uses workers again
                    log("[gallery]   the compile caches no longer held every graph an earlier run precompiled, so "
                        "this run compiled some itself; the next run precompiles them again")
        return record


def _refuse_absent_classes(model: nn.Module, class_names: tuple[str, ...], block_types: tuple[str, ...]) -> None:
    """``compile_whole`` names only classes ``model`` has: a misspelt one would otherwise compile nothing whole."""
    present = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    absent = [name for name in class_names if name not in present]
    if absent:
        from gallery_lib.accel.compile.regional import block_names
        from gallery_lib.config import ConfigError

        # The classes of the modules above each block, the model's own containers (lists, the root) left out.
        holders = dict.fromkeys(type(model.get_submodule(".".join(parts[:depth]))).__name__
                                for parts in (name.split(".") for name in block_names(model, block_types))
                                for depth in range(1, len(parts)))
        holders = [name for name in holders if name not in ("ModuleList", "Sequential")]
        raise ConfigError(f"compile_whole names {', '.join(absent)}, not a class of {type(model).__name__}'s modules: "
                          f"name classes that hold its blocks ({', '.join(holders)}), or drop compile_whole")
