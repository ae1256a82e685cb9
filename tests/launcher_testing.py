"""Launchers in processes of their own, as on separate nodes, each ended at a deadline.

``start`` runs ``launch`` of a config in a new process group, as one node of several (``nodes``) and, with ``kill``,
with torchrun running ``kill_once.py`` in place of the training module; its console goes to ``<name>.log``.
``finish`` waits for the launchers and returns each one's summary; when one fails or the deadline passes it ends them
all (SIGTERM: torchrun's agent stops its workers) and fails the test with their logs' last lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gallery_lib.run.launch as launch_module
from gallery_lib.config import RunConfig
from gallery_lib.run.launch import Nodes

KILL_ONCE = Path(__file__).with_name("kill_once.py")


@dataclass(frozen=True)
class Launcher:
    proc: subprocess.Popen
    log: Path
    summary: Path


def start(cfg: RunConfig, folder: Path, name: str, nodes: Nodes = Nodes(), kill: tuple[int, int] | None = None,
          **env: str) -> Launcher:
    """``launch(cfg, nodes=nodes)`` in a subprocess; ``kill``: (rank, step) of the worker that SIGKILLs itself in
    torchrun's first attempt; ``env``: variables for the launcher and the processes it starts."""
    folder.mkdir(parents=True, exist_ok=True)
    config = cfg.save(folder / f"{name}.json")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    if kill is not None:
        env.update(GALLERY_TEST_KILL_RANK=str(kill[0]), GALLERY_TEST_KILL_STEP=str(kill[1]))
    log, summary = folder / f"{name}.log", folder / f"{name}.summary.json"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, str(config), json.dumps(asdict(nodes)), str(summary),
                                 "kill" if kill else ""],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Launcher(proc, log, summary)


def finish(launchers: list[Launcher], timeout: float) -> list[dict]:
    """Each launcher's summary (``{}`` on a node where global rank 0 did not run), once all have exited cleanly."""
    import pytest

    deadline = time.monotonic() + timeout
    try:
        while any(x.proc.poll() is None for x in launchers) and time.monotonic() < deadline:
            if any(x.proc.poll() not in (None, 0) for x in launchers):
                break  # the other nodes would wait for it
            time.sleep(0.2)
    finally:
        ended = [x for x in launchers if _end(x.proc)]
    failed = [x for x in launchers if x.proc.returncode != 0]
    if failed:
        pytest.fail("\n".join(f"{x.log.name}: " + (f"ended after {timeout:.0f} s" if x in ended else
                                                    f"exit code {x.proc.returncode}") + ", its last lines:\n" +
                              "\n".join(x.log.read_text().splitlines()[-25:]) for x in failed))
    return [json.loads(x.summary.read_text()) for x in launchers]


def _end(proc: subprocess.Popen) -> bool:
    """Ends the launcher's process group if it still runs: SIGTERM, then SIGKILL if torchrun's agent has not stopped
    its workers and itself in 30 s. Whether it had to."""
    if proc.poll() is not None:
        return False
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    for _ in range(300):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    return True


def torchrun_running(script: Path):
    """``launch``'s ``torchrun_command`` with ``script`` run in place of the training module (``-m
    gallery_lib.run.train``), for ``monkeypatch.setattr``."""
    plain = launch_module.torchrun_command

    def command(cfg, config_path, *rest):
        args = plain(cfg, config_path, *rest)
        i = args.index("gallery_lib.run.train")
        return args[:i - 1] + [str(script)] + args[i + 1:]

    return command


def _main(config: str, nodes: str, summary: str, kill: str) -> None:
    if kill:
        launch_module.torchrun_command = torchrun_running(KILL_ONCE)
    result = launch_module.launch(RunConfig.load(config), nodes=Nodes(**json.loads(nodes)))
    Path(summary).write_text(json.dumps(result.summary))


if __name__ == "__main__":
    _main(*sys.argv[1:])
