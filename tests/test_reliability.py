"""Reliability under bad data, out-of-memory and worker crashes: the bad-fraction stop, the batch-size search and
torchrun restarts that resume from the last checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import launcher_testing
import numpy as np
import pytest
import torch
from PIL import Image
from test_data import BAD, _expected_skips, messy_root  # noqa: F401  (messy_root is a fixture)

import gallery_lib.run.launch
from gallery_lib.run.batch_size import find_batch_size, is_out_of_memory, next_batch_size
from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.data import RobustImageFolder
from gallery_lib.run.launch import Processes, launch, torchrun_command
from gallery_lib.run.metrics import read_metrics
from gallery_lib.run.train import run

REPO = Path(__file__).resolve().parents[1]


def small_cfg(data, out, **kw) -> RunConfig:
    values = dict(model="swin_micro", data_dir=str(data), output_dir=str(out), image_size=64, batch_size=8, steps=6,
                  warmup_steps=1, log_every=2, lr=1e-3, lr_warmup_steps=1, num_workers=0, device="cpu",
                  amp_level="O0", mixup_alpha=0, cutmix_alpha=0)
    values.update(kw)
    return RunConfig(**values)


# ----------------------------------------------------------------------------------------------------------------
# Bad data


@pytest.fixture(scope="module")
def mostly_bad_root(tmp_path_factory):
    """50 images in 2 classes, 20 of them (40%) unreadable; no two bad files are neighbours in scan order."""
    root = tmp_path_factory.mktemp("mostly_bad")
    rng = np.random.default_rng(0)
    for cls in "ab":
        (root / "train" / cls).mkdir(parents=True)
        for i in range(25):
            path = root / "train" / cls / f"{i:02d}.jpg"
            if i % 5 == 1:
                path.write_bytes(b"")
            elif i % 5 == 3:
                path.write_text("not an image\n")
            else:
                Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(path)
    return root


def test_messy_folder_run_completes_and_logs_every_skip(messy_root, tmp_path):  # noqa: F811
    # 49 images, batch 7, 7 steps, no workers: every index is read exactly once, so the failed loads are known.
    cfg = small_cfg(messy_root, tmp_path / "out", batch_size=7, steps=7, log_every=7)
    result = launch(cfg, echo=None)
    expected = _expected_skips(RobustImageFolder(messy_root, "train"), set(BAD))
    assert expected == 4  # the truncated JPEG fails twice (its neighbour is the zero-byte file), the others once
    assert result.summary["skipped_samples"] == expected
    assert result.summary["steps"] == 7 and np.isfinite(result.summary["final_loss"])
    log = (result.run_dir / "logs" / "rank0.log").read_text()
    skip_lines = [line for line in log.splitlines() if "Skipped sample" in line]
    assert len(skip_lines) == expected
    for bad in BAD:
        assert any(str(messy_root / "train" / bad) in line for line in skip_lines), bad


def test_check_bad_fraction_waits_for_enough_loads(mostly_bad_root):
    ds = RobustImageFolder(mostly_bad_root, "train")
    for i in range(10):
        ds[i]
    assert ds.loads == 14 and ds.skipped == 4  # indices 1, 3, 6 and 8 fail, then their neighbours load
    ds.check_bad_fraction(0.1)  # fewer than 50 loads: no judgement yet
    with pytest.raises(RuntimeError, match="4 of 14 image loads"):
        ds.check_bad_fraction(0.1, min_loads=10)
    for i in range(10, len(ds)):
        ds[i]
    assert ds.loads == 70 and ds.skipped == 20
    ds.check_bad_fraction(0.3)  # 28.6% failed
    with pytest.raises(RuntimeError, match=r"20 of 70 .*\(28\.6%\), more than max_bad_fraction=0\.25"):
        ds.check_bad_fraction(0.25)


def test_run_stops_when_too_many_files_are_bad(mostly_bad_root, tmp_path):
    cfg = small_cfg(mostly_bad_root, tmp_path, steps=12)
    with pytest.raises(RuntimeError) as info:
        run(cfg)
    message = str(info.value)
    assert "max_bad_fraction=0.1" in message and str(mostly_bad_root / "train") in message
    assert "Remove or re-encode the bad files" in message
    steps, summary = read_metrics(cfg.run_dir / "metrics.jsonl")
    # Checks run every 2 steps: after 4 batches (32 images plus their failures, < 50 loads with this seed) none
    # may judge yet; after 6 (48 images, ~19 failures) the first one does and stops the run.
    assert summary is None and len(steps) == 6


@pytest.mark.parametrize("value", [0, -0.1, 1.5, True, "0.2"])
def test_max_bad_fraction_is_validated(value):
    with pytest.raises(ConfigError, match="max_bad_fraction"):
        RunConfig(model="swin_micro", max_bad_fraction=value)


# ----------------------------------------------------------------------------------------------------------------
# Out-of-memory batch-size search


class FakeTrainer:
    """Runs 'steps' that raise an OOM above ``fits``; records every batch tried and every step run."""

    def __init__(self, fits: int, error=None):
        self.fits, self.error, self.tried = fits, error, []

    def __call__(self, batch: int) -> None:
        self.tried.append(batch)
        for _ in range(3):
            if batch > self.fits:
                raise self.error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_back_off_sequence_is_exact():
    trainer = FakeTrainer(fits=70)
    lines = []
    assert find_batch_size(trainer, 128, log=lines.append) == 64
    # floor(b * 0.9) rounded down to even: 128*0.9=115.2 -> 114, 102.6 -> 102, 91.8 -> 90, 81 -> 80, 72 -> 72, 64.8
    assert trainer.tried == [128, 114, 102, 90, 80, 72, 64]
    assert sum("ran out of memory" in line for line in lines) == 6 and lines[-1].endswith("64 fits")


def test_back_off_with_other_factor_and_multiple():
    trainer = FakeTrainer(fits=20, error=RuntimeError("CUDA error: out of memory"))
    assert find_batch_size(trainer, 100, factor=0.5, multiple_of=8, log=lambda _: None) == 8
    assert trainer.tried == [96, 48, 24, 8]  # 100 rounds down to 96 first; 0.5 * 24 = 12 rounds down to 8


def test_small_sizes_always_shrink():
    assert next_batch_size(3, 0.9, 1) == 2  # floor(2.7) = 2
    assert next_batch_size(2, 0.9, 1) == 1  # floor(1.8) = 1
    assert next_batch_size(2, 0.99, 2) == 0


def test_memory_is_freed_between_trials(monkeypatch):
    events = []
    monkeypatch.setattr("gallery_lib.run.batch_size.give_back_cached_gpu_memory", lambda: events.append("free"))
    trainer = FakeTrainer(fits=100)
    find_batch_size(lambda b: (events.append(b), trainer(b)), 128, log=lambda _: None)
    assert events == [128, "free", 114, "free", 102, "free", 90]  # 90 fits: nothing to free after it


def test_other_errors_propagate_unchanged():
    error = ValueError("shape mismatch in layer 3")
    trainer = FakeTrainer(fits=0, error=error)
    with pytest.raises(ValueError) as info:
        find_batch_size(trainer, 64, log=lambda _: None)
    assert info.value is error and trainer.tried == [64]
    trainer = FakeTrainer(fits=0, error=RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        find_batch_size(trainer, 64, log=lambda _: None)
    assert trainer.tried == [64]


def test_nothing_fits_gives_a_clear_error():
    trainer = FakeTrainer(fits=1)
    with pytest.raises(RuntimeError, match=r"no batch size >= 4 fits .*tried 8, 6, 4.*lower image_size"):
        find_batch_size(trainer, 8, minimum=4, log=lambda _: None)
    assert trainer.tried == [8, 6, 4]


def test_is_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate: out of memory"))
    assert not is_out_of_memory(RuntimeError("expected scalar type Float"))
    assert not is_out_of_memory(MemoryError())  # host memory: backing off the batch is not the fix


@pytest.mark.parametrize("kwargs, match", [
    (dict(factor=1.0), "factor"), (dict(factor=0), "factor"), (dict(minimum=0), "minimum"),
    (dict(multiple_of=0), "multiple_of"), (dict(steps_per_trial=1), "steps_per_trial")])
def test_bad_search_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_batch_size(FakeTrainer(fits=100), 64, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# torchrun restarts


def test_torchrun_command_passes_max_restarts(tmp_path):
    cfg = RunConfig(model="swin_micro")
    assert not any("max-restarts" in arg for arg in torchrun_command(Processes(), tmp_path / "c.json"))
    restarting = cfg.replace(max_restarts=2)
    processes = Processes(restarting.nproc_per_node, restarting.max_restarts)
    assert "--max-restarts=2" in torchrun_command(processes, tmp_path / "c.json")
    with pytest.raises(ConfigError, match="max_restarts"):
        cfg.replace(max_restarts=-1)


CRASH_ONCE = textwrap.dedent("""
    # Test-only entry point: the training module, except that the first attempt dies abruptly in step {crash_step}.
    import os
    import sys

    import gallery_lib.run.nonfinite as nonfinite
    import gallery_lib.run.train as train

    calls = 0
    finite_check = nonfinite.all_ranks_finite

    def crash_in_first_attempt(loss, dist):  # called once per step, after backward
        global calls
        calls += 1
        if calls == {crash_step} and dist.restarts == 0:
            os._exit(1)
        return finite_check(loss, dist)

    nonfinite.all_ranks_finite = crash_in_first_attempt
    sys.exit(train.main(sys.argv[1:]))
""")


@pytest.mark.slow  # 25-40 s: a reference run plus torchrun starting the worker twice
def test_torchrun_restart_resumes_from_the_last_checkpoint(smoke_data, tmp_path, monkeypatch):
    values = dict(batch_size=16, steps=8, log_every=3, lr_warmup_steps=2, deterministic=True, checkpoint_every=2,
                  mixup_alpha=0.8, cutmix_alpha=1.0)
    reference = small_cfg(smoke_data, tmp_path / "reference", **values)
    expected = run(reference)
    ref_losses = {s["step"]: s["loss"] for s in read_metrics(reference.run_dir / "metrics.jsonl")[0]}

    wrapper = tmp_path / "crash_once.py"
    wrapper.write_text(CRASH_ONCE.format(crash_step=6))  # in step index 5: past the checkpoint after 4 steps

    monkeypatch.setattr(gallery_lib.run.launch, "torchrun_command", launcher_testing.torchrun_running(wrapper))
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # same CPU reduction order as `reference`
    lines = []
    cfg = small_cfg(smoke_data, tmp_path / "crashed", max_restarts=1, **values)
    result = launch(cfg, echo=lines.append)

    assert any("resumed from step 4 after torchrun restart 1" in line for line in lines), "\n".join(lines[-30:])
    assert result.summary["resumed_from_step"] == 4
    steps, _ = read_metrics(cfg.run_dir / "metrics.jsonl")
    # The first attempt logged steps 0-3 (step 4 was still pending when it died); the restart appends steps 4-7.
    assert [s["step"] for s in steps] == list(range(8))
    assert {s["step"]: s["loss"] for s in steps} == ref_losses
    assert result.summary["final_loss"] == expected["final_loss"]


# ----------------------------------------------------------------------------------------------------------------
# A non-finite loss on some ranks of a multi-process run

NAN_ON_SOME_RANKS = textwrap.dedent("""
    # Test-only entry point: the training module, except that the loss is NaN on the ranks NAN_AT names for a
    # step, and each rank saves its model's final state_dict to PARAMS_DIR/rank<N>.pt.
    import os
    import sys

    import torch

    import gallery_lib.run.train as train
    from gallery_lib.tasks.classification import ClassificationTask

    RANK = int(os.environ["RANK"])
    NAN_AT = NAN_AT_VALUE  # step -> ranks whose loss is NaN in it
    calls = []
    models = []
    task_loss = ClassificationTask.loss
    build_optimizer = train.build_optimizer

    def loss(self, module, batch, precision):  # called once per step
        value = task_loss(self, module, batch, precision)
        if not torch.is_grad_enabled():  # the run's attention probe (a side forward), not a step
            return value
        calls.append(None)
        return value * float("nan") if RANK in NAN_AT.get(len(calls) - 1, ()) else value

    def keep_model(model, *args, **kwargs):
        models.append(model)
        return build_optimizer(model, *args, **kwargs)

    ClassificationTask.loss = loss
    train.build_optimizer = keep_model
    code = train.main(sys.argv[1:])
    torch.save(models[0].state_dict(), os.path.join(PARAMS_DIR_VALUE, f"rank{RANK}.pt"))
    sys.exit(code)
""")


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.parametrize("guard, options", [
    ("host", dict(amp_level="O1")),  # the default: bf16 autocast on a CPU, no GradScaler, standard AdamW
    ("device", dict(fused_optimizer=True, amp_level="O0")),
])
def test_nonfinite_loss_on_some_ranks_skips_the_step_on_every_rank(smoke_data, tmp_path, monkeypatch, guard,
                                                                   options):
    """Two gloo processes: in step 2 only rank 1's loss is NaN, in step 4 both ranks' are. Both steps are skipped
    on both ranks (rank 0 counts step 2 though its own loss was finite) and the ranks end with the same, finite
    weights. Step 4 caught a bug of the device guard: the flags were summed, and fused AdamW skips only when
    found_inf == 1, so two bad ranks (found_inf 2) let NaN into the weights."""
    from gallery_lib.run.nonfinite import guard_mode as nonfinite_guard

    cfg = small_cfg(smoke_data, tmp_path / "out", nproc_per_node=2, batch_size=4, log_every=3, **options)
    assert nonfinite_guard(cfg.max_nonfinite_steps, cfg.fused_optimizer) == guard
    wrapper = tmp_path / "nan_on_some_ranks.py"
    wrapper.write_text(NAN_ON_SOME_RANKS.replace("NAN_AT_VALUE", repr({2: (1,), 4: (0, 1)}))
                       .replace("PARAMS_DIR_VALUE", repr(str(tmp_path))))

    def wrapped_command(cfg, config_path, *nodes):
        command = torchrun_command(cfg, config_path, *nodes)
        i = command.index("gallery_lib.run.train")
        return command[:i - 1] + [str(wrapper)] + command[i + 1:]

    monkeypatch.setattr(gallery_lib.run.launch, "torchrun_command", wrapped_command)
    result = launch(cfg, echo=None)

    assert result.summary["world_size"] == 2 and result.summary["nonfinite_steps"] == 2
    steps, _ = read_metrics(result.metrics_path)
    assert [s["skipped_step"] for s in steps] == [False, False, True, False, True, False]
    # The loss of the global batch, the mean over the ranks: rank 1's NaN in step 2 makes it NaN too
    assert steps[1]["loss"] is not None and steps[2]["loss"] is None and steps[4]["loss"] is None
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for name, value in rank0.items():
        assert torch.isfinite(value).all() and torch.equal(value, rank1[name]), name


@pytest.mark.slow  # three runs in their own processes
def test_a_resume_appends_and_a_new_run_into_the_folder_keeps_the_earlier_one(smoke_data, tmp_path):
    from gallery_lib.run.folder_lock import LOCK_FILES
    from gallery_lib.run.launch import EARLIER

    cfg = small_cfg(smoke_data, tmp_path / "out", steps=2, log_every=1, checkpoint_every=2)
    first = launch(cfg, echo=None)
    resumed = launch(cfg.replace(steps=4, resume=True), echo=None)
    assert not (first.run_dir / EARLIER).exists()  # a resume of its own run appends to it
    assert [r["step"] for r in read_metrics(resumed.metrics_path)[0]] == [0, 1, 2, 3]
    assert (first.run_dir / LOCK_FILES[1]).exists()  # the training process took its lock (train.main)
    written = {p.name for p in first.run_dir.iterdir()} - set(LOCK_FILES)  # the locks stay with the folder
    assert {"metrics.jsonl", "model.pt", "checkpoints", "config.json", "logs"} <= written
    first_metrics = (first.run_dir / "metrics.jsonl").read_text()
    lines: list[str] = []
    second = launch(cfg.replace(checkpoint_every=0, seed=1), echo=lines.append)
    kept = first.run_dir / EARLIER / "1"
    assert f"the earlier run in this folder moved to {kept}" in lines[0]
    assert (kept / "metrics.jsonl").read_text() == first_metrics  # the earlier run's results, whole
    assert {p.name for p in kept.iterdir()} == written and (kept / "checkpoints" / "latest").is_file()
    assert [r["step"] for r in read_metrics(second.metrics_path)[0]] == [0, 1]  # the new run's own, beside it


def test_a_launch_into_the_folder_of_a_run_still_training_stops_in_one_line_and_touches_nothing(smoke_data, tmp_path):
    """The second launch would have moved the running run's files to earlier/1 under it, and that run's model would
    have landed over the second's."""
    from gallery_lib.app.workflow import launch_all
    from gallery_lib.run.folder_lock import only_run_in

    cfg = small_cfg(smoke_data, tmp_path / "out", steps=2)
    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("the running run's\n")
    lines: list[str] = []
    with only_run_in(run_dir):  # what the other launch holds while its run trains
        runs = launch_all([cfg], echo=lines.append, console="result")
    assert sorted(p.name for p in run_dir.iterdir()) == [".running", ".training", "metrics.jsonl"]  # nothing moved
    assert (run_dir / "metrics.jsonl").read_text() == "the running run's\n"
    assert runs.failures[cfg.recipe].kind == "in_use" and not runs.finished
    assert len(lines) == 1 and lines[0].startswith(f"[gallery] {cfg.recipe}: stopped, another run is training in "
                                                   f"{run_dir} (process {os.getpid()} since "), lines
    assert lines[0].endswith("wait for it to end, or give this run a folder of its own (--output-dir, "
                             "output_dir=...)")
    with only_run_in(run_dir):  # the lock went with the launch that held it
        pass


def test_a_launch_stops_while_a_training_process_that_outlived_its_launcher_still_runs_there(smoke_data, tmp_path):
    """A notebook's kernel restarted mid-run: the launcher and torchrun end, the workers (in sessions of their own)
    train on in the folder. A launch into it would move their files away while they write; it stops in one line
    instead, and goes ahead once they have ended."""
    from gallery_lib.app.workflow import launch_all
    from gallery_lib.run.folder_lock import only_run_in

    cfg = small_cfg(smoke_data, tmp_path / "out", steps=2)
    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("the orphan's\n")
    orphan = subprocess.Popen(  # what train.main holds in every rank, in a process the launcher no longer knows
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from gallery_lib.run.folder_lock import "
         "hold_while_training; hold_while_training(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)",
         str(run_dir)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert orphan.stdout.readline() == "held\n"
        lines: list[str] = []
        runs = launch_all([cfg], echo=lines.append, console="result")
        assert runs.failures[cfg.recipe].kind == "in_use" and not runs.finished
        assert lines == [f"[gallery] {cfg.recipe}: stopped, a training process of an earlier launch still runs in "
                         f"{run_dir} (its launcher ended): wait for it to end or stop it, or give this run a folder "
                         "of its own (--output-dir, output_dir=...)"], lines
        assert (run_dir / "metrics.jsonl").read_text() == "the orphan's\n" and not (run_dir / "earlier").exists()
    finally:
        orphan.kill()
        orphan.wait()
    with only_run_in(run_dir):  # the lock went with the process
        pass
