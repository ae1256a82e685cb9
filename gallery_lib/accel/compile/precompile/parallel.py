"""Step 3-4 of precompilation, in the training process: ``precompile_blocks`` starts (or is given) the workers,
writes their queue, loads each graph as it lands once a worker's cores are free, and reports what happened."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from gallery_lib.accel.compile.regional import compile_phase_seconds, phase_seconds_since
from gallery_lib.accel.compile.cpu_codegen import use_safe_cpu_codegen
from gallery_lib.accel.compile.precompile.record import (BlockCall, backend_flags, compile_call, largest_first,
                                                         meta_copy, record_block_calls, run_eagerly)
from gallery_lib.accel.compile.precompile.worker import (DONE_PREFIX, IMPORTS_ENV, PHASES_PREFIX, READY_PREFIX,
                                                         STARTED_SEP, T0_ENV, TIMEOUT_ENV, warm_compile_pool)

@dataclass
class PrecompileReport:
    """What ``precompile_blocks`` did, for the run's log and summary."""

    blocks: int
    graphs: int
    workers: int
    seconds: float
    failures: list[str] = field(default_factory=list)
    graph_seconds: dict[str, float] = field(default_factory=dict)
    """Per representative block: seconds its worker spent compiling it (forward and backward)."""
    record_seconds: float = float("nan")
    """The recording forward pass (the workers start up meanwhile)."""
    startup_seconds: dict[str, float] = field(default_factory=dict)
    """When the slowest worker was done with each start-up phase (python, imports, cuda, pool), from its start."""
    load_seconds: dict[str, float] = field(default_factory=dict)
    """Per representative block: seconds this process spent loading and first running its graph (step 4)."""
    workers_done_seconds: float = float("nan")
    """When the last worker finished, from the start; ``seconds`` minus this is the loading left after it."""
    load_failures: list[str] = field(default_factory=list)
    schedule: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Per representative block: the worker that compiled it, when it started (seconds after the queue was in place)
    and for how long: with ``graph_seconds`` summed, it tells uneven shares from slow compiles."""
    worker_phases: dict[str, float] = field(default_factory=dict)
    """The workers' compile phases (``dynamo_timed``'s, nested: Dynamo, AOTAutograd, Inductor, Triton, autotuning),
    seconds summed over every graph: where ``graph_seconds`` went."""
    load_phases: dict[str, float] = field(default_factory=dict)
    """The same for this process's loading: where ``load_seconds`` went."""
    first_use_seconds: float = float("nan")
    """This process running each graph's block once uncompiled while the workers compile (``warm_kernels``)."""
    first_use_error: str = ""
    """What stopped that early, if anything did."""

    def compile_span(self) -> float:
        """Seconds from the queue being in place to the last graph compiled."""
        return max((start + seconds for _, start, seconds in self.schedule.values()), default=float("nan"))

    def workers_busy(self) -> float:
        """The share of the workers' time over ``compile_span`` spent compiling."""
        return sum(seconds for _, _, seconds in self.schedule.values()) / (self.compile_span() * self.workers)

    def describe(self) -> str:
        failed = f"; {len(self.failures)} worker(s) failed, their graphs compile in the run" if self.failures else ""
        if self.load_failures:
            failed += f"; {len(self.load_failures)} graph(s) failed to load here, the run compiles them"
        if self.first_use_error:
            failed += f"; running the blocks uncompiled stopped early ({self.first_use_error})"
        where = []  # where the wall time went: worker start-up, the recording forward, the slowest graph, loading
        if self.startup_seconds:
            where.append(f"workers ready after {max(self.startup_seconds.values()):.1f} s")
        if not math.isnan(self.record_seconds):
            where.append(f"recording {self.record_seconds:.1f} s")
        if not math.isnan(self.first_use_seconds):
            where.append(f"the blocks' kernels first run here in {self.first_use_seconds:.1f} s")
        if self.graph_seconds:
            where.append(f"slowest graph {max(self.graph_seconds.values()):.1f} s, "
                         f"all graphs {sum(self.graph_seconds.values()):.0f} s of worker time")
        if self.schedule:
            where.append(f"workers busy {self.workers_busy():.0%} of the {self.compile_span():.1f} s from the queue "
                         f"to the last graph")
        if self.load_seconds:
            where.append(f"{len(self.load_seconds)} graphs loaded here beside the last workers in "
                         f"{sum(self.load_seconds.values()):.1f} s, "
                         f"{max(0.0, self.seconds - self.workers_done_seconds):.1f} s of it after the last worker")
        return (f"pre-compiled {self.graphs} distinct block graphs (of {self.blocks} blocks) in {self.workers} "
                f"parallel processes in {self.seconds:.1f} s" + (f" ({'; '.join(where)})" if where else "") + failed)


class CompileWorkers:
    """The worker processes of ``precompile_blocks``, which can start before it: a training run starts them first, so
    that their imports, CUDA context and compile pool come up while it builds the model and loads the data.

    A context manager: leaving it (or ``close()``) stops any worker still running. Workers that never get a queue
    exit on their own once ``timeout_s`` has passed or this process is gone.
    """

    def __init__(self, count: int, device: torch.device | str, imports: Iterable[str] = (),
                 timeout_s: float = 1800.0) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"workers={count!r} is invalid: expected an integer >= 1.")
        self.count = count
        self.launched_at = time.time()
        """The wall-clock time the workers count their start-up and their graphs' starts from."""
        self._tmp = tempfile.TemporaryDirectory(prefix="gallery_precompile_")
        self.queue_path = Path(self._tmp.name) / "queue.pt"
        (Path(self._tmp.name) / "claims").mkdir()
        # The workers unpickle the blocks: their classes must import there as here (a notebook's or a test's module).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **{
            T0_ENV: repr(self.launched_at), IMPORTS_ENV: ",".join(sorted(set(imports))),
            TIMEOUT_ENV: repr(timeout_s)})
        # Each worker would start a Triton compile pool as large as the machine: share the cores out instead.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        for i in range(count):
            log_path = Path(self._tmp.name) / f"worker{i}.log"
            with open(log_path, "w") as out:
                self.procs.append((subprocess.Popen(
                    [sys.executable, "-m", "gallery_lib.accel.compile.precompile.worker", str(self.queue_path),
                     str(torch.device(device))],
                    stdout=out, stderr=subprocess.STDOUT, env=env), log_path))

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> "CompileWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def precompile_blocks(model: nn.Module, forward: Callable[[], Any], names: Iterable[str], *,
                      workers: int | CompileWorkers, compile_kwargs: dict[str, Any],
                      log: Callable[[str], Any] = print, timeout_s: float = 1800.0,
                      load: bool = False, meanwhile: Callable[[], Any] | None = None,
                      recorded: tuple[list[BlockCall], float] | None = None,
                      warm_kernels: bool | None = None) -> PrecompileReport:
    """Compiles the distinct graphs of the named blocks in ``workers`` parallel processes into the on-disk caches.

    Args:
        model: the model whose blocks the run will compile with ``module.compile(**compile_kwargs)``.
        forward: runs the model's forward once as the training step does (same batch shape, autocast, train mode).
        names: qualified names of the blocks (``regional_compile``'s return value).
        workers: how many processes compile at the same time (each holds one block's weights and one call's
            activations in device memory at a time; one with nothing left to claim exits), or ``CompileWorkers``
            started earlier. Either way they are stopped when this returns.
        compile_kwargs: exactly what the run passes to ``module.compile`` (a different option is a different graph).
        timeout_s: a worker still running after this long is stopped; graphs it had not finished compile in the run.
        load: load the graphs in this process as the workers finish them (step 4); ``False`` leaves all the loading
            to the first training step.
        meanwhile: other work for this process, run once the workers have their queue: while they compile it costs
            the run no time.
        recorded: the distinct graphs the caller already recorded (``record_block_calls``) and the seconds that
            took, instead of recording them here while the workers start.
        warm_kernels: run each graph's block once uncompiled here while the workers compile, so that the libraries'
            kernels are built before loading needs them (cuDNN compiles its kernels for the GPU on first use on a
            machine: benchmarks/RESULTS.md#precompile-loading). By default on a GPU.
    """
    start = time.perf_counter()
    names = list(names)
    device = next(iter(model.parameters())).device
    if device.type == "cpu":  # the C++ code width, decided before the workers copy it (record.backend_flags)
        use_safe_cpu_codegen()
    if not isinstance(workers, CompileWorkers):
        # Started now, their imports, CUDA context and compile pool come up while this process records.
        workers = CompileWorkers(workers, device, {type(model.get_submodule(n)).__module__ for n in names},
                                 timeout_s)
    failures: list[str] = []
    graph_seconds: dict[str, float] = {}
    schedule: dict[str, tuple[int, float, float]] = {}
    startup: dict[str, float] = {}
    phases: Counter[str] = Counter()  # seconds per compile phase, summed over the workers' graphs
    with workers:  # an error in here (in the caller's forward, say) must not leave workers waiting for a queue
        if recorded is None:
            calls, _ = record_block_calls(model, forward, names)
            record_seconds = time.perf_counter() - start
        else:
            calls, record_seconds = recorded
            start -= record_seconds  # the report's times count from the recording's start, as without it
        queue = largest_first(calls)
        queue_at = _write_queue(workers.queue_path, queue, model, device, compile_kwargs) - workers.launched_at
        warm_compile_pool(wait=False)  # this process loads the compiled kernels next: its pool must be up
        if meanwhile is not None:
            meanwhile()
        first_use, first_use_error = float("nan"), ""
        if device.type == "cuda" if warm_kernels is None else warm_kernels:
            first_use, first_use_error = _run_eagerly(queue, device)
        loading = _Loader(queue if load else [], device, compile_kwargs)
        killed, workers_done = _follow_workers(workers, loading, deadline=time.monotonic() + timeout_s)
        for call in queue:
            call.module, call.buffers = None, {}
        for i, (proc, log_path) in enumerate(workers.procs):
            code = "timeout" if proc in killed else proc.returncode
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith(DONE_PREFIX):  # "compiled NAME in SECONDS s, started at T s" (compile_queue)
                    name, _, timing = line[len(DONE_PREFIX):].rpartition(" in ")
                    seconds, _, started = timing.partition(STARTED_SEP)
                    graph_seconds[name] = float(seconds.rstrip(" s"))
                    schedule[name] = (i, float(started.rstrip(" s")) - queue_at, graph_seconds[name])
                elif line.startswith(PHASES_PREFIX):  # "phases NAME {JSON}"
                    phases.update(json.loads(line[len(PHASES_PREFIX):].partition(" ")[2]))
                elif line.startswith(READY_PREFIX):
                    for phase, seconds in json.loads(line[len(READY_PREFIX):]).items():
                        startup[phase] = max(startup.get(phase, 0.0), seconds)
            if code != 0:
                tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
                failures.append(f"worker {i} ({code}): {tail}"[:500])
    report = PrecompileReport(len(names), len(calls), workers.count, time.perf_counter() - start, failures,
                              graph_seconds, record_seconds, startup, loading.seconds, workers_done - start,
                              loading.failures, schedule,
                              dict(phases.most_common()), dict(loading.phases.most_common()), first_use,
                              first_use_error)
    log(f"[gallery] {report.describe()}")
    for failure in failures:
        log(f"[gallery]   precompile {failure}")
    for failure in loading.failures:
        log(f"[gallery]   precompile: loading {failure}")
    return report


def _run_eagerly(queue: list[BlockCall], device: torch.device) -> tuple[float, str]:
    """``run_eagerly`` for each call, the run's random stream kept; returns the seconds taken and the error that
    stopped it early, if one did (the run goes on: loading and the first step run these kernels anyway)."""
    start = time.perf_counter()
    error = ""
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for call in queue:
                run_eagerly(call, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - an out-of-memory here must not end the run
        error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return time.perf_counter() - start, error


def _finished_graphs(log_path: Path) -> list[str]:
    """The names a worker has reported as compiled so far ("compiled NAME in SECONDS s" lines of its log)."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    complete = text.split("\n")[:-1]  # a line still being written has no newline yet
    return [line[len(DONE_PREFIX):].rpartition(" in ")[0] for line in complete if line.startswith(DONE_PREFIX)]


class _Loader:
    """Step 4: runs graphs of ``queue`` once in this process, each when told a worker has compiled it."""

    def __init__(self, queue: list[BlockCall], device: torch.device, compile_kwargs: dict[str, Any]) -> None:
        self.waiting = {call.name: call for call in queue}
        self.device = device
        self.compile_kwargs = compile_kwargs
        self.seconds: dict[str, float] = {}
        self.phases: Counter[str] = Counter()
        self.failures: list[str] = []

    def load(self, finished: Iterable[str]) -> bool:
        """Loads one finished graph not loaded yet (the caller polls the workers between graphs); False when there
        was none."""
        name = next((name for name in finished if name in self.waiting), None)
        if name is None:
            return False
        call = self.waiting.pop(name)
        start, phases = time.perf_counter(), compile_phase_seconds()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                compile_call(call, self.device, self.compile_kwargs)
        except Exception as exc:  # noqa: BLE001 - the run then compiles this graph itself, as without workers
            self.failures.append(f"{call.name}: {type(exc).__name__}: {str(exc).strip()[:300]}")
        else:
            self.seconds[call.name] = time.perf_counter() - start
            self.phases.update(phase_seconds_since(phases, top=8))
        call.module, call.buffers = None, {}  # the copy's weights on the device are no longer needed
        return True


def _follow_workers(workers: CompileWorkers, loading: _Loader, deadline: float,
                    poll_s: float = 0.05) -> tuple[list[subprocess.Popen], float]:
    """Waits for every worker to exit, loading graphs as they land; kills those still running at ``deadline``.
    Returns the killed workers and the ``time.perf_counter()`` at which none was running any more."""
    killed: list[subprocess.Popen] = []
    done_at = None
    while True:
        running = [proc for proc, _ in workers.procs if proc.poll() is None]
        if not running and done_at is None:
            done_at = time.perf_counter()
        # Loading waits for a worker to exit (nothing left to claim), which frees its cores
        # (RESULTS.md#sd15-compile-time).
        # Read after the poll: a worker seen exited has written all its lines, none is missed.
        loaded = bool(loading.waiting) and len(running) < len(workers.procs) and loading.load(
            name for _, log_path in workers.procs for name in _finished_graphs(log_path))
        if not running and not loaded:
            return killed, done_at
        if running and time.monotonic() > deadline:
            for proc in running:
                proc.kill()
                proc.wait()
            killed += running
            continue
        if not loaded:
            time.sleep(poll_s)


def _write_queue(path: Path, queue: list[BlockCall], model: nn.Module, device: torch.device,
                 compile_kwargs: dict[str, Any]) -> float:
    """Saves the queue with meta copies of its blocks, then renames it into place: workers never see half a file.
    Returns the wall-clock time just before the rename, when no worker can have read it yet."""
    for call in queue:  # the copies stay on the calls: this process loads from them too (step 4)
        call.module, call.buffers = meta_copy(model.get_submodule(call.name))
    partial = path.with_suffix(".partial")
    torch.save({"calls": queue, "compile_kwargs": compile_kwargs, "device": str(device),
                "flags": backend_flags()}, partial)
    in_place_at = time.time()
    os.replace(partial, path)
    return in_place_at
