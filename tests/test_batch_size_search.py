"""The batch-size search as a run option (``find_batch_size``): real training trials with a mocked out-of-memory
error, the chosen size recorded in the summary and config.json, and the run equal to one started at that size."""

from __future__ import annotations

import json

import pytest
import torch

from gallery_lib.run.batch_size import SEARCH_DIR
from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.run.metrics import read_metrics
from gallery_lib.tasks.classification import ClassificationTask
from gallery_lib.run.train import run


def search_cfg(data, out, **kw) -> RunConfig:
    values = dict(model="swin_micro", data_dir=str(data), output_dir=str(out), image_size=64, batch_size=12, steps=4,
                  warmup_steps=1, log_every=2, lr=1e-3, lr_warmup_steps=1, num_workers=0, device="cpu",
                  amp_level="O0", deterministic=True, mixup_alpha=0, cutmix_alpha=0, find_batch_size=True)
    values.update(kw)
    return RunConfig(**values)


def fail_above(monkeypatch, limit: int, error: Exception | None = None, spike_mb: int = 0) -> list[int]:
    """Makes the task's loss raise (a mocked OOM by default) on batches larger than ``limit``, after allocating
    ``spike_mb`` on the batch's device as a real OOM's failed attempt would; returns the list of batch sizes the loss
    was called with, one entry per training step."""
    seen: list[int] = []
    loss = ClassificationTask.loss

    def limited_loss(self, module, batch, precision):
        size = batch[0].shape[0]
        if torch.is_grad_enabled():  # steps only: the run's attention probe is a side forward without gradients
            seen.append(size)
        if size > limit:
            if spike_mb:
                torch.empty(spike_mb * 2**20, dtype=torch.uint8, device=batch[0].device)
            raise error or torch.OutOfMemoryError(f"CUDA out of memory (mocked: batch {size} > {limit})")
        return loss(self, module, batch, precision)

    monkeypatch.setattr(ClassificationTask, "loss", limited_loss)
    return seen


def test_search_backs_off_then_trains_as_a_run_started_at_the_chosen_size(smoke_data, tmp_path, monkeypatch, capsys):
    seen = fail_above(monkeypatch, 6)
    cfg = search_cfg(smoke_data, tmp_path / "search")
    summary = run(cfg)
    log = capsys.readouterr().out

    # Each too-large trial fails at its first step; the 6 trial runs its 3 steps, then the real run its 4.
    assert seen == [12, 10, 8] + [6] * 3 + [6] * 4
    for size in (12, 10, 8):
        assert f"batch-size search: trying {size} (3 steps)" in log and f"search: {size} ran out of memory" in log
    assert "batch-size search: 6 fits" in log
    assert summary["batch_size_search"] == {"tried": [12, 10, 8, 6], "chosen": 6}
    assert summary["global_batch_size"] == 6 and summary["steps"] == 4
    steps, stored = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert stored == summary and [s["step"] for s in steps] == [0, 1, 2, 3]
    saved = json.loads((cfg.run_dir / "config.json").read_text())
    assert saved["training"]["batch_size"] == 6 and saved["training"]["find_batch_size"] is False
    assert saved["extra"]["batch_size_search"] == {"tried": [12, 10, 8, 6], "chosen": 6}
    trial_steps, _ = read_metrics(next((cfg.run_dir / SEARCH_DIR / "batch_6").rglob("metrics.jsonl")))
    assert len(trial_steps) == 3  # the trial trained for real, apart from the run's own metrics

    plain = search_cfg(smoke_data, tmp_path / "plain", batch_size=6, find_batch_size=False)
    expected = run(plain)
    assert "batch_size_search" not in expected
    plain_steps, _ = read_metrics(plain.run_dir / "metrics.jsonl")
    # Same seed, fp32, deterministic: the trials leave nothing behind that changes the run.
    assert [s["loss"] for s in steps] == [s["loss"] for s in plain_steps]
    assert summary["final_loss"] == expected["final_loss"]


def test_other_errors_in_a_trial_propagate(smoke_data, tmp_path, monkeypatch):
    error = ValueError("mocked shape mismatch")
    seen = fail_above(monkeypatch, 0, error=error)
    cfg = search_cfg(smoke_data, tmp_path)
    with pytest.raises(ValueError) as info:
        run(cfg)
    assert info.value is error and seen == [12]  # no back-off, no second trial
    assert not (cfg.run_dir / "config.json").exists() and not (cfg.run_dir / "metrics.jsonl").exists()


def test_find_batch_size_needs_one_process():
    with pytest.raises(ConfigError, match=r"find_batch_size=True is invalid with nproc_per_node=2: run the search "
                                          r"with nproc_per_node=1, then set batch_size"):
        RunConfig(model="swin_micro", find_batch_size=True, nproc_per_node=2)
    RunConfig(model="swin_micro", find_batch_size=False, nproc_per_node=2)


def test_find_batch_size_does_not_resume():
    with pytest.raises(ConfigError, match=r"find_batch_size=True is invalid with resume=True: a resumed run keeps "
                                          r"the batch size of its checkpoint"):
        RunConfig(model="swin_micro", find_batch_size=True, resume=True)


def test_find_batch_size_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"find_batch_size='yes' is invalid: expected true or false"):
        RunConfig(model="swin_micro", find_batch_size="yes")


def test_cli_flag_accepts_dashes_and_underscores():
    from gallery_lib.app.cli import base_from_args, build_parser

    for flag in ("--find_batch_size", "--find-batch-size"):
        args = build_parser().parse_args(["train", "--profile", "smoke", flag, "--batch_size", "64"])
        cfg = base_from_args(args)
        assert cfg.find_batch_size is True and cfg.batch_size == 64
    assert base_from_args(build_parser().parse_args(["train", "--profile", "smoke"])).find_batch_size is False


@pytest.mark.gpu
def test_search_with_the_compiled_recipe_on_gpu(smoke_data, tmp_path, monkeypatch):
    """On CUDA with torch.compile: the fitting trial compiles, its graphs are dropped (``torch._dynamo.reset``)
    before the run compiles its own model, and the run reports its own peak memory, not the trials'."""
    from gallery_lib.recipes import apply_recipe

    seen = fail_above(monkeypatch, 8, spike_mb=4096)
    cfg = apply_recipe("compiled", search_cfg(smoke_data, tmp_path, batch_size=16, device="cuda",
                                              deterministic=False))
    summary = run(cfg)
    assert summary["batch_size_search"] == {"tried": [16, 14, 12, 10, 8], "chosen": 8}
    assert seen == [16, 14, 12, 10] + [8] * 3 + [8] * 4
    assert summary["global_batch_size"] == 8 and torch.isfinite(torch.tensor(summary["final_loss"]))
    trial = read_metrics(next((cfg.run_dir / SEARCH_DIR / "batch_8").rglob("metrics.jsonl")))[1]
    print(f"\npeak memory: trial at 8 {trial['peak_mem_mb']:.1f} MiB, run {summary['peak_mem_mb']:.1f} MiB")
    # swin_micro at batch 8 needs well under 1 GiB: the failed trials' 4 GiB spikes are not the run's peak.
    assert trial["peak_mem_mb"] < 1024 and summary["peak_mem_mb"] < 1024
