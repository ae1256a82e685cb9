"""The training loop, AMP levels, the launcher and two-process DDP on CPU."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from gallery_lib.config import RunConfig
from gallery_lib.run.failure import read_failure
from gallery_lib.run.launch import RunFailed, launch
from gallery_lib.run.metrics import read_metrics
from gallery_lib.models import build_model
from gallery_lib.accel.precision import Precision
from gallery_lib.run.train import run


def micro_cfg(data, tmp_path, **kw) -> RunConfig:
    values = dict(model="swin_micro", data_dir=str(data), output_dir=str(tmp_path / "out"), image_size=64,
                  batch_size=4, steps=6, warmup_steps=2, log_every=4, lr=1e-3, lr_warmup_steps=1, num_workers=0,
                  device="cpu")
    values.update(kw)
    return RunConfig(**values)


def test_run_writes_step_records_and_summary(smoke_data, tmp_path):
    cfg = micro_cfg(smoke_data, tmp_path)
    summary = run(cfg)
    steps, stored = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert stored == summary
    assert [s["step"] for s in steps] == list(range(6))
    assert [s["warmup"] for s in steps] == [True, True, False, False, False, False]
    assert all(torch.isfinite(torch.tensor(s["loss"])) and s["step_time_ms"] > 0 for s in steps)
    assert steps[0]["lr"] < steps[1]["lr"]  # linear warm-up, then cosine decay
    assert steps[-1]["lr"] < steps[1]["lr"]
    assert summary["world_size"] == 1 and summary["global_batch_size"] == 4
    assert summary["median_step_time_ms"] > 0 and summary["samples_per_s"] == pytest.approx(
        4e3 / summary["median_step_time_ms"])
    assert summary["warmup_time_s"] == pytest.approx(sum(s["step_time_ms"] for s in steps[:2]) / 1e3)
    assert summary["output_dir"] == str(cfg.run_dir) and summary["skipped_samples"] == 0
    # what the warm-up left was frozen out of the collector's walks for the timed steps, then handed back
    assert summary["gc_frozen_objects"] > 10_000 and summary["gc_full_collections"] >= 0
    assert gc.get_freeze_count() == 0


def test_profile_steps_writes_the_op_time_by_kind(smoke_data, tmp_path, capsys):
    cfg = micro_cfg(smoke_data, tmp_path, steps=6, warmup_steps=2, profile_steps=9)  # more than the run has left
    summary = run(cfg)
    table = json.loads((cfg.run_dir / "profile.json").read_text())
    # the last steps, all but one after warm-up: the speed figures come from that one, before the profiler
    assert table["profiled_steps"] == 3 and table["device"] == "cpu"
    assert summary["profiled_steps"] == 3 and summary["p20_step_time_ms"] == summary["p80_step_time_ms"]
    assert table["kernel_ms_per_step"] > 0
    assert table["kernel_ms_per_step"] == pytest.approx(sum(table["by_kind_ms"].values()))
    kinds = {row["kind"] for row in table["top_kernels_ms"]}
    assert "matmul" in kinds and "optimizer and EMA" in kinds  # the Swin's linear layers and AdamW were seen
    launchers = {(row["kind"], row["op"]) for row in table["top_launchers_ms"]}
    assert ("matmul", "aten::linear") in launchers  # addmm's time counted to the layer call around it
    out = capsys.readouterr().out
    assert "profile of steps 3-5" in out and "(median of 1 steps after warm-up)" in out


def test_gpu_kernels_count_under_the_op_that_launched_them_not_a_runtime_call_sharing_its_id():
    """The CUDA table from events shaped as torch 2.11's parser leaves them, made up here (CI has no GPU): the
    parser attached each kernel to every CPU event of its launch's id, runtime calls and profiler records included;
    a GPU-side range is not a kernel; a kernel without a launching op still counts."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from gallery_lib.run.profiling import kernel_table

    def cpu(id_, name, parent=None, kernels=()):
        return SimpleNamespace(id=id_, name=name, device_type=DeviceType.CPU, cpu_parent=parent,
                               kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels])

    def gpu(name, us, annotation=False):
        return SimpleNamespace(id=0, name=name, device_type=DeviceType.CUDA, is_user_annotation=annotation,
                               self_device_time_total=us, kernels=[])

    linear = cpu(7, "aten::linear")
    launched = [("nvjet_gemm", 300.0)]
    events = [linear, cpu(7, "aten::addmm", linear, launched), cpu(7, "cudaLaunchKernel", None, launched),
              cpu(7, "Activity Buffer Request", None, launched), gpu("nvjet_gemm", 300.0),
              cpu(9, "## Call CompiledFxGraph abc ##", None, [("triton_poi_fused_add_0", 50.0)]),
              cpu(9, "cudaGraphLaunch", None, [("triton_poi_fused_add_0", 50.0)]), gpu("triton_poi_fused_add_0", 50.0),
              gpu("Optimizer.step#AdamW.step", 900.0, annotation=True), gpu("direct_copy_kernel", 20.0)]
    table = kernel_table(SimpleNamespace(events=lambda: events), steps=2, device_type="cuda")
    assert table["kernel_ms_per_step"] == pytest.approx((300 + 50 + 20) / 1000 / 2)
    rows = {(row["kind"], row["op"]): row["ms"] for row in table["top_launchers_ms"]}
    assert rows == pytest.approx({("matmul", "aten::linear"): 0.15,
                                  ("Triton: other fusions", "## Call CompiledFxGraph abc ##"): 0.025,
                                  ("copies and casts", "(no launching op)"): 0.01})


def test_kernel_kinds_read_hopper_and_inductor_names():
    from gallery_lib.run.profiling import kind_of

    assert kind_of("triton_per_fused_native_layer_norm_0") == "Triton: normalization fusions"
    assert kind_of("triton_poi_fused_convolution_1") == "Triton: other fusions"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kind_of("void cudnn::fmha::flash_bprop") == "attention"
    assert kind_of("void at::native::fused_adamw_kernel") == "optimizer and EMA"
    assert kind_of("sm90_xmma_fprop_implicit_gemm_bf16") == "convolution"  # before "gemm" is read as a matmul
    # the gallery's own Triton kernels (accel/kernels), by their names
    assert kind_of("_window_attn_bwd_kernel") == "attention"
    assert kind_of("_gn_fwd_kernel") == kind_of("_ln_bwd_kernel") == "normalization"
    assert kind_of("_geglu_bwd_kernel") == kind_of("_ce_fwd_kernel") == "GEGLU, cross-entropy kernels"
    assert kind_of("_ema_lerp_kernel") == "optimizer and EMA"


def test_training_reduces_loss_on_mock_data(smoke_data, tmp_path):
    cfg = micro_cfg(smoke_data, tmp_path, steps=40, warmup_steps=1, log_every=10, batch_size=16, mixup_alpha=0,
                    cutmix_alpha=0, label_smoothing=0, lr=3e-3, lr_warmup_steps=3, amp_level="O0")
    run(cfg)
    losses = [s["loss"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]]
    # The class signatures are learnable: a micro Swin from scratch drops ~15% in 40 steps (seeded, no workers).
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5


def test_amp_o2_keeps_bf16_weights_and_fp32_masters():
    model = build_model("swin_micro", num_classes=4)
    cfg = RunConfig(model="swin_micro", amp_level="O2", batch_size=2, steps=2, warmup_steps=0)
    precision = Precision.from_settings(cfg.sections.precision, "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    precision.cast_model(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    masters = list(precision.master_params.values())
    assert masters and all(m.dtype == torch.float32 for m in masters)
    # masters hold the fp32 init exactly, not the bf16-rounded copy
    for (name, p), m in zip(model.named_parameters(), masters):
        assert torch.equal(m, before[name])
    opt = torch.optim.AdamW(precision.optimizer_params([{"params": list(model.parameters())}]), lr=1e-2)
    x = torch.randn(2, 3, 64, 64)
    with precision.autocast():
        loss = model(x.bfloat16()).float().square().mean()
    precision.backward(loss)
    precision.step(model, opt, clip_grad=1.0)
    for p, m in precision.master_params.items():
        assert torch.equal(p.data, m.to(torch.bfloat16))  # the update was copied back
    assert any(not torch.equal(m, before[n]) for (n, _), m in zip(model.named_parameters(), masters))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_levels_track_fp32_losses(smoke_data, tmp_path, level):
    common = dict(steps=5, warmup_steps=1, log_every=5, mixup_alpha=0, cutmix_alpha=0)
    ref = run(micro_cfg(smoke_data, tmp_path / "ref", amp_level="O0", **common))
    low = run(micro_cfg(smoke_data, tmp_path / level, amp_level=level, **common))
    ref_losses = [s["loss"] for s in read_metrics(tmp_path / "ref/out/swin_transformer/baseline/metrics.jsonl")[0]]
    low_losses = [s["loss"] for s in read_metrics(
        tmp_path / level / "out/swin_transformer/baseline/metrics.jsonl")[0]]
    assert low_losses[0] == pytest.approx(ref_losses[0], rel=2e-2)  # bf16 rounding of one forward pass
    assert max(abs(a - b) for a, b in zip(ref_losses, low_losses)) < 0.1
    assert ref["final_loss"] != low["final_loss"]  # the precision switch really changed the math


def test_recipe_switches_learn_the_same_function(smoke_data, tmp_path):
    """Baseline vs the accelerated recipe's non-compile switches (registry window attention, channels_last,
    fused AdamW), both in fp32: per-step losses agree to float32 round-off."""
    common = dict(steps=8, warmup_steps=1, log_every=8, amp_level="O0")
    base = micro_cfg(smoke_data, tmp_path / "a", **common)
    fast = micro_cfg(smoke_data, tmp_path / "b", fused_attention=True, channels_last=True, fused_optimizer=True,
                     **common)
    base_summary = run(base)
    run(fast)
    a = [s["loss"] for s in read_metrics(base.run_dir / "metrics.jsonl")[0]]
    steps, summary = read_metrics(fast.run_dir / "metrics.jsonl")
    assert [s["loss"] for s in steps] == pytest.approx(a, rel=1e-4)
    assert any("4 Swin window-attention modules through gallery_lib.accel.attention" in n for n in summary["notes"])
    # the run says what auto ran per attention shape: micro Swin's two stages (batch x 16 or 4 windows of 4x4 tokens,
    # 2 or 4 heads of 16), each with the relative-position bias, on the CPU rule
    keys = [f"({w}, {h}, 16, 16)|({w}, {h}, 16, 16)|float32|CPU|bias=True"
            for w, h in ((fast.batch_size * 16, 2), (fast.batch_size * 4, 4))]
    assert summary["attention"] == dict.fromkeys(keys, "math (the CPU rule)")
    # without the hook timm's Swin computes attention with its own matmul and softmax: no kernel choice to report
    assert "attention" not in base_summary


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
def test_launch_two_process_ddp_with_gloo(smoke_data, tmp_path):
    cfg = micro_cfg(smoke_data, tmp_path, nproc_per_node=2, steps=4, warmup_steps=1, log_every=2)
    lines: list[str] = []
    result = launch(cfg, echo=lines.append)
    assert result.summary["world_size"] == 2 and result.summary["global_batch_size"] == 8
    assert result.run_dir == cfg.run_dir.resolve()
    assert {p.name for p in (result.run_dir / "logs").iterdir()} == {"rank0.log", "rank1.log"}
    assert any("DDP over 2 processes" in line for line in lines)  # rank 0 streamed to the caller
    assert "[gallery] step" not in (result.run_dir / "logs/rank1.log").read_text()  # rank 1 only logs to its file
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["parallel"]["nproc_per_node"] == 2 and saved["job"]["recipe"] == "baseline"


@pytest.mark.gpu
def test_launch_two_gpu_ddp_with_nccl_exits_cleanly(smoke_data, tmp_path):
    """The NCCL twin of the gloo test, three times in a row: every run ends with exit code 0 through
    ``exit_process`` (process group destroyed first, no abort at exit)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (the nvidia-h200-x2 machine)")
    for attempt in range(3):
        cfg = micro_cfg(smoke_data, tmp_path / str(attempt), nproc_per_node=2, steps=6, device="cuda")
        lines: list[str] = []
        result = launch(cfg, echo=lines.append)
        assert result.summary["world_size"] == 2 and result.summary["global_batch_size"] == 8
        assert not any("destroy_process_group() was not called" in line for line in lines)

def test_launch_errors_before_starting(tmp_path, smoke_data):
    with pytest.raises(FileNotFoundError, match="gallery prepare"):
        launch(micro_cfg(tmp_path / "missing", tmp_path))
    assert not (tmp_path / "out").exists()  # nothing was started or written


def test_failed_run_raises_with_the_rank_log(tmp_path):
    bad = tmp_path / "bad" / "train" / "n0000"
    bad.mkdir(parents=True)
    for i in range(6):
        (bad / f"{i}.JPEG").write_bytes(b"not a jpeg")
    cfg = micro_cfg(tmp_path / "bad", tmp_path, steps=2, warmup_steps=0)
    with pytest.raises(RunFailed) as info:
        launch(cfg, echo=None)
    message = str(info.value)
    assert "rank0.log" in message and "consecutive" in message
    failure = info.value.failure  # what a notebook shows in one line, recorded by the training process
    assert failure.kind == "error" and "consecutive" in failure.reason and failure.log.endswith("rank0.log")
    assert read_failure(cfg.run_dir.resolve()) == failure and len(failure.line("baseline").splitlines()) == 1


def test_amp_o2_steps_match_fp32_master_sgd():
    """Two O2 steps with SGD equal SGD on fp32 masters fed the same bf16 grads (grads must not accumulate)."""
    model = torch.nn.Linear(4, 3)
    cfg = RunConfig(model="swin_micro", amp_level="O2", batch_size=2, steps=2, warmup_steps=0)
    precision = Precision.from_settings(cfg.sections.precision, "cpu")
    precision.cast_model(model)
    opt = torch.optim.SGD(precision.optimizer_params([{"params": list(model.parameters())}]), lr=0.5)
    expected = {p: m.clone() for p, m in precision.master_params.items()}
    for _ in range(2):
        x = torch.randn(5, 4)
        with precision.autocast():
            model(x.bfloat16()).float().sum().backward()
        grads = {p: p.grad.float().clone() for p in model.parameters()}
        precision.step(model, opt, clip_grad=None)
        opt.zero_grad(set_to_none=True)
        for p in expected:
            expected[p] -= 0.5 * grads[p]
        assert all(p.grad is None for p in model.parameters())
    for p, m in precision.master_params.items():
        assert torch.allclose(m, expected[p], atol=1e-6)


def test_kernel_opt_trains_the_same_function(smoke_data, tmp_path):
    """--kernel-opt swaps Swin's LayerNorms for gallery_lib's fused ones: same per-step losses in fp32."""
    common = dict(steps=4, warmup_steps=1, log_every=4, amp_level="O0")
    plain = micro_cfg(smoke_data, tmp_path / "a", **common)
    fused = micro_cfg(smoke_data, tmp_path / "b", kernels=True, **common)
    run(plain)
    summary = run(fused)
    assert any(note.startswith("fused kernels: swapped") for note in summary["notes"])
    a = [s["loss"] for s in read_metrics(plain.run_dir / "metrics.jsonl")[0]]
    b = [s["loss"] for s in read_metrics(fused.run_dir / "metrics.jsonl")[0]]
    assert b == pytest.approx(a, rel=1e-5)


# What torchrun printed when a worker aborted in C++ after a finished run (CI, 2026-11-23), shortened.
ABORTED_WORKER_CONSOLE = """\
[gallery] step 4/4 | loss 2.2526 | 278.1 img/s | 28.8 ms/step | peak 0.75 GiB
[gallery] done: 231.8 img/s (median of 3 steps after warm-up), warm-up 0.1 s, peak 0.75 GiB, final loss 2.2526
terminate called without an active exception
W1123 03:25:17.275000 1351 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1356 closing signal SIGTERM
E1123 03:25:17.348000 1351 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1142, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
gallery_lib.run.train FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 1356)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 1357)  (SIGABRT)
======================================================""".splitlines()


def test_failure_message_shows_why_a_worker_died_without_a_python_error(tmp_path):
    from gallery_lib.run.launch import _failure_message

    (tmp_path / "logs").mkdir()
    for rank in (0, 1):  # the rank logs hold no error: the abort happened in C++
        (tmp_path / f"logs/rank{rank}.log").write_text("[gallery] step 4/4 | loss 2.2526\n")
    message = _failure_message(tmp_path, 1, ABORTED_WORKER_CONSOLE)
    assert "terminate called without an active exception" in message
    assert "Root Cause" in message and "(SIGABRT)" in message
    assert "launch_agent" not in message  # torchrun's own traceback says nothing about the worker


def test_training_process_exit_codes(tmp_path):
    """``python -m gallery_lib.run.train`` leaves through ``exit_process``: usage errors keep argparse's code 2, a
    failing run prints its traceback and exits 1."""
    import subprocess
    import sys

    usage = subprocess.run([sys.executable, "-m", "gallery_lib.run.train"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--config" in usage.stderr
    missing = subprocess.run([sys.executable, "-m", "gallery_lib.run.train", "--config", str(tmp_path / "none.json")],
                             capture_output=True, text=True)
    assert missing.returncode == 1
    assert "Traceback" in missing.stderr and "none.json" in missing.stderr


EXIT_WITH_A_LIVE_GLOO_GROUP = """
import atexit, sys, torch, torch.distributed as dist
from gallery_lib.accel.distributed import exit_process, shutdown
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.randn(2, 4)).sum().backward()
dist.all_reduce(torch.ones(1))
shutdown()
atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran"))
print("trained", end="")  # no newline: the flush before os._exit must write it
exit_process(3)
"""


def test_exit_process_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    import subprocess
    import sys

    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_LIVE_GLOO_GROUP, str(tmp_path / "store"), str(marker)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "trained"
    assert marker.read_text() == "atexit ran"


def test_fused_loss_trains_the_same_function(smoke_data, tmp_path):
    """The classification task's ``fused_loss`` (gallery_lib's soft-target cross-entropy, its PyTorch reference on a
    CPU) against timm's SoftTargetCrossEntropy, fp32, Mixup targets: the same per-step losses."""
    common = dict(steps=4, warmup_steps=1, log_every=4, amp_level="O0")
    plain = micro_cfg(smoke_data, tmp_path / "a", **common)
    fused = micro_cfg(smoke_data, tmp_path / "b", fused_loss=True, **common)
    assert fused.options.fused_loss and not plain.options.fused_loss
    run(plain)
    run(fused)
    a, b = ([s["loss"] for s in read_metrics(c.run_dir / "metrics.jsonl")[0]] for c in (plain, fused))
    assert b == pytest.approx(a, rel=1e-5) and len(a) == 4


def test_clipping_in_the_optimizer_trains_the_same_function(smoke_data, tmp_path, monkeypatch):
    """``clip_in_optimizer`` with fused AdamW, fp32, a threshold every step's norm exceeds: the same per-step losses
    as clipping in its own pass, and the run took the folded path."""
    import gallery_lib.accel.clipping as clipping

    folded_steps = []
    real_can_fold = clipping.can_fold
    monkeypatch.setattr(clipping, "can_fold", lambda *a: folded_steps.append(real_can_fold(*a)) or folded_steps[-1])
    common = dict(steps=6, warmup_steps=1, log_every=6, amp_level="O0", fused_optimizer=True, clip_grad=0.05)
    plain = micro_cfg(smoke_data, tmp_path / "a", **common)
    folded = micro_cfg(smoke_data, tmp_path / "b", clip_in_optimizer=True, **common)
    run(plain)
    assert folded_steps == []  # the switch off: clip_grad_norm_ alone
    run(folded)
    assert folded_steps == [True] * 6
    a, b = ([s["loss"] for s in read_metrics(c.run_dir / "metrics.jsonl")[0]] for c in (plain, folded))
    assert b == pytest.approx(a, rel=1e-5) and len(a) == 6 and a[-1] != pytest.approx(a[0], rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
def test_gpu_kernel_time_by_launching_op_adds_up_to_the_kinds():
    from gallery_lib.run.profiling import kernel_table

    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16 * 30 * 30, 10)).cuda()
    x = torch.randn(32, 8, 32, 32, device="cuda")
    model(x).sum().backward()  # warm-up: cuDNN and cuBLAS pick their kernels outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            model(x.contiguous(memory_format=torch.channels_last)).sum().backward()
        torch.cuda.synchronize()
    table = kernel_table(prof, 2, "cuda")
    launched = {}
    for row in table["top_launchers_ms"]:
        launched[row["kind"]] = launched.get(row["kind"], 0.0) + row["ms"]
    for kind, ms in table["by_kind_ms"].items():  # each kernel counted once (fewer than 8 launchers per kind here)
        assert launched.get(kind, 0.0) == pytest.approx(ms, rel=1e-6, abs=1e-6), kind
    ops = {(row["kind"], row["op"]) for row in table["top_launchers_ms"]}
    assert ("matmul", "aten::linear") in ops and ("convolution", "aten::conv2d") in ops


def test_one_process_runs_the_training_module_without_torchrun(smoke_data, tmp_path, monkeypatch):
    """One process on one node without restarts: the launcher starts ``gallery_lib.run.train`` itself (torchrun's
    agent would add only its start-up), and a launcher that itself runs under torchrun hands down no ranks."""
    import sys

    from gallery_lib.run.launch import Nodes, Processes, torchrun_command, train_command

    cfg = micro_cfg(smoke_data, tmp_path, steps=2, warmup_steps=0, log_every=1)
    config = tmp_path / "config.json"
    one = Processes(cfg.nproc_per_node, cfg.max_restarts)
    assert train_command(one, config) == [sys.executable, "-m", "gallery_lib.run.train", "--config", str(config)]
    for torchrun in (Processes(per_node=2), Processes(max_restarts=1)):
        assert train_command(torchrun, config) == torchrun_command(torchrun, config)
    several_nodes = Nodes(nnodes=2, node_rank=0, rdzv_endpoint="n0:1")
    assert train_command(one, config, several_nodes) == torchrun_command(one, config, several_nodes)
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.9",
                        "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(name, value)
    result = launch(cfg, echo=None)
    assert result.summary["world_size"] == 1 and result.summary["resumed_from_step"] == 0  # no restart counted
    assert {p.name for p in (result.run_dir / "logs").iterdir()} == {"rank0.log"}


def test_a_classifier_run_saves_its_weights_and_scores_the_val_split(smoke_data, tmp_path):
    cfg = micro_cfg(smoke_data, tmp_path, steps=4, warmup_steps=1, export_model=True, mixup_alpha=0, cutmix_alpha=0,
                    amp_level="O0")
    summary = run(cfg)
    assert summary["exported_to"] == str(cfg.run_dir / "model.pt")
    assert summary["val_images"] == 20 and 0.0 <= summary["val_top1"] <= 1.0 and summary["val_loss"] > 0
    saved = torch.load(cfg.run_dir / "model.pt")
    model = build_model("swin_micro", num_classes=10)
    model.load_state_dict(saved)  # a plain state dict of the same model: every key, no wrapper prefix
    # the score is the saved model's own, on the val split through timm's eval transform
    from gallery_lib.data.classification import validation_loader

    model.eval()
    correct = sum((model(images).argmax(1) == labels).sum().item()
                  for images, labels in validation_loader(str(smoke_data), image_size=64, batch_size=8))
    assert summary["val_top1"] == pytest.approx(correct / 20)
