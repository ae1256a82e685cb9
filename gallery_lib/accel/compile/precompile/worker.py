"""Step 3 of precompilation: the worker process
(``python -m gallery_lib.accel.compile.precompile.worker QUEUE DEVICE``).

It warms up (imports, CUDA context, Inductor's compile pool), waits for the queue ``precompile_blocks`` writes,
then claims and compiles its graphs one at a time (an exclusive file create per graph) until none is left.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from gallery_lib.accel.compile.precompile.record import apply_flags, compile_call
from gallery_lib.accel.torch_switches import cap_worker_gpu_memory

DONE_PREFIX = "compiled "
STARTED_SEP = ", started at "
"""A finished graph's line: "compiled NAME in SECONDS s, started at T s" (T: since the workers were launched)."""
PHASES_PREFIX = "phases "
"""A finished graph's compile phases: "phases NAME {JSON: phase -> seconds}", the longest of ``dynamo_timed``'s."""
READY_PREFIX = "ready: "
T0_ENV = "GALLERY_PRECOMPILE_T0"
IMPORTS_ENV = "GALLERY_PRECOMPILE_IMPORTS"
TIMEOUT_ENV = "GALLERY_PRECOMPILE_TIMEOUT"


def _claim(claims: Path, index: int) -> bool:
    """True for exactly one worker per ``index``: whoever creates the claim file first compiles that graph."""
    try:
        os.close(os.open(claims / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _since_start() -> float:
    return time.time() - float(os.environ.get(T0_ENV, time.time()))


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
        cap_worker_gpu_memory(device)  # the run's memory plan leaves each worker a share of its cap
    marks["cuda"] = _since_start()
    warm_compile_pool(wait=True)
    marks["pool"] = _since_start()
    return marks


def warm_compile_pool(wait: bool) -> None:
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
    marks = _warm_up(torch.device(device), [m for m in os.environ.get(IMPORTS_ENV, "").split(",") if m])
    print(READY_PREFIX + json.dumps(marks), flush=True)
    if not _wait_for(Path(path), float(os.environ.get(TIMEOUT_ENV, "1800"))):
        return
    queue = torch.load(path, weights_only=False)
    apply_flags(queue["flags"])
    # cuDNN's autotuning (cudnn.benchmark) would time every convolution of the graph's first run here, and its
    # choices die with this process: the run tunes its own. The flag is in neither Inductor's cache key nor
    # Dynamo's guards, so the cached graphs are the ones the run would compile (test_precompile checks the hits).
    torch.backends.cudnn.benchmark = False
    from gallery_lib.accel.compile.regional import compile_phase_seconds, phase_seconds_since, raise_recompile_limit

    raise_recompile_limit()
    claims = Path(path).parent / "claims"
    for index, call in enumerate(queue["calls"]):
        if not _claim(claims, index):
            continue
        started, t, phases = _since_start(), time.perf_counter(), compile_phase_seconds()
        compile_call(call, torch.device(queue["device"]), queue["compile_kwargs"])
        seconds = time.perf_counter() - t
        print(f"{PHASES_PREFIX}{call.name} {json.dumps(phase_seconds_since(phases, top=8))}", flush=True)
        print(f"{DONE_PREFIX}{call.name} in {seconds:.1f} s{STARTED_SEP}{started:.3f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m gallery_lib.accel.compile.precompile.worker QUEUE.pt DEVICE  "
              "(started by precompile_blocks)", file=sys.stderr)
        return 2
    compile_queue(args[0], args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
