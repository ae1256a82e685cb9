"""Starts a training run as a ``torchrun`` subprocess and streams rank 0's output.

Used the same way from a notebook cell and from the CLI: ``launch(cfg)`` validates the config for
this machine (before anything slow starts), moves the results of an earlier run in the run's own folder to
``earlier/<N>/`` (a new run never overwrites them; a resume appends to them), writes ``config.json`` there,
runs ``torchrun --standalone --nproc-per-node N [--max-restarts R] -m gallery_lib.run.train --config ...``, prints
rank 0's lines as they arrive, and returns a ``RunResult`` that carries its own output path, so a notebook
never plots one run's files under another run's name. One process on one node without restarts runs
``python -m gallery_lib.run.train --config ...`` itself: torchrun's agent would add only its own start-up.

Several nodes: ``launch(cfg, nodes=Nodes(...))`` on every node passes torchrun's own flags through (``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``, and ``--rdzv-backend``, ``--rdzv-id`` when given) instead of ``--standalone``.
The global batch is then ``batch_size * nproc_per_node * nnodes``. Global rank 0 writes the metrics; with the static
rendezvous it runs on node 0, with c10d on any node: the launcher whose console shows its result line returns the
summary, the others return none. Checkpoints need a filesystem that every node shares.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from gallery_lib.config import ConfigError, RunConfig, validate_for_machine
from gallery_lib.run.checkpoint import CheckpointError, check_fresh_start, continues_itself
from gallery_lib.run.failure import (RESTARTED_PREFIX, STOPPED_PREFIX, RunFailure, clear_failure, failure_from_text,
                                     read_failure)
from gallery_lib.run.folder_lock import LOCK_FILES, FolderInUse, only_run_in
from gallery_lib.run.interrupt import STOP_ASKED
from gallery_lib.run.memory_plan import ALLOCATOR_ENV, ALLOCATOR_SETTINGS, PLAN, MemoryPlan
from gallery_lib.run.metrics import read_metrics
from gallery_lib.run.progress import StepProgress
from gallery_lib.run.summary import DONE_PREFIX
from gallery_lib.families import family_env

RDZV_BACKENDS = ("static", "c10d")


class RunFailed(RuntimeError):
    """A training subprocess exited with an error; the message holds the tail of the failing rank's log, ``failure``
    why the run stopped in one line's worth (``failure.line(name)``)."""

    def __init__(self, message: str, failure: RunFailure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class RunFolderInUse(RunFailed):
    """Another launch is training in the run's folder: nothing of this run started, and nothing there is its own
    (its ``failure`` is not written there)."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C while a run trained: the run saved its step and stopped (``failure``, its line the message); no later
    run starts."""

    def __init__(self, message: str, failure: RunFailure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    run_dir: Path
    summary: dict

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def samples_per_s(self) -> float:
        return self.summary["samples_per_s"]


@dataclass(frozen=True)
class Nodes:
    """torchrun's multi-node flags, named as torchrun names them; the default is one node (``--standalone``)."""

    nnodes: int = 1
    node_rank: int | None = None
    """This node's rank, 0 on the node at ``rdzv_endpoint``: the static rendezvous (torchrun's default) needs it."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of node 0, the same on every node."""
    rdzv_backend: str | None = None
    """``static`` (torchrun's default: fixed node ranks) or ``c10d`` (the rendezvous numbers the nodes)."""
    rdzv_id: str | None = None
    """A job id shared by the nodes (``c10d``)."""

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.rdzv_endpoint is None

    def check(self, find_batch_size: bool = False) -> None:
        """``ConfigError`` naming the fix for flags that torchrun would refuse or misread (with a run that searches
        its batch size: ``find_batch_size``)."""
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} is invalid: expected an integer >= 1.")
        if self.rdzv_backend not in (None, *RDZV_BACKENDS):
            raise ConfigError(f"--rdzv-backend {self.rdzv_backend} is not known: choose one of "
                              f"{', '.join(RDZV_BACKENDS)}.")
        if self.standalone:
            if self.node_rank not in (None, 0) or self.rdzv_id or self.rdzv_backend:
                raise ConfigError("--node-rank, --rdzv-id and --rdzv-backend describe a job over several nodes: give "
                                  "--nnodes N and --rdzv-endpoint HOST:PORT too, or drop them for one node.")
            return
        if not self.rdzv_endpoint or ":" not in self.rdzv_endpoint:
            raise ConfigError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the address of node 0 that "
                              f"every node can reach (got {self.rdzv_endpoint!r}).")
        if self.rdzv_backend in (None, "static") and self.node_rank is None:
            raise ConfigError("the static rendezvous needs --node-rank on every node: 0 on the node at "
                              f"{self.rdzv_endpoint}, 1 to {self.nnodes - 1} on the others (or --rdzv-backend c10d "
                              "--rdzv-id JOB, which numbers the nodes itself).")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is invalid with --nnodes {self.nnodes}: expected 0 to "
                              f"{self.nnodes - 1}.")
        if find_batch_size:
            raise ConfigError("find_batch_size=True is invalid on several nodes: search with one process, then set "
                              "batch_size to the size it chose.")

    def torchrun_flags(self) -> list[str]:
        if self.standalone:
            return ["--standalone"]
        given = {"--nnodes": self.nnodes, "--node-rank": self.node_rank, "--rdzv-endpoint": self.rdzv_endpoint,
                 "--rdzv-backend": self.rdzv_backend, "--rdzv-id": self.rdzv_id}
        return [f"{flag}={value}" for flag, value in given.items() if value is not None]


def torchrun_command(processes: Processes, config_path: Path, nodes: Nodes = Nodes()) -> list[str]:
    restarts = [f"--max-restarts={processes.max_restarts}"] if processes.max_restarts > 0 else []
    return [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_flags(),
            f"--nproc-per-node={processes.per_node}", *restarts, "-m", "gallery_lib.run.train", "--config",
            str(config_path)]


def train_command(processes: Processes, config_path: Path, nodes: Nodes = Nodes()) -> list[str]:
    """``torchrun_command``, or the training module itself for one process on one node without restarts."""
    if processes.single(nodes):
        return [sys.executable, "-m", "gallery_lib.run.train", "--config", str(config_path)]
    return torchrun_command(processes, config_path, nodes)


@dataclass(frozen=True)
class Processes:
    """The training processes a run starts on this node, and how often torchrun restarts them."""

    per_node: int = 1
    max_restarts: int = 0

    def single(self, nodes: Nodes) -> bool:
        """One process on one node without restarts: it runs without torchrun."""
        return self.per_node == 1 and nodes.standalone and self.max_restarts == 0


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _child_env(processes: Processes, nodes: Nodes, device: str, *, deterministic: bool,
               family: dict[str, str], tight_memory: bool = False) -> dict[str, str]:
    """The training processes' environment: this one's, with ``family`` (how they find an external family), and
    growable allocator segments where the run does not fit as configured (``tight_memory``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **family)
    if processes.single(nodes):  # a launcher that itself runs under torchrun must not hand its ranks down
        for name in [*_TORCHRUN_ENV, *(key for key in env if key.startswith("TORCHELASTIC_"))]:
            env.pop(name, None)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets 1 thread per process when it starts several; split the cores instead.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes.per_node))
    if device == "cuda" and tight_memory:
        env.setdefault(ALLOCATOR_ENV, ALLOCATOR_SETTINGS)
    if deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if processes.max_restarts > 0:
        # torchrun's rendezvous store, shared with the workers by default, keeps the process group's keys of the
        # attempt before: restarted workers could read a dead rank's address and fail to connect.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def preflight(cfg: RunConfig) -> str:
    """What a run can be refused for before torchrun starts, each a ``ConfigError`` saying the fix: the machine
    (``validate_for_machine``, whose resolved device it returns), the kind of data the model trains on, and the
    checkpoints (one to resume from, or none of an earlier run to overwrite)."""
    device = validate_for_machine(cfg)
    check_data = getattr(cfg.model_family.task, "check_data", None)
    if check_data is not None:
        check_data(model=cfg.model, data_dir=cfg.data_dir, options=cfg.options)
    try:
        # a fresh start, or from another run's checkpoint: none of its own to mix
        if not continues_itself(cfg.run_dir, cfg.sections.checkpoint):
            check_fresh_start(cfg.run_dir, cfg.sections.checkpoint)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    return device


EARLIER = "earlier"
"""Where a fresh run into a folder moves the runs that were there before it: ``<run_dir>/earlier/<N>/``."""
_RESULTS = ("metrics.jsonl", "model.pt", "pipeline", "checkpoints")


def keep_earlier_run(run_dir: Path) -> Path | None:
    """Moves what an earlier run left in ``run_dir`` (its metrics, exported model, checkpoints, logs and config) to
    ``run_dir/earlier/<N>/``, the next free N, so that a new run into the same folder loses none of it; returns where,
    or ``None`` when the folder holds no results."""
    if not any((run_dir / name).exists() for name in _RESULTS):
        return None
    for number in itertools.count(1):
        target = run_dir / EARLIER / str(number)
        if not target.exists():
            break
    target.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name not in (EARLIER, *LOCK_FILES):  # the locks stay with the folder
            entry.rename(target / entry.name)
    return target


def refuse_if_it_does_not_fit(plan: dict[str, Any] | None, run_dir: Path) -> None:
    """``RunFailed`` before anything starts when the memory ``plan`` (``None``: none was made) found no measured
    setting that fits: one line, recorded as the run's failure, so that the other recipes still run and the report
    shows it."""
    if plan is None or plan.get("chosen") is not None or plan.get("probe_fields"):
        return
    failure = RunFailure("does_not_fit", MemoryPlan.from_dict(plan).does_not_fit())
    clear_failure(run_dir)
    failure.write(run_dir)
    raise RunFailed(failure.reason, failure)


CONSOLE_MODES = ("all", "result")


def console_line(line: str, recipe: str, console: str) -> str | None:
    """What ``echo`` gets of one line of rank 0's output: every line (``all``, the command line's way), or only the
    run's result, named by its recipe (``result``, a notebook's way: one line per run, the rest in its log)."""
    if console == "all":
        return line
    return f"[gallery] {recipe}: {line[len(DONE_PREFIX):]}" if line.startswith(DONE_PREFIX) else None


def launch(cfg: RunConfig, *, echo: Callable[[str], None] | None = print, console: str = "all",
           progress: bool | None = None, nodes: Nodes = Nodes()) -> RunResult:
    """Runs ``cfg`` to completion in a torchrun subprocess; raises ``RunFailed`` with the log tail on error.
    ``console``: which of rank 0's lines ``echo`` gets (``console_line``). ``progress``: a bar over the steps
    (``gallery_lib.run.progress``); ``None`` shows one in a notebook or a terminal when ``echo`` is on. ``nodes``: this
    node's part of a job over several (module docstring)."""
    if console not in CONSOLE_MODES:
        raise ConfigError(f"console={console!r} is not known: choose one of {', '.join(CONSOLE_MODES)}.")
    nodes.check(cfg.find_batch_size)
    device = preflight(cfg)
    run_dir = cfg.run_dir.resolve()
    with contextlib.ExitStack() as held:
        if nodes.standalone:  # the nodes of a larger run share its folder
            held.enter_context(_holding(run_dir))
        refuse_if_it_does_not_fit(cfg.extra.get(PLAN), run_dir)
        cfg = cfg.replace(output_dir=str(Path(cfg.output_dir).resolve()), data_dir=str(Path(cfg.data_dir).resolve()),
                          resume_from=str(Path(cfg.resume_from).expanduser().resolve()) if cfg.resume_from else None)
        # on several nodes rank 0's writer alone replaces the file
        if not continues_itself(cfg.run_dir, cfg.sections.checkpoint) and nodes.standalone:
            kept = keep_earlier_run(run_dir)  # a re-run never overwrites what an earlier one wrote; a resume appends
            if kept is not None and echo is not None:
                echo(f"[gallery] {cfg.recipe}: the earlier run in this folder moved to {kept}")
        config_path = cfg.save(run_dir / "config.json")
        clear_failure(run_dir)
        processes = Processes(cfg.nproc_per_node, cfg.max_restarts)
        plan = cfg.extra.get(PLAN)
        env = _child_env(processes, nodes, device, deterministic=cfg.deterministic, family=family_env(cfg.model_family),
                         tight_memory=plan is not None and MemoryPlan.from_dict(plan).tight)
        proc = subprocess.Popen(train_command(processes, config_path, nodes), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, cwd=os.getcwd())
        output = _stream(proc, cfg.recipe, echo=echo, console=console, progress=progress)
        code = proc.wait()
        if output.interrupts:
            raise _interrupted(run_dir, cfg.recipe, output.interrupts, output.stop_asked)
        if code != 0:
            message = _failure_message(run_dir, code, list(output.tail))
            failure = read_failure(run_dir)
            if failure is None:  # killed, or a rank other than 0 failed: rank 0 recorded nothing
                failure = failure_from_text(message, _failing_log(run_dir), code)
                failure.write(run_dir)
            raise RunFailed(message, failure)
        summary = _summary(run_dir, nodes, output.printed_result)
        # Re-read: the run rewrites its config.json when a batch-size search picked the size it trained at.
        return RunResult(config=RunConfig.load(config_path), run_dir=run_dir, summary=summary)


@dataclass
class _Output:
    """What the launcher kept of a training process's output."""

    tail: deque[str]
    printed_result: bool  # global rank 0 ran on this node
    interrupts: int  # how many Ctrl-C came while it ran
    stop_asked: bool = False  # the training process said it stops after its step


def _stream(proc: subprocess.Popen, recipe: str, *, echo: Callable[[str], None] | None, console: str,
            progress: bool | None) -> _Output:
    """Passes ``proc``'s output to ``echo`` (``console_line``) and a progress bar until it ends. A Ctrl-C meanwhile
    reached the training process too, which saves its step and stops: the output is read on; a second one kills it."""
    output = _Output(deque(maxlen=200), False, 0)  # the tail: room for torchrun's own traceback and summary
    bar = StepProgress(recipe, enabled=False if echo is None else progress)
    assert proc.stdout is not None
    stopped = False  # the run printed why it stopped: what follows is torchrun's report, kept for RunFailed
    while True:
        try:
            for line in proc.stdout:
                output.tail.append(line.rstrip("\n"))
                bar.feed(line)
                stopped = (stopped or line.startswith(STOPPED_PREFIX)) and not line.startswith(RESTARTED_PREFIX)
                output.printed_result = output.printed_result or line.startswith(DONE_PREFIX)
                output.stop_asked = output.stop_asked or line.rstrip().endswith(STOP_ASKED)
                shown = console_line(line.rstrip("\n"), recipe, console) if echo and not stopped else None
                if shown is not None:
                    echo(shown)
            break
        except KeyboardInterrupt:
            output.interrupts += 1
            if output.interrupts > 1:
                proc.kill()
    bar.close()
    return output


def _interrupted(run_dir: Path, recipe: str, interrupts: int, stop_asked: bool) -> RunInterrupted:
    """The line of a run stopped by ``interrupts`` Ctrl-C: its own, where it saved its step; else what is lost.
    ``stop_asked``: the training process took a first one (two in quick succession reach this process as one)."""
    failure = read_failure(run_dir)
    twice = interrupts > 1 or stop_asked
    if failure is None or (twice and failure.kind != "interrupted"):  # it stopped before saving a step
        log = failure.log if failure else _failing_log(run_dir)
        why = "Ctrl-C twice, so at once" if twice else "interrupted (Ctrl-C) before it saved a step"
        failure = RunFailure("killed", f"{why}: what it trained since its last checkpoint is not saved",
                             str(log) if log else None)
        failure.write(run_dir)
    return RunInterrupted(failure.line(recipe), failure)


@contextlib.contextmanager
def _holding(run_dir: Path) -> Iterator[None]:
    """``run_dir`` held for this launch (``only_run_in``), or ``RunFolderInUse`` before anything is written there."""
    try:
        with only_run_in(run_dir):
            yield
    except FolderInUse as exc:  # raised before the block runs: nothing else raises it
        raise RunFolderInUse(str(exc), RunFailure("in_use", str(exc))) from None


def _summary(run_dir: Path, nodes: Nodes, printed_result: bool) -> dict:
    """The run's summary record; ``{}`` on a node where global rank 0, which writes ``metrics.jsonl``, did not run.
    Rank 0 ran here if its result line came through this node's console: on a filesystem that the nodes share, the
    metrics file does not say so, and the c10d rendezvous numbers the nodes as they arrive."""
    metrics = run_dir / "metrics.jsonl"
    if not nodes.standalone and not printed_result:
        return {}
    summary = read_metrics(metrics)[1] if metrics.is_file() or nodes.standalone else None
    if summary is None:
        raise RunFailed(f"run in {run_dir} exited cleanly but wrote no summary line to metrics.jsonl")
    return summary


def _failing_log(run_dir: Path) -> Path | None:
    """The first rank log that names an error, else rank 0's."""
    logs = sorted((run_dir / "logs").glob("rank*.log"))
    for path in logs:
        if "Error" in path.read_text(encoding="utf-8", errors="replace"):
            return path
    return logs[0] if logs else None


def _failure_message(run_dir: Path, code: int, console_tail: list[str]) -> str:
    logs = sorted((run_dir / "logs").glob("rank*.log"))
    parts = [f"training exited with code {code}; per-rank logs: {', '.join(str(p) for p in logs) or 'none'}"]
    for path in logs:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        error_lines = [ln for ln in lines if "Error" in ln or "error" in ln]
        if error_lines:
            parts.append(f"--- last lines of {path.name} ---\n" + "\n".join(lines[-15:]))
            break
    else:
        parts.append("--- console tail ---\n" + "\n".join(_console_excerpt(console_tail)))
    return "\n".join(parts)


def _console_excerpt(lines: list[str]) -> list[str]:
    """The workers' last console lines and torchrun's root-cause block, without torchrun's traceback between them.

    A worker killed by a signal (a C++ abort, the OOM killer) leaves no Python error in its rank log: the reason
    (``terminate called ...``) is on the console just before torchrun's traceback and failure summary, which alone
    fill the last 30 lines.
    """
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")
              and any("torch/distributed/run.py" in later for later in lines[i + 1:i + 6])]
    if not starts:
        return lines[-15:]
    root_cause = next((i for i in range(starts[-1], len(lines)) if lines[i].startswith("Root Cause")), len(lines))
    return lines[:starts[-1]][-15:] + lines[root_cause:]
