"""Checkpoints and resume: exact continuation across processes and SIGKILL, atomic saves, clear errors,
and the non-finite-loss guard of the training loop."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import timm.loss
import torch

from gallery_lib.run.checkpoint import (LATEST, Checkpointer, CheckpointError, latest_checkpoint, read_checkpoint,
                                    write_checkpoint)
from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.accel.distributed import DistInfo
from gallery_lib.run.interrupt import STOP_ASKED
from gallery_lib.run.metrics import read_metrics
from gallery_lib.accel.precision import Precision
from gallery_lib.run.train import run

STEPS = 8


def resume_cfg(data, out: Path, **kw) -> RunConfig:
    # batch 16 of 120 images: 7 batches per epoch, so resuming at step 4 crosses an epoch boundary.
    values = dict(model="swin_micro", data_dir=str(data), output_dir=str(out), image_size=64, batch_size=16,
                  steps=STEPS, warmup_steps=1, log_every=3, lr=1e-3, lr_warmup_steps=2, num_workers=0,
                  device="cpu", amp_level="O0", deterministic=True, checkpoint_every=2, keep_checkpoints=4)
    values.update(kw)
    return RunConfig(**values)


def child_env() -> dict[str, str]:
    # Same thread count as this process, so CPU kernels reduce in the same order in both.
    return dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONUNBUFFERED="1")


def train_command(cfg: RunConfig) -> list[str]:
    path = cfg.save(cfg.run_dir / "config.json")
    return [sys.executable, "-m", "gallery_lib.run.train", "--config", str(path)]


def assert_same_state(a: Path, b: Path) -> None:
    """Model, optimizer, scheduler and data position of two checkpoint files are bitwise equal."""
    sa, sb = read_checkpoint(a), read_checkpoint(b)
    assert sa["model"].keys() == sb["model"].keys()
    for key in sa["model"]:
        assert torch.equal(sa["model"][key], sb["model"][key]), key
    oa, ob = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert oa.keys() == ob.keys()
    for index in oa:
        for name in oa[index]:
            assert torch.equal(oa[index][name], ob[index][name]), (index, name)
    assert sa["scheduler"] == sb["scheduler"] and sa["data"] == sb["data"] and sa["counters"] == sb["counters"]


def step_losses(cfg: RunConfig) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]}


@pytest.fixture(scope="module")
def reference(smoke_data, tmp_path_factory) -> RunConfig:
    """An uninterrupted run with checkpoints at steps 2, 4, 6 and 8."""
    cfg = resume_cfg(smoke_data, tmp_path_factory.mktemp("reference"))
    run(cfg)
    return cfg


def test_resume_in_a_new_process_is_bitwise_exact(reference, smoke_data, tmp_path):
    ref_dir = reference.run_dir / "checkpoints"
    assert sorted(p.name for p in ref_dir.glob("step_*.pt")) == [f"step_{n}.pt" for n in (2, 4, 6, 8)]
    assert latest_checkpoint(ref_dir).name == "step_8.pt"
    # A run stopped after step 4: its checkpoints up to there and its first 4 metrics lines.
    cfg = resume_cfg(smoke_data, tmp_path, resume=True)
    ckpt_dir = cfg.run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    for n in (2, 4):
        shutil.copy(ref_dir / f"step_{n}.pt", ckpt_dir)
    (ckpt_dir / LATEST).write_text("step_4.pt\n")
    lines = (reference.run_dir / "metrics.jsonl").read_text().splitlines()[:4]
    (cfg.run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    done = subprocess.run(train_command(cfg), env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resumed from step 4" in done.stdout

    steps, summary = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))  # appended, not replaced
    assert summary["resumed_from_step"] == 4 and summary["nonfinite_steps"] == 0
    assert step_losses(cfg) == step_losses(reference)  # every loss bitwise
    assert_same_state(ckpt_dir / "step_8.pt", ref_dir / "step_8.pt")
    assert sorted(p.name for p in ckpt_dir.glob("step_*.pt")) == [f"step_{n}.pt" for n in (2, 4, 6, 8)]


def test_sigkill_mid_run_then_resume_matches_uninterrupted(reference, smoke_data, tmp_path):
    cfg = resume_cfg(smoke_data, tmp_path)
    latest = cfg.run_dir / "checkpoints" / LATEST
    proc = subprocess.Popen(train_command(cfg), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert latest.exists(), "the run wrote no checkpoint within 90 s"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    assert read_metrics(cfg.run_dir / "metrics.jsonl")[1] is None
    killed_at = read_checkpoint(latest_checkpoint(latest.parent))["meta"]["step"]
    assert killed_at < STEPS

    summary = run(cfg.replace(resume=True))
    assert summary["resumed_from_step"] == killed_at
    assert_same_state(latest.parent / "step_8.pt", reference.run_dir / "checkpoints" / "step_8.pt")
    losses = step_losses(cfg)
    assert all(losses[n] == step_losses(reference)[n] for n in range(killed_at, STEPS))


def _ctrl_c_after_a_step(cfg: RunConfig, command: list[str], stdout, times: int = 1,
                         threads: int | None = None) -> tuple[subprocess.CompletedProcess, str]:
    """Runs ``command`` in a process group of its own, as a terminal does, and sends the group SIGINT (Ctrl-C)
    ``times`` once ``cfg``'s run logged a step, each after the last one is acknowledged in the run's log (a fixed pause
    let a fast CPU finish the stop first), fewer where the run stopped first; the finished process and what it wrote
    to stdout (``stdout=PIPE``) or stderr. ``threads``: each training process's, where not this process's own."""
    env = child_env() if threads is None else dict(child_env(), OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # Ctrl-C as a terminal's: a test runner may ignore SIGINT
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = cfg.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and '"type": "step"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run logged no step within 90 s"
            time.sleep(0.01)
        log = cfg.run_dir / "logs" / "rank0.log"
        for sent in range(1, times + 1):
            os.killpg(proc.pid, signal.SIGINT)
            if sent == times or not _taken(log, sent, proc, deadline + 90):
                break
            time.sleep(0.01)  # its line on its way to the launcher, which took this Ctrl-C
        output, errors = proc.communicate(timeout=90)
    finally:
        proc.kill()
    return proc, output if stdout == subprocess.PIPE else errors


def _taken(log: Path, count: int, proc: subprocess.Popen, deadline: float) -> bool:
    """Whether the run's ``log`` shows ``count`` Ctrl-C taken while it still runs; ``False`` where it ended first: on a
    loaded CI machine the run finished its step and stopped before its line reached the log."""
    while log.read_text().count(STOP_ASKED) < count:
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the run took no Ctrl-C within 90 s"
        time.sleep(0.001)
    return True


def test_ctrl_c_saves_the_step_under_way_then_resume_matches_uninterrupted(reference, smoke_data, tmp_path):
    """Ctrl-C reaches the whole process group, the DataLoader's worker too: the step under way finishes, its state is
    saved and the run stops with one line; resumed, it trains as the run that was never stopped."""
    cfg = resume_cfg(smoke_data, tmp_path, log_every=1, num_workers=1)
    proc, output = _ctrl_c_after_a_step(cfg, train_command(cfg), subprocess.PIPE)
    failure = json.loads((cfg.run_dir / "failure.json").read_text())
    stopped_at = failure["first_step"]
    assert proc.returncode == 1 and failure["kind"] == "interrupted" and 0 < stopped_at < STEPS, output
    assert output.count("Ctrl-C: stopping after this step") == 1  # not once more from the worker
    assert f"interrupted (Ctrl-C) after step {stopped_at} of {STEPS}, its state saved in " in failure["reason"]
    assert read_checkpoint(latest_checkpoint(cfg.run_dir / "checkpoints"))["meta"]["step"] == stopped_at

    summary = run(cfg.replace(resume=True))
    assert summary["resumed_from_step"] == stopped_at
    assert_same_state(cfg.run_dir / "checkpoints" / "step_8.pt", reference.run_dir / "checkpoints" / "step_8.pt")


def _gallery_train(smoke_data, tmp_path, *flags: str) -> list[str]:
    """The ``gallery train`` command of ``resume_cfg(..., steps=400)``'s run."""
    return [sys.executable, "-m", "gallery_lib.app.cli", "train", "--model", "swin_micro", "--device", "cpu",
            "--data_dir", str(smoke_data), "--output_dir", str(tmp_path), "--steps", "400", "--image_size", "64",
            "--batch_size", "16", "--num_workers", "0", "--set", "log_every=1", *flags]  # log_every keeps the name


def test_ctrl_c_in_the_gallery_command_stops_with_one_line_and_no_traceback(smoke_data, tmp_path):
    cfg = resume_cfg(smoke_data, tmp_path, steps=400, log_every=1, checkpoint_every=0)
    proc, errors = _ctrl_c_after_a_step(cfg, _gallery_train(smoke_data, tmp_path), subprocess.DEVNULL)
    assert proc.returncode == 130 and "Traceback" not in errors, errors
    assert errors.strip().startswith("gallery: baseline: stopped, interrupted (Ctrl-C) after step ")
    assert "run it again with resume=True" in errors and "\n" not in errors.strip()


def test_ctrl_c_stops_the_processes_of_a_larger_run_after_one_step_they_agree_on_and_saves_it(smoke_data, tmp_path):
    """torchrun passes the signal on to each process (each in a session of its own); they stop after the same step,
    which they save together, and the command says so in one line."""
    cfg = resume_cfg(smoke_data, tmp_path, steps=400, log_every=1, checkpoint_every=0)
    proc, errors = _ctrl_c_after_a_step(cfg, _gallery_train(smoke_data, tmp_path, "--nproc-per-node", "2"),
                                        subprocess.DEVNULL, threads=1)  # two processes with two threads each on
    # CI's two cores took 23 s a step: over torchrun's 30 s between passing the signal on and killing its processes
    assert proc.returncode == 130 and "Traceback" not in errors, errors
    stopped_at = json.loads((cfg.run_dir / "failure.json").read_text())["first_step"]
    assert errors.strip().startswith(f"gallery: baseline: stopped, interrupted (Ctrl-C) after step {stopped_at} of "
                                     "400, its state saved in "), errors
    assert read_checkpoint(latest_checkpoint(cfg.run_dir / "checkpoints"))["meta"]["step"] == stopped_at
    assert f"after step {stopped_at} of 400" in (cfg.run_dir / "logs" / "rank1.log").read_text()


def test_a_second_ctrl_c_stops_the_run_at_once_and_says_what_is_lost(smoke_data, tmp_path):
    for attempt in range(3):  # the second Ctrl-C may come after the step saved, or the run stop before it is sent
        out = tmp_path / str(attempt)
        cfg = resume_cfg(smoke_data, out, steps=400, log_every=1, checkpoint_every=0)
        # steps of 224 px on one thread (half a second): the second Ctrl-C comes while the one under way runs
        command = _gallery_train(smoke_data, out, "--image_size", "224")
        proc, errors = _ctrl_c_after_a_step(cfg, command, subprocess.DEVNULL, times=2, threads=1)
        if "its state saved in" not in errors:
            break
    assert proc.returncode == 130 and "Traceback" not in errors, errors
    assert errors.strip() == ("gallery: baseline: stopped, Ctrl-C twice, so at once: what it trained since its last "
                              f"checkpoint is not saved, see {cfg.run_dir / 'logs' / 'rank0.log'}")
    assert json.loads((cfg.run_dir / "failure.json").read_text())["kind"] == "killed"


def test_two_ctrl_c_that_reach_the_launcher_as_one_are_still_told_as_two(tmp_path):
    """Two Ctrl-C in quick succession can reach the launcher as one KeyboardInterrupt, while the training process took
    both: it said it stops after its step, then stopped without saving one. The line says so."""
    from gallery_lib.run.interrupt import StopRequest
    from gallery_lib.run.launch import _interrupted

    request = StopRequest()
    request.install()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            os.kill(os.getpid(), signal.SIGINT)  # the first: taken, the handler then uninstalled
    finally:
        request.uninstall()
    assert request.requested and printed.getvalue().rstrip().endswith(STOP_ASKED)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").write_text(printed.getvalue())
    twice = _interrupted(tmp_path, "baseline", interrupts=1, stop_asked=True)
    assert "Ctrl-C twice, so at once: what it trained since its last checkpoint is not saved" in str(twice)
    (tmp_path / "failure.json").unlink()
    once = _interrupted(tmp_path, "baseline", interrupts=1, stop_asked=False)  # before the training loop took it
    assert "interrupted (Ctrl-C) before it saved a step" in str(once)


def test_kill_during_save_leaves_previous_checkpoint_loadable(reference, tmp_path):
    ref_dir = reference.run_dir / "checkpoints"
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    shutil.copy(ref_dir / "step_4.pt", ckpt_dir)
    # What a kill inside torch.save leaves: half a temporary file, `latest` still naming the previous file.
    data = (ref_dir / "step_6.pt").read_bytes()
    (ckpt_dir / "step_6.pt.tmp").write_bytes(data[: len(data) // 2])
    (ckpt_dir / LATEST).write_text("step_4.pt\n")
    path = latest_checkpoint(ckpt_dir)
    assert path.name == "step_4.pt" and read_checkpoint(path)["meta"]["step"] == 4
    # The next save clears the leftover and moves the pointer.
    write_checkpoint({"format": 1, "x": torch.ones(2)}, ckpt_dir, step=6, keep=2)
    assert not list(ckpt_dir.glob("*.tmp"))
    assert latest_checkpoint(ckpt_dir).name == "step_6.pt"


def test_keeps_the_newest_and_never_the_latest(tmp_path):
    for step in (1, 2, 3, 4):
        write_checkpoint({"format": 1, "step": step}, tmp_path, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_3.pt", "step_4.pt"]
    assert read_checkpoint(latest_checkpoint(tmp_path))["step"] == 4
    write_checkpoint({"format": 1, "step": 0}, tmp_path, step=0, keep=1)  # `latest` now names the oldest
    assert (tmp_path / "step_0.pt").exists() and latest_checkpoint(tmp_path).name == "step_0.pt"


def test_bad_checkpoints_give_clear_errors(reference, smoke_data, tmp_path):
    ckpt_dir = tmp_path / "out" / "swin_transformer" / "baseline" / "checkpoints"
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        run(resume_cfg(smoke_data, tmp_path / "out", resume=True))  # missing: no silent fresh start
    assert not (ckpt_dir.parent / "metrics.jsonl").exists()

    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / LATEST).write_text("step_4.pt\n")
    with pytest.raises(CheckpointError, match="names step_4.pt, which does not exist"):
        latest_checkpoint(ckpt_dir)

    data = (reference.run_dir / "checkpoints" / "step_4.pt").read_bytes()
    (ckpt_dir / "step_4.pt").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        run(resume_cfg(smoke_data, tmp_path / "out", resume=True))

    (ckpt_dir / "step_4.pt").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"incompatible run \(batch_size: saved 16, now 8\)"):
        run(resume_cfg(smoke_data, tmp_path / "out", resume=True, batch_size=8))
    with pytest.raises(CheckpointError, match="holds checkpoints of an earlier run"):
        run(resume_cfg(smoke_data, tmp_path / "out"))  # a fresh run would mix its checkpoints with these


class FakePosition:
    """Stands in for the TrainLoader's data position."""

    def __init__(self, epoch: int = 0, batches: int = 0):
        self.state = {"epoch": epoch, "batches_in_epoch": batches}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def small_checkpointer(tmp_path: Path, amp_level: str, seed: int, position: FakePosition) -> Checkpointer:
    torch.manual_seed(seed)
    cfg = RunConfig(model="swin_micro", output_dir=str(tmp_path), amp_level=amp_level, steps=10, warmup_steps=0)
    model = torch.nn.Linear(3, 2)
    precision = Precision.from_settings(cfg.sections.precision, "cpu")
    precision.cast_model(model)
    if amp_level == "O1":  # the float16 GradScaler path, as on a GPU
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.AdamW(precision.optimizer_params([{"params": list(model.parameters())}]), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    return Checkpointer(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                        model=model, optimizer=opt, scheduler=sched, precision=precision, loader=position)


@pytest.mark.parametrize("amp_level", ["O1", "O2"])
def test_checkpointer_restores_every_part(tmp_path, amp_level):
    a = small_checkpointer(tmp_path, amp_level, seed=1, position=FakePosition(3, 5))
    with a.precision.autocast():
        loss = a.model(torch.randn(4, 3, dtype=a.model.weight.dtype)).float().square().mean()
    a.precision.backward(loss)
    a.precision.step(a.model, a.optimizer, clip_grad=None)
    a.scheduler.step()
    if a.precision.scaler:
        a.precision.scaler.update(new_scale=77.0)
    a.save(3, {"nonfinite_in_a_row": 1, "nonfinite_steps": 2})
    after_save = (random.random(), np.random.rand(), torch.rand(3))

    b = small_checkpointer(tmp_path, amp_level, seed=2, position=FakePosition())
    assert not torch.equal(a.model.weight, b.model.weight)
    assert b.restore() == (3, {"nonfinite_in_a_row": 1, "nonfinite_steps": 2})
    assert (random.random(), np.random.rand()) == after_save[:2] and torch.equal(torch.rand(3), after_save[2])
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    for ma, mb in zip(a.precision.master_params.values(), b.precision.master_params.values()):
        assert mb.dtype == torch.float32 and torch.equal(ma, mb)  # O2: fp32 masters, not the bf16 weights
    assert len(b.precision.master_params) == (2 if amp_level == "O2" else 0)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert all(torch.equal(sa["state"][0][k], sb["state"][0][k]) for k in sa["state"][0])
    if amp_level == "O2":  # the optimizer steps the very master tensors that were restored in place
        assert b.optimizer.param_groups[0]["params"][0] is next(iter(b.precision.master_params.values()))
    assert b.scheduler.last_epoch == 1 and b.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert b.loader.state == {"epoch": 3, "batches_in_epoch": 5}
    if amp_level == "O1":
        assert b.precision.scaler.get_scale() == 77.0


def test_train_loader_resumes_mid_epoch(smoke_data):
    from gallery_lib.data import RobustImageFolder, build_train_loader

    def loader():
        return build_train_loader(RobustImageFolder(smoke_data, split="train"), batch_size=16, image_size=32,
                                  device="cpu", num_workers=0, seed=3, mixup_alpha=0, label_smoothing=0)

    straight = loader()
    stream = iter(straight)
    for _ in range(5):
        next(stream)
    position = straight.state_dict()
    assert position["epoch"] == 0 and position["batches_in_epoch"] == 5
    expected = [next(stream) for _ in range(4)]  # crosses into epoch 1 after batch 7
    assert straight.epoch == 1 and straight.batches_in_epoch == 2
    resumed = loader()
    resumed.load_state_dict(position)
    stream = iter(resumed)
    for (xa, ya), (xb, yb) in zip(expected, (next(stream) for _ in range(4))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other_data = loader()
    other_data.dataset = list(range(119))  # a different dataset: only its length is read
    with pytest.raises(ValueError, match="dataset_size=120 but this loader has 119"):
        other_data.load_state_dict(position)


@pytest.mark.parametrize("field,value", [("checkpoint_every", -1), ("keep_checkpoints", 0),
                                         ("max_nonfinite_steps", -2), ("resume", "yes")])
def test_checkpoint_fields_are_validated(field, value):
    with pytest.raises(ConfigError, match=field):
        RunConfig(model="swin_micro", **{field: value})


def nan_criterion(monkeypatch, nan_calls):
    """Makes the loop's loss NaN on the given call numbers (0-based)."""
    calls = []

    class NanOnSomeCalls(timm.loss.SoftTargetCrossEntropy):
        def forward(self, x, target):
            loss = super().forward(x, target)
            if not torch.is_grad_enabled():  # the run's attention probe (a side forward), not a step
                return loss
            calls.append(None)
            return loss * float("nan") if len(calls) - 1 in nan_calls else loss

    monkeypatch.setattr(timm.loss, "SoftTargetCrossEntropy", NanOnSomeCalls)


def test_nonfinite_loss_skips_the_step(smoke_data, tmp_path, monkeypatch):
    nan_criterion(monkeypatch, {2})
    cfg = resume_cfg(smoke_data, tmp_path, steps=5, checkpoint_every=5, log_every=5, max_nonfinite_steps=3)
    summary = run(cfg)
    steps, _ = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [s["skipped_step"] for s in steps] == [False, False, True, False, False]
    assert steps[2]["loss"] is None and summary["nonfinite_steps"] == 1
    assert steps[3]["lr"] == steps[2]["lr"] != steps[1]["lr"]  # the scheduler did not advance
    state = read_checkpoint(cfg.run_dir / "checkpoints" / "step_5.pt")
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {4.0}  # 5 steps, 1 skipped
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_nonfinite_losses_in_a_row_stop_with_a_checkpoint(smoke_data, tmp_path, monkeypatch):
    nan_criterion(monkeypatch, set(range(2, 100)))
    cfg = resume_cfg(smoke_data, tmp_path, steps=10, checkpoint_every=0, log_every=4, max_nonfinite_steps=3)
    with pytest.raises(RuntimeError, match=r"not finite for 3 steps in a row \(steps 2-4\)") as info:
        run(cfg)
    assert "step_5.pt" in str(info.value)
    state = read_checkpoint(latest_checkpoint(cfg.run_dir / "checkpoints"))
    assert state["meta"]["step"] == 5 and state["counters"] == {"nonfinite_in_a_row": 3, "nonfinite_steps": 3}
    assert all(torch.isfinite(t).all() for t in state["model"].values())  # NaN never reached the weights
    steps, summary = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert summary is None and [s["skipped_step"] for s in steps] == [False, False, True, True, True]


def test_cli_train_has_resume_flags():
    from gallery_lib.app.cli import build_parser, configs_from_args

    def config(*argv):
        (cfg,) = configs_from_args(build_parser().parse_args(["train", "--profile", "smoke", *argv]))
        return cfg.resume, cfg.resume_from

    args = build_parser().parse_args(["train", "--resume", "--checkpoint_every", "5"])
    assert args.resume == "latest" and args.checkpoint_every == 5
    assert config() == (False, None)
    assert config("--resume") == config("--resume", "latest") == config("--resume_from_checkpoint", "latest") \
        == (True, None)
    assert config("--resume", "runs/a/checkpoints/step_4.pt") == (True, "runs/a/checkpoints/step_4.pt")
    assert config("--resume_from_checkpoint", "runs/a") == (True, "runs/a")


def test_resume_from_another_runs_checkpoint_continues_its_trajectory(reference, smoke_data, tmp_path):
    """diffusers' --resume_from_checkpoint PATH: a new run folder starts from another run's step-4 checkpoint, trains
    the same steps 4-7 as the uninterrupted run, writes its own metrics and checkpoints, and leaves the source alone."""
    source = reference.run_dir / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in source.iterdir()}
    cfg = resume_cfg(smoke_data, tmp_path, resume=True, resume_from=str(source / "step_4.pt"))
    summary = run(cfg)
    assert summary["resumed_from_step"] == 4
    steps, _ = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [4, 5, 6, 7]  # its own metrics, from the checkpoint's step
    assert {s["step"]: s["loss"] for s in steps} == {n: step_losses(reference)[n] for n in range(4, STEPS)}
    own = cfg.run_dir / "checkpoints"
    assert sorted(p.name for p in own.glob("step_*.pt")) == ["step_6.pt", "step_8.pt"]
    assert_same_state(own / "step_8.pt", source / "step_8.pt")
    assert {p.name: p.stat().st_mtime_ns for p in source.iterdir()} == before


def test_resume_from_names_a_checkpoint_file_or_folder(reference, smoke_data, tmp_path):
    from gallery_lib.run.checkpoint import checkpoint_at, resume_source
    from gallery_lib.run.launch import preflight

    folder = reference.run_dir / "checkpoints"
    assert checkpoint_at(folder / "step_2.pt") == folder / "step_2.pt"
    assert checkpoint_at(folder) == checkpoint_at(reference.run_dir) == folder / "step_8.pt"  # their latest
    with pytest.raises(CheckpointError, match="no such file or folder"):
        checkpoint_at(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        checkpoint_at(tmp_path)  # a folder without checkpoints
    cfg = resume_cfg(smoke_data, tmp_path, resume_from=str(folder))
    assert resume_source(cfg.run_dir, cfg.sections.checkpoint) == folder / "step_8.pt"
    assert resume_source(cfg.run_dir, cfg.replace(resume_from=None).sections.checkpoint) is None  # resume_from alone implies resume
    # The run's own folder holds checkpoints of an earlier run: they must not mix with those of the continued one.
    (cfg.run_dir / "checkpoints").mkdir(parents=True)
    (cfg.run_dir / "checkpoints" / LATEST).write_text("step_2.pt\n")
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run"):
        preflight(cfg)


def test_cli_names_a_missing_checkpoint_before_starting(smoke_data, tmp_path, capsys):
    from gallery_lib.app.cli import main

    argv = ["train", "--profile", "smoke", "--model", "swin_micro", "--data_dir", str(smoke_data),
            "--output_dir", str(tmp_path), "--resume_from_checkpoint", str(tmp_path / "checkpoint-500")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "checkpoint-500': no such file or folder" in err and "Traceback" not in err
    assert not (tmp_path / "swin_transformer").exists()  # refused before the run folder was made


def test_device_guard_skips_nonfinite_steps_without_a_host_sync(smoke_data, tmp_path, monkeypatch):
    """Fused AdamW without a GradScaler: the optimizer skips a NaN step on a device flag; the step is counted when
    the flags are read at the next log, and a run of them stops the run there, with finite weights saved."""
    from gallery_lib.run.nonfinite import guard_mode as nonfinite_guard

    cfg = resume_cfg(smoke_data, tmp_path, steps=12, checkpoint_every=0, log_every=4, max_nonfinite_steps=3,
                     fused_optimizer=True)
    assert nonfinite_guard(cfg.max_nonfinite_steps, cfg.fused_optimizer) == "device"
    nan_criterion(monkeypatch, {1} | set(range(3, 100)))
    with pytest.raises(RuntimeError, match=r"not finite for 5 steps in a row \(steps 3-7\), max_nonfinite_steps=3"):
        run(cfg)
    state = read_checkpoint(latest_checkpoint(cfg.run_dir / "checkpoints"))
    assert state["meta"]["step"] == 8 and state["counters"] == {"nonfinite_in_a_row": 5, "nonfinite_steps": 6}
    assert all(torch.isfinite(t).all() for t in state["model"].values())  # NaN never reached the weights
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {2.0}  # 8 steps, 6 skipped: Adam's own step count took only the 2 finite ones
    steps, _ = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [s["skipped_step"] for s in steps] == [False, True, False] + [True] * 5


def test_resume_supersedes_metrics_logged_after_the_checkpoint(reference, smoke_data, tmp_path, monkeypatch, capsys):
    """A run stopped after logging steps 4-5 past its step-4 checkpoint: on resume those lines move to
    metrics.superseded.jsonl and metrics.jsonl holds each step once, equal to the uninterrupted run."""
    from gallery_lib.tasks.classification import ClassificationTask

    calls = []
    loss = ClassificationTask.loss

    def crash_in_step_7(self, module, batch, precision):
        if torch.is_grad_enabled():  # not the run's attention probe (a side forward without gradients)
            calls.append(None)
        if len(calls) == 8:  # only in the first run: the resumed one starts counting at call 9
            raise RuntimeError("mocked crash in step 7")
        return loss(self, module, batch, precision)

    monkeypatch.setattr(ClassificationTask, "loss", crash_in_step_7)
    cfg = resume_cfg(smoke_data, tmp_path, checkpoint_every=4, log_every=2)
    with pytest.raises(RuntimeError, match="mocked crash"):
        run(cfg)
    path = cfg.run_dir / "metrics.jsonl"
    assert [s["step"] for s in read_metrics(path)[0]] == [0, 1, 2, 3, 4, 5]  # step 6 was pending, never logged
    capsys.readouterr()

    summary = run(cfg.replace(resume=True))
    assert summary["resumed_from_step"] == 4
    assert "2 metrics line(s) of the stopped run from step 4 on are superseded" in capsys.readouterr().out
    steps, stored = read_metrics(path)
    assert [s["step"] for s in steps] == list(range(STEPS)) and stored == summary
    assert [s["loss"] for s in steps] == [step_losses(reference)[n] for n in range(STEPS)]
    superseded, old_summary = read_metrics(path.with_name("metrics.superseded.jsonl"))
    assert [s["step"] for s in superseded] == [4, 5] and old_summary is None
    assert [s["loss"] for s in superseded] == [step_losses(reference)[n] for n in (4, 5)]  # nothing lost


def test_supersede_steps_moves_later_steps_summary_and_broken_lines(tmp_path):
    from gallery_lib.run.metrics import supersede_steps

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"type": "step", "step": n, "loss": float(n)}) for n in range(4)]
    lines += [json.dumps({"type": "summary", "final_loss": 3.0}), json.dumps({"type": "step", "step": 2}),
              '{"type": "step", "st']  # a second attempt's step 2, then a line cut short by a kill
    path.write_text("\n".join(lines))
    assert supersede_steps(path, 2) == 5
    assert path.read_text().splitlines() == lines[:2]
    moved = tmp_path / "metrics.superseded.jsonl"
    assert moved.read_text().splitlines() == lines[2:]
    assert supersede_steps(path, 2) == 0 and moved.read_text().splitlines() == lines[2:]  # nothing left to move
    assert supersede_steps(tmp_path / "missing.jsonl", 0) == 0 and not (tmp_path / "missing.jsonl").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_holding_a_call_is_refused_in_our_own_words(tmp_path):
    path = tmp_path / "step_4.pt"
    torch.save({"format": 1, "hook": print}, path)
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(path)
    message = str(refused.value)
    assert "was refused" in message and "(print)" in message and "only if you made it" in message
    assert "add_safe_globals" not in message and "weights_only" not in message  # torch's advice is not for this file


def test_a_damaged_checkpoint_names_the_damage_without_torchs_advice(tmp_path):
    path = tmp_path / "step_4.pt"
    for damaged in (b"garbage" * 10, b"PK\x03\x04" + b"x" * 100):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="cannot be read: truncated, corrupt") as unreadable:
            read_checkpoint(path)
        assert "weights_only" not in str(unreadable.value) and "\n" not in str(unreadable.value)


def test_a_stopped_runs_line_keeps_the_whole_message():
    from gallery_lib.run.failure import RunFailure, failure_from_exception, failure_from_text

    long_reason = "ValueError: " + "the cause and the fix, " * 20 + "in full"
    assert failure_from_text(f"Traceback ...\n{long_reason}", "rank0.log").reason == long_reason
    error = CheckpointError("checkpoint x cannot be read (RuntimeError: first\nsecond). Write step_2.pt into latest.")
    failure = failure_from_exception(error, "rank0.log")
    assert failure.reason == ("CheckpointError: checkpoint x cannot be read (RuntimeError: first second). Write "
                              "step_2.pt into latest.")
    killed = failure_from_text("", "rank0.log", exit_code=-9)  # the out-of-memory killer leaves no Python error
    assert killed.kind == "killed" and "out-of-memory killer" in killed.reason
    assert failure_from_text("", "rank0.log", exit_code=-11).reason == "killed by signal 11"
    line = RunFailure("error", "incompatible run (batch_size: saved 8, now 4). ", "rank0.log").line("accelerated")
    assert line == "accelerated: stopped, incompatible run (batch_size: saved 8, now 4), see rank0.log"
