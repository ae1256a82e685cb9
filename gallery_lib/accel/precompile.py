"""Parallel ahead-of-time compilation of a model's repeated blocks, so regional compilation reaches speed sooner.

Regional compilation (``compile.regional_compile``) compiles each distinct block graph once, but one after the other
in the training process: every distinct graph (block class x parameter shapes x input shapes) costs a Dynamo trace,
AOTAutograd's joint graph and Inductor's lowering and code generation, mostly single-threaded Python.
``precompile_blocks`` spreads those distinct graphs over worker processes that compile them at the same time into
Inductor's on-disk caches (AOTAutograd cache, FX graph cache, Triton kernels); when the training process then
compiles the same blocks, it finds every graph there and only traces and loads.

1. record: the caller's forward runs once eagerly (RNG states restored afterwards) with pre-hooks on the blocks; each
   call's inputs are kept as specs (shape, stride, dtype, requires_grad; other arguments by value) with the autocast
   state of the call.
2. group: calls of the same block class, with the same parameter, buffer and input metadata and the same plain
   attributes (Dynamo guards on those too: SD's mid-block ResNets differ from their neighbours only in
   ``output_scale_factor``), compile to the same graph: one representative each.
3. workers (``python -m gallery_lib.accel.precompile QUEUE DEVICE``, ``CompileWorkers``) start before the recording,
   so that their imports, CUDA context and Inductor compile pool (10-30 s together on a busy machine) come up
   meanwhile; a training run starts them before it even builds the model. Then they all read meta-device copies of
   every representative (real buffers, since index buffers must stay valid), ordered largest first. Each worker
   claims the next unclaimed graph (an exclusive file create: no scheduler, no IPC), runs forward and backward on random inputs of the
   recorded specs through ``module.compile(**compile_kwargs)``, and takes the next, so a slow graph never leaves
   other graphs waiting behind it while a worker sits idle.

4. load as they land (``load=True``): meanwhile this process follows the workers' logs, and once a worker has
   exited (its cores are free) it runs every graph done so far, then each as it lands, once itself (a throwaway copy
   of the block, random inputs of the recorded specs, RNG states restored). That is the Dynamo trace, the cache loads
   and the first run (cuDNN's autotuning included) that the first training step would otherwise do for every graph
   after the last worker finished. Dynamo keeps compiled code per code object with guards on tensor metadata, not on
   the module object, so the run's own blocks of that graph find it ready. SD-1.5 at batch 8 on an H200: loading
   while every worker still compiled slowed them more than it saved (sd15_precompile_overlap_b8_h200.json); waiting
   for the first free cores cuts the warm-up steps from 15.5-19.4 s to 4.8-5.6 s, for 0-10 s more of precompilation
   (sd15_precompile_loading_h200/: 41.9 s to steady speed on average over three runs, against 48.9 s without).

Numerics are unchanged: a cache hit loads the code the training process would have generated itself, and a graph the
workers missed (or a failed worker) is simply compiled by the training process as usual.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from gallery_lib.accel.side_forward import side_forward

_AUTOCAST_DEVICES = ("cuda", "cpu")
_DONE = "compiled "
_READY = "ready: "
_T0_ENV = "GALLERY_PRECOMPILE_T0"
_IMPORTS_ENV = "GALLERY_PRECOMPILE_IMPORTS"
_TIMEOUT_ENV = "GALLERY_PRECOMPILE_TIMEOUT"


@dataclass(frozen=True)
class TensorSpec:
    """What a graph sees of a tensor argument: its metadata, never its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)

    def make(self, device: torch.device) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if t.is_floating_point():
            t.normal_()
        else:
            t.zero_()  # indices and masks: zero is valid wherever an index is
        return t.requires_grad_(self.requires_grad)


@dataclass
class BlockCall:
    """One distinct block graph: the representative block's name and the specs of its call."""

    name: str
    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    training: bool
    cost: int
    module: nn.Module | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


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

    def describe(self) -> str:
        failed = f"; {len(self.failures)} worker(s) failed, their graphs compile in the run" if self.failures else ""
        if self.load_failures:
            failed += f"; {len(self.load_failures)} graph(s) failed to load here, the run compiles them"
        where = []  # where the wall time went: worker start-up, the recording forward, the slowest graph, loading
        if self.startup_seconds:
            where.append(f"workers ready after {max(self.startup_seconds.values()):.1f} s")
        if self.record_seconds == self.record_seconds:  # not NaN
            where.append(f"recording {self.record_seconds:.1f} s")
        if self.graph_seconds:
            where.append(f"slowest graph {max(self.graph_seconds.values()):.1f} s, "
                         f"all graphs {sum(self.graph_seconds.values()):.0f} s of worker time")
        if self.load_seconds:
            where.append(f"{len(self.load_seconds)} graphs loaded here beside the last workers in "
                         f"{sum(self.load_seconds.values()):.1f} s, "
                         f"{max(0.0, self.seconds - self.workers_done_seconds):.1f} s of it after the last worker")
        return (f"pre-compiled {self.graphs} distinct block graphs (of {self.blocks} blocks) in {self.workers} "
                f"parallel processes in {self.seconds:.1f} s" + (f" ({'; '.join(where)})" if where else "") + failed)


def _spec(value: Any) -> Any:
    return TensorSpec.of(value) if isinstance(value, torch.Tensor) else value


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


_PLAIN = (bool, int, float, str, type(None))


def _plain_attributes(module: nn.Module) -> tuple:
    """The public scalar attributes of ``module`` and its children: Dynamo specializes a graph on their values."""
    found = []
    for prefix, m in module.named_modules():
        for name, value in sorted(vars(m).items()):
            if name.startswith("_"):
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, (tuple, list))
                                             and all(isinstance(v, _PLAIN) for v in value)):
                found.append((prefix, name, repr(value)))
    return tuple(found)


def _graph_key(module: nn.Module, call: BlockCall) -> tuple:
    tensors = tuple((n, TensorSpec.of(t)) for n, t in (*module.named_parameters(), *module.named_buffers()))
    return (type(module).__qualname__, repr(module), _plain_attributes(module), tensors, repr(call.args),
            repr(sorted(call.kwargs.items())), call.autocast, call.training)


def record_block_calls(model: nn.Module, forward: Callable[[], Any], names: Iterable[str]) -> tuple[list[BlockCall],
                                                                                                     int]:
    """Runs ``forward()`` once eagerly and returns the distinct graphs among the calls of the named blocks, plus the
    number of block calls seen. RNG states are restored, so the run's random stream is unchanged."""
    distinct: dict[tuple, BlockCall] = {}
    seen = 0

    def hook(module: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        nonlocal seen
        seen += 1
        call = BlockCall(name, tree_map(_spec, args), tree_map(_spec, kwargs), _autocast_state(), module.training,
                         cost=sum(p.numel() for p in module.parameters()))
        distinct.setdefault(_graph_key(module, call), call)

    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, k, n=n: hook(m, a, k, n), with_kwargs=True) for n in names]
    try:
        with side_forward():
            forward()
    finally:
        for h in handles:
            h.remove()
    return list(distinct.values()), seen


def _meta_copy(module: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy of ``module`` with parameters on the meta device (no memory) and its buffers' values on the CPU."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    buffers = {n: b.detach().cpu() for n, b in module.named_buffers()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo), buffers


def _largest_first(calls: list[BlockCall]) -> list[BlockCall]:
    """The queue's order: by parameter count, which tracks a block's compile time (wide blocks compile slowest)."""
    return sorted(calls, key=lambda c: -c.cost)


def _claim(claims: Path, index: int) -> bool:
    """True for exactly one worker per ``index``: whoever creates the claim file first compiles that graph."""
    try:
        os.close(os.open(claims / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _backend_flags() -> dict[str, Any]:
    return {"matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


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
        self.started = time.perf_counter()
        self._tmp = tempfile.TemporaryDirectory(prefix="gallery_precompile_")
        self.queue_path = Path(self._tmp.name) / "queue.pt"
        (Path(self._tmp.name) / "claims").mkdir()
        # The workers unpickle the blocks: their classes must import there as here (a notebook's or a test's module).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **{
            _T0_ENV: repr(time.time()), _IMPORTS_ENV: ",".join(sorted(set(imports))),
            _TIMEOUT_ENV: repr(timeout_s)})
        # Each worker would start a Triton compile pool as large as the machine: share the cores out instead.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        for i in range(count):
            log_path = Path(self._tmp.name) / f"worker{i}.log"
            with open(log_path, "w") as out:
                self.procs.append((subprocess.Popen(
                    [sys.executable, "-m", "gallery_lib.accel.precompile", str(self.queue_path), str(torch.device(device))],
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
                      load: bool = False, meanwhile: Callable[[], Any] | None = None) -> PrecompileReport:
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
    """
    start = time.perf_counter()
    names = list(names)
    device = next(iter(model.parameters())).device
    if not isinstance(workers, CompileWorkers):
        # Started now, their imports, CUDA context and compile pool come up while this process records.
        workers = CompileWorkers(workers, device, {type(model.get_submodule(n)).__module__ for n in names},
                                 timeout_s)
    failures: list[str] = []
    graph_seconds: dict[str, float] = {}
    startup: dict[str, float] = {}
    with workers:  # an error in here (in the caller's forward, say) must not leave workers waiting for a queue
        calls, _ = record_block_calls(model, forward, names)
        record_seconds = time.perf_counter() - start
        queue = _largest_first(calls)
        _write_queue(workers.queue_path, queue, model, device, compile_kwargs)
        _warm_compile_pool(wait=False)  # this process loads the compiled kernels next: its pool must be up
        if meanwhile is not None:
            meanwhile()
        loading = _Loader(queue if load else [], device, compile_kwargs)
        killed, workers_done = _follow_workers(workers, loading, deadline=time.monotonic() + timeout_s)
        for call in queue:
            call.module, call.buffers = None, {}
        for i, (proc, log_path) in enumerate(workers.procs):
            code = "timeout" if proc in killed else proc.returncode
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith(_DONE):  # "compiled NAME in SECONDS s", written by compile_queue
                    name, _, seconds = line[len(_DONE):].rpartition(" in ")
                    graph_seconds[name] = float(seconds.rstrip(" s"))
                elif line.startswith(_READY):
                    for phase, seconds in json.loads(line[len(_READY):]).items():
                        startup[phase] = max(startup.get(phase, 0.0), seconds)
            if code != 0:
                tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
                failures.append(f"worker {i} ({code}): {tail}"[:500])
    report = PrecompileReport(len(names), len(calls), workers.count, time.perf_counter() - start, failures,
                              graph_seconds, record_seconds, startup, loading.seconds, workers_done - start,
                              loading.failures)
    log(f"[gallery] {report.describe()}")
    for failure in failures:
        log(f"[gallery]   precompile {failure}")
    for failure in loading.failures:
        log(f"[gallery]   precompile: loading {failure}")
    return report


def _finished_graphs(log_path: Path) -> list[str]:
    """The names a worker has reported as compiled so far ("compiled NAME in SECONDS s" lines of its log)."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    complete = text.split("\n")[:-1]  # a line still being written has no newline yet
    return [line[len(_DONE):].rpartition(" in ")[0] for line in complete if line.startswith(_DONE)]


class _Loader:
    """Step 4: runs graphs of ``queue`` once in this process, each when told a worker has compiled it."""

    def __init__(self, queue: list[BlockCall], device: torch.device, compile_kwargs: dict[str, Any]) -> None:
        self.waiting = {call.name: call for call in queue}
        self.device = device
        self.compile_kwargs = compile_kwargs
        self.seconds: dict[str, float] = {}
        self.failures: list[str] = []

    def load(self, finished: Iterable[str]) -> bool:
        """Loads the finished graphs not loaded yet; False when there was none."""
        ready = [self.waiting.pop(name) for name in finished if name in self.waiting]
        for call in ready:
            start = time.perf_counter()
            devices = [self.device] if self.device.type == "cuda" else []
            try:
                with torch.random.fork_rng(devices=devices):
                    _compile_call(call, self.device, self.compile_kwargs)
            except Exception as exc:  # noqa: BLE001 - the run then compiles this graph itself, as without workers
                self.failures.append(f"{call.name}: {type(exc).__name__}: {str(exc).strip()[:300]}")
            else:
                self.seconds[call.name] = time.perf_counter() - start
            call.module, call.buffers = None, {}  # the copy's weights on the device are no longer needed
        return bool(ready)


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
        # Loading waits for a worker to exit (nothing left to claim), which frees its cores: loading while all of
        # them compiled slowed them more than it saved (H200, sd15_precompile_overlap_b8_h200.json: 196 -> 233 s of
        # worker time). Read after the poll: a worker seen exited has written all its lines, none is missed.
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
                 compile_kwargs: dict[str, Any]) -> None:
    """Saves the queue with meta copies of its blocks, then renames it into place: workers never see half a file."""
    for call in queue:  # the copies stay on the calls: this process loads from them too (step 4)
        call.module, call.buffers = _meta_copy(model.get_submodule(call.name))
    partial = path.with_suffix(".partial")
    torch.save({"calls": queue, "compile_kwargs": compile_kwargs, "device": str(device),
                "flags": _backend_flags()}, partial)
    os.replace(partial, path)


def _apply_flags(flags: dict[str, Any]) -> None:
    # Only what differs: even a no-op assignment switches the newer fp32_precision setting from "none" to "ieee",
    # which is part of Inductor's cache key, and every graph would then miss.
    if torch.get_float32_matmul_precision() != flags["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    if torch.backends.cuda.matmul.allow_tf32 != flags["matmul_tf32"]:
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    if torch.backends.cudnn.allow_tf32 != flags["cudnn_tf32"]:
        torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    if torch.are_deterministic_algorithms_enabled() != flags["deterministic"]:
        torch.use_deterministic_algorithms(flags["deterministic"], warn_only=True)


def _compile_call(call: BlockCall, device: torch.device, compile_kwargs: dict[str, Any]) -> None:
    module = call.module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02) if p.is_floating_point() else p.zero_()
        for name, value in call.buffers.items():
            module.get_buffer(name).copy_(value)
    module.train(call.training)
    module.compile(**compile_kwargs)
    args = tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, call.args)
    kwargs = tree_map(lambda v: v.make(device) if isinstance(v, TensorSpec) else v, call.kwargs)
    contexts = [torch.autocast(d, dtype=dtype, enabled=on) for d, on, dtype in call.autocast
                if on and (d != "cuda" or device.type == "cuda")]
    with torch.enable_grad():
        for ctx in contexts:
            ctx.__enter__()
        try:
            out = module(*args, **kwargs)
        finally:
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
        grads_for = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads_for:  # the backward graph is compiled on the first backward, as in the run
            torch.autograd.backward(grads_for, [torch.randn_like(t) for t in grads_for])


def _since_start() -> float:
    return time.time() - float(os.environ.get(_T0_ENV, time.time()))


def _warm_up(device: torch.device, imports: list[str]) -> dict[str, float]:
    """What every worker's first compile would otherwise wait for: the blocks' modules, the CUDA context and
    Inductor's pool of compile processes. Returns when each phase ended, in seconds since ``precompile_blocks``
    started (a worker that is slow to start shows which phase it waited on)."""
    marks = {"python": _since_start()}
    for module in imports:
        importlib.import_module(module)
    marks["imports"] = _since_start()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()
    marks["cuda"] = _since_start()
    _warm_compile_pool(wait=True)
    marks["pool"] = _since_start()
    return marks


def _warm_compile_pool(wait: bool) -> None:
    """Starts Inductor's pool of compile processes now rather than at the first compile (a private API: if it
    changes, the compile starts the pool itself, later)."""
    try:
        importlib.import_module("torch._inductor.compile_fx")
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        if wait:
            AsyncCompile.wait_pool_ready()
    except Exception as exc:  # noqa: BLE001
        print(f"compile pool warm-up skipped: {type(exc).__name__}: {exc}", flush=True)


def _wait_for(path: Path, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Waits for the queue file; False when the parent process went away or ``timeout_s`` passed first."""
    parent = os.getppid()
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if os.getppid() != parent or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def compile_queue(path: str, device: str) -> None:
    """The worker's job: warm up, wait for the queue file written by ``precompile_blocks``, then claim and compile
    its graphs until none is left unclaimed."""
    marks = _warm_up(torch.device(device), [m for m in os.environ.get(_IMPORTS_ENV, "").split(",") if m])
    print(_READY + json.dumps(marks), flush=True)
    if not _wait_for(Path(path), float(os.environ.get(_TIMEOUT_ENV, "1800"))):
        return
    queue = torch.load(path, weights_only=False)
    _apply_flags(queue["flags"])
    # cuDNN's autotuning (cudnn.benchmark) would time every convolution of the graph's first run here, and its
    # choices die with this process: the run tunes its own. The flag is in neither Inductor's cache key nor
    # Dynamo's guards, so the cached graphs are the ones the run would compile (test_precompile checks the hits).
    torch.backends.cudnn.benchmark = False
    from gallery_lib.accel.compile import raise_recompile_limit

    raise_recompile_limit()
    claims = Path(path).parent / "claims"
    for index, call in enumerate(queue["calls"]):
        if not _claim(claims, index):
            continue
        t = time.perf_counter()
        _compile_call(call, torch.device(queue["device"]), queue["compile_kwargs"])
        print(f"{_DONE}{call.name} in {time.perf_counter() - t:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m gallery_lib.accel.precompile QUEUE.pt DEVICE  (started by precompile_blocks)",
              file=sys.stderr)
        return 2
    # Through the importable module, not __main__: the pickled specs refer to gallery_lib.accel.precompile's classes.
    from gallery_lib.accel.precompile import compile_queue as run_queue

    run_queue(args[0], args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
