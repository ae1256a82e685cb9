"""Two CPU processes (gloo): DDP and ZeRO-2 train what one process trains on the same global batch, the sampler
shares each epoch out once, ZeRO-2 checkpoints resume bitwise and load on another process count, two nodes on one
host train what one node trains, a worker killed mid-run is restarted by torchrun and the run resumes (on one node,
DDP and ZeRO-2, and on two), the multi-node flags reach torchrun, and the combinations that cannot work are
refused."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import launcher_testing
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gallery_lib.accel.distributed import DistInfo
from gallery_lib.app.cli import build_parser, main
from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.data.loader import TrainLoader, sampled_loader
from gallery_lib.run import launch as launch_module
from gallery_lib.run.checkpoint import LATEST, Checkpointer, CheckpointError, read_checkpoint
from gallery_lib.run.failure import read_failure
from gallery_lib.run.launch import Nodes, Processes, RunResult, launch, torchrun_command
from gallery_lib.run.metrics import read_metrics
from gallery_lib.run.train import run

STEPS = 10
FP32 = dict(rel=1e-5, abs=1e-6)
"""Same losses up to the order of the reductions (fp32, deterministic kernels)."""


def dist_cfg(data, out: Path, **kw) -> RunConfig:
    """swin_micro (LayerNorms only: the batch split does not change the function), fp32, no Mixup, 2 x 8 images (7
    steps per epoch of the 120 smoke images: the runs cross an epoch boundary)."""
    values = dict(model="swin_micro", data_dir=str(data), output_dir=str(out), image_size=64, batch_size=8,
                  nproc_per_node=2, steps=STEPS, warmup_steps=1, log_every=5, lr=1e-3, lr_warmup_steps=2,
                  num_workers=0, device="cpu", amp_level="O0", deterministic=True, mixup_alpha=0.0, cutmix_alpha=0.0)
    values.update(kw)
    return RunConfig(**values)


def losses(cfg: RunConfig) -> list[float]:
    return [s["loss"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]]


@pytest.fixture(scope="module")
def one_process(smoke_data, tmp_path_factory) -> list[float]:
    """The reference: one process at the global batch (16)."""
    cfg = dist_cfg(smoke_data, tmp_path_factory.mktemp("one"), nproc_per_node=1, batch_size=16)
    run(cfg)
    return losses(cfg)


@pytest.fixture(scope="module")
def zero2(smoke_data, tmp_path_factory) -> RunResult:
    """ZeRO-2 over 2 processes with an EMA, checkpoints after steps 4 and 8."""
    cfg = dist_cfg(smoke_data, tmp_path_factory.mktemp("zero2"), data_parallel="zero2", ema="foreach",
                   checkpoint_every=4, keep_checkpoints=3)
    return launch(cfg, echo=None)


@pytest.fixture(scope="module")
def ddp(smoke_data, tmp_path_factory) -> RunResult:
    """DDP over 2 processes with its speed switches, the same EMA and checkpoints after steps 4 and 8."""
    cfg = dist_cfg(smoke_data, tmp_path_factory.mktemp("ddp"), ema="foreach", checkpoint_every=4,
                   ddp_static_graph=True, ddp_bucket_cap_mb=1)
    return launch(cfg, echo=None)


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_ddp_two_processes_train_what_one_process_trains(ddp, one_process):
    assert len(one_process) == STEPS and one_process[-1] != one_process[0]
    assert losses(ddp.config) == pytest.approx(one_process, **FP32)
    assert "DDP over 2 processes: gradients as bucket views, 1 MB buckets, static graph" in ddp.summary["notes"]
    assert ddp.summary["world_size"] == 2 and ddp.summary["global_batch_size"] == 16


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_ddp_bf16_all_reduce_trains_what_one_process_trains_within_bf16(smoke_data, tmp_path, one_process, ddp):
    """The bf16-compressed all-reduce rounds the gradients: the losses stay within bf16's agreement with one process,
    and move further from it than the fp32 all-reduce's (which differ by the order of the sums alone)."""
    cfg = dist_cfg(smoke_data, tmp_path, ddp_grad_compression="bf16")
    result = launch(cfg, echo=None)
    assert "DDP over 2 processes: gradients as bucket views, 25 MB buckets, bf16 all-reduce" in result.summary["notes"]
    assert losses(cfg) == pytest.approx(one_process, rel=1e-3)

    def gap(run: list[float]) -> float:
        return max(abs(a - b) for a, b in zip(run, one_process))

    assert gap(losses(cfg)) > 10 * gap(losses(ddp.config))  # the hook ran: the gradients were rounded


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_zero2_two_processes_train_what_one_process_trains(zero2, one_process):
    assert losses(zero2.config) == pytest.approx(one_process, **FP32)
    assert any(n.startswith("ZeRO-2 over 2 process(es): FSDP2 fully_shard(reshard_after_forward=False) of 4 blocks")
               for n in zero2.summary["notes"])
    folder = zero2.run_dir / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_4.dcp", "step_4.pt", "step_8.dcp",
                                                        "step_8.pt"]
    assert {p.name for p in (folder / "step_8.dcp").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    saved = read_checkpoint(folder / "step_8.pt")
    assert saved["sharded"] == "step_8.dcp" and saved["model"] is None and saved["ema_step"] == 8
    assert saved["meta"]["data_parallel"] == "zero2" and saved["meta"]["global_batch"] == 16
    assert saved["data"]["epoch"] == 1  # 8 steps of 7 per epoch


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_zero2_shards_hold_the_weights_and_ema_of_ddp(zero2, ddp, tmp_path):
    """The sharded model, optimizer state and EMA, gathered offline, are DDP's after the same 8 steps."""
    dcp_to_torch_save(zero2.run_dir / "checkpoints" / "step_8.dcp", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    plain = read_checkpoint(ddp.run_dir / "checkpoints" / "step_8.pt")
    assert full["model"].keys() == plain["model"].keys()
    for name, value in plain["model"].items():
        torch.testing.assert_close(full["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    ema = plain["ema"]["module"]
    averaged = [n for n in ema if n in full["ema"] and ema[n].is_floating_point()]
    assert len(averaged) > 20 and not torch.equal(full["ema"][averaged[0]], full["model"][averaged[0]])
    for name in averaged:
        torch.testing.assert_close(full["ema"][name], ema[name], rtol=1e-5, atol=1e-6, msg=name)
    for name, index in optimizer_indices(ddp.config).items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["optimizer"]["state"][name][key], plain["optimizer"]["state"][index][key],
                                       rtol=1e-4, atol=1e-8, msg=f"{name} {key}")


def optimizer_indices(cfg: RunConfig) -> dict[str, int]:
    """Parameter name -> its index in a plain optimizer's ``state_dict`` (the no-decay group first, as the run's)."""
    from timm.optim import param_groups_weight_decay

    model = cfg.model_family.build(cfg.model, num_classes=10, image_size=cfg.image_size)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=model.no_weight_decay())
    return {names[id(p)]: i for i, p in enumerate(p for g in groups for p in g["params"])}


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
def test_zero2_accumulates_and_clips_as_one_process(smoke_data, tmp_path):
    """2 processes x 3 images x 2 accumulated batches (10 steps an epoch, as one process's batches of 12): each
    batch's gradients are reduce-scattered and added up, the norm of the sharded gradients is clipped, and fused AdamW
    steps the shards (its skip flag a plain tensor)."""
    runs = {name: dist_cfg(smoke_data, tmp_path / name, nproc_per_node=1, batch_size=12, fused_optimizer=True,
                           clip_grad=clip) for name, clip in (("clipped", 0.05), ("default_clip", 5.0))}
    for cfg in runs.values():
        run(cfg)
    sharded = dist_cfg(smoke_data, tmp_path / "zero2", batch_size=3, gradient_accumulation_steps=2,
                       data_parallel="zero2", fused_optimizer=True, clip_grad=0.05)
    launch(sharded, echo=None)
    assert losses(sharded) == pytest.approx(losses(runs["clipped"]), **FP32)
    assert losses(runs["clipped"])[2:] != pytest.approx(losses(runs["default_clip"])[2:], rel=1e-3)  # it clipped


@pytest.mark.slow  # over 30 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_zero2_compiled_blocks_train_the_same_function(smoke_data, tmp_path, one_process, monkeypatch):
    """ZeRO-2 with the blocks compiled in place, over 2 processes: Dynamo captures each block around FSDP2's sharded
    parameters and AOTAutograd differentiates it, as ``aot_eager``. Inductor's C++ code for the blocks is not what
    this checks (the Swin notebook's runs compile swin_micro's blocks with it, in one process); both processes
    compiling it at once took 2 minutes of CI."""
    monkeypatch.setattr(launch_module, "torchrun_command",
                        launcher_testing.torchrun_running(Path(__file__).with_name("aot_eager_train.py")))
    cfg = dist_cfg(smoke_data, tmp_path, data_parallel="zero2", compile=True, compile_scope="blocks")
    result = launch(cfg, echo=None)
    assert "torch.compile(mode='default') of 4 repeated blocks in place" in " ".join(result.summary["notes"])
    assert result.summary["compile_cache"]["graphs_traced"] > 0  # Dynamo captured the blocks in the processes
    assert losses(cfg) == pytest.approx(one_process, rel=1e-4, abs=1e-5)


@pytest.mark.slow  # over 30 s on 2 cores: left out of the fast tier
def test_zero2_exports_the_full_ema_model(tmp_path):
    """Text-to-image with an EMA: the pipeline a ZeRO-2 run exports holds the UNet that DDP's exports."""
    from safetensors.torch import load_file

    from data_prep.captions import make_caption_folder
    from gallery_lib.recipes.profiles import base_config

    data = make_caption_folder(tmp_path / "captions", num_images=16, image_size=32, seed=0, progress=False)
    exported = {}
    for mode in ("ddp", "zero2"):
        cfg = base_config("smoke", family="stable_diffusion", data_dir=str(data), output_dir=str(tmp_path / mode),
                          device="cpu", num_workers=0, steps=3, warmup_steps=1, log_every=3, batch_size=2,
                          nproc_per_node=2, amp_level="O0", deterministic=True, ema="foreach", data_parallel=mode)
        folder = Path(launch(cfg, echo=None).summary["exported_to"])
        exported[mode] = load_file(next((folder / "unet").glob("*.safetensors")))
    assert exported["zero2"].keys() == exported["ddp"].keys() and len(exported["ddp"]) > 100
    for name, value in exported["ddp"].items():
        torch.testing.assert_close(exported["zero2"][name], value, rtol=1e-4, atol=1e-5, msg=name)  # AdamW, fp32


def test_zero2_with_one_process_and_channels_last_conv_weights(smoke_data, tmp_path):
    """In-process, one process: ZeRO-2 starts its own group of one; FSDP2 shards only contiguous weights, so the
    channels-last conv weights go back to NCHW first, and the toy convnet trains what DDP's plain run trains."""
    import importlib

    import toy_family

    from gallery_lib.families import FAMILIES, unregister_family

    if "toy_convnet" not in FAMILIES:  # unregistered by an earlier test
        importlib.reload(toy_family)
    try:
        runs = {mode: dist_cfg(smoke_data, tmp_path / mode, model="toy_convnet", image_size=32, nproc_per_node=1,
                               batch_size=8, channels_last=True, data_parallel=mode) for mode in ("ddp", "zero2")}
        for cfg in runs.values():
            run(cfg)
        assert not torch.distributed.is_initialized()  # the run's own group is gone
        assert losses(runs["zero2"]) == losses(runs["ddp"])
    finally:
        unregister_family("toy_convnet")


def copy_checkpoint(cfg: RunConfig, step: int, out: Path, **changes) -> RunConfig:
    """``cfg`` resumed in ``out`` from its step-``step`` checkpoint alone (file and shards), with ``changes``."""
    resumed = cfg.replace(output_dir=str(out), resume=True, **changes)
    source, target = cfg.run_dir / "checkpoints", resumed.run_dir / "checkpoints"
    target.mkdir(parents=True)
    shutil.copy(source / f"step_{step}.pt", target)
    shutil.copytree(source / f"step_{step}.dcp", target / f"step_{step}.dcp")
    (target / LATEST).write_text(f"step_{step}.pt\n")
    return resumed


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_zero2_resumes_bitwise_on_the_same_process_count(zero2, tmp_path):
    resumed = copy_checkpoint(zero2.config, 4, tmp_path)
    result = launch(resumed, echo=None)
    assert result.summary["resumed_from_step"] == 4
    assert losses(resumed) == losses(zero2.config)[4:]  # steps 4 to 9, bitwise
    new, old = (read_checkpoint(c.run_dir / "checkpoints" / "step_8.pt") for c in (resumed, zero2.config))
    assert new["data"] == old["data"] and new["scheduler"] == old["scheduler"] and new["ema_step"] == 8


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_zero2_checkpoint_of_two_processes_loads_in_one(zero2, tmp_path):
    """One process at the same global batch continues the data stream by global sample count: the losses of the
    two-process run, up to the order of the reductions."""
    resumed = copy_checkpoint(zero2.config, 4, tmp_path, nproc_per_node=1, batch_size=16)
    summary = run(resumed)
    assert summary["resumed_from_step"] == 4 and summary["world_size"] == 1
    assert losses(resumed) == pytest.approx(losses(zero2.config)[4:], **FP32)  # steps 4 to 9


@pytest.mark.slow  # two processes over gloo, over 15 s on 2 cores: left out of the fast tier
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_resharding_needs_the_same_global_batch(zero2, tmp_path):
    path = zero2.run_dir / "checkpoints" / "step_4.pt"
    meta = read_checkpoint(path)["meta"]
    cfg = zero2.config.replace(nproc_per_node=1, batch_size=4)
    one = Checkpointer(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), model=None,
                       optimizer=None, scheduler=None, precision=None, loader=None)
    with pytest.raises(CheckpointError, match=r"global batch of 16 \(2 process\(es\)\); this run's is 4 \(1 x "
                                              r"batch_size 4\)\. .* same global batch: set batch_size=16\."):
        one._check_fits(meta, path)
    ddp_run = Checkpointer(cfg.replace(data_parallel="ddp"), one.dist, None, None, None, None, None)
    with pytest.raises(CheckpointError, match="written by a data_parallel='zero2' run and this run is "
                                              "data_parallel='ddp'.*resume with data_parallel='zero2'"):
        ddp_run._check_fits(meta, path)


# Several nodes and restarts: each launcher runs in a process of its own, as on a node of its own, with a deadline.

def two_nodes(cfg: RunConfig, folder: Path, kill: tuple[int, int] | None = None, **env: str) -> list[dict]:
    """``cfg`` as two nodes of one process each on this host (c10d rendezvous on a free port): each node's summary.
    ``kill``: (global rank, step) of the worker that SIGKILLs itself in the job's first attempt (``kill_once.py``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = Nodes(nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_backend="c10d", rdzv_id=f"job{port}")
    # the host's cores shared by its two nodes as by the two processes of one node
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
    launchers = [launcher_testing.start(cfg.replace(nproc_per_node=1), folder, f"node{i}", nodes, kill,
                                        OMP_NUM_THREADS=threads, **env) for i in range(2)]
    return launcher_testing.finish(launchers, timeout=300)


@pytest.fixture(scope="module")
def two_node_run(ddp, tmp_path_factory) -> tuple[RunConfig, list[dict]]:
    """``ddp``'s run as two nodes of one process: its config and each node's summary."""
    folder = tmp_path_factory.mktemp("two_nodes")
    cfg = ddp.config.replace(output_dir=str(folder / "out"))
    return cfg, two_nodes(cfg, folder / "launchers")


@pytest.mark.slow  # two launchers, each with its torchrun and one process, over 15 s on 2 cores
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_two_nodes_train_what_one_node_of_two_processes_trains(two_node_run, ddp):
    cfg, summaries = two_node_run
    assert losses(cfg) == pytest.approx(losses(ddp.config), **FP32)
    # global rank 0 alone wrote the metrics, each step once, and only its node's launcher returns the summary
    steps, summary = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert sorted(summaries, key=bool) == [{}, summary]
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 16
    assert sorted(p.name for p in (cfg.run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]


@pytest.mark.slow  # two launchers whose workers torchrun starts twice, over 20 s on 2 cores
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_two_nodes_restart_a_killed_worker_and_resume(two_node_run, tmp_path):
    """Global rank 1 SIGKILLed in step 6 while rank 0 is busy: its node's torchrun restarts its worker, the other
    node's restarts rank 0 as the rendezvous changes (and counts no restart), and both resume from step 4: the
    uninterrupted job's losses."""
    cfg, _ = two_node_run
    killed = cfg.replace(output_dir=str(tmp_path / "out"), max_restarts=1)
    no_summary, summary = sorted(two_nodes(killed, tmp_path / "launchers", kill=(1, 6), GALLERY_TEST_KILL_PAUSE="5"),
                                 key=bool)
    assert no_summary == {} and summary["resumed_from_step"] == 4
    assert [s["step"] for s in read_metrics(killed.run_dir / "metrics.jsonl")[0]] == list(range(STEPS))
    assert losses(killed) == losses(cfg)


@pytest.mark.slow  # a 2-process run whose workers torchrun starts twice, over 20 s on 2 cores
@pytest.mark.xdist_group("two_process_runs")  # the module fixtures' runs, once in one worker
def test_a_killed_worker_is_restarted_and_resumes_from_the_last_checkpoint(zero2, tmp_path):
    """ZeRO-2's rank 1 SIGKILLed in step 6 (after the checkpoint of step 4): torchrun restarts both workers, they
    resume from step 4's sharded checkpoint and train the losses of the uninterrupted run. DDP's restart, from a
    full checkpoint, is the two-node test's (and one process's, test_reliability.py's)."""
    cfg = zero2.config.replace(output_dir=str(tmp_path / "out"), max_restarts=1)
    summary, = launcher_testing.finish([launcher_testing.start(cfg, tmp_path, "launcher", kill=(1, 6))], timeout=300)
    console = (tmp_path / "launcher.log").read_text()
    assert "[gallery] torchrun restart 1 of 1: the workers start again" in console  # echoed after rank 0's stop
    assert "resumed from step 4 after torchrun restart 1" in console
    assert summary["resumed_from_step"] == 4 and read_failure(cfg.run_dir) is None
    assert [s["step"] for s in read_metrics(cfg.run_dir / "metrics.superseded.jsonl")[0]] == [4]  # the first attempt's
    assert [s["step"] for s in read_metrics(cfg.run_dir / "metrics.jsonl")[0]] == list(range(STEPS))
    assert losses(cfg) == losses(zero2.config)


def test_sampler_covers_each_epoch_once_across_ranks():
    """Two ranks draw disjoint halves of every epoch and together every sample once; global batch k holds the
    samples of one process's batch k at the same global batch (what a resharded resume relies on)."""
    def batches(world: int, rank: int, batch: int) -> list[set[int]]:
        loader = TrainLoader(sampled_loader(_Indices(), batch_size=batch, device=torch.device("cpu"), num_workers=0,
                                            seed=3, world_size=world, rank=rank), _Indices(), finish=lambda b: b)
        return [set(b.tolist()) for _, b in zip(range(2 * loader.steps_per_epoch), loader)]

    ranks = [batches(2, rank, 4) for rank in (0, 1)]
    single = batches(1, 0, 8)
    for epoch in (0, 1):
        per_rank = [set().union(*r[3 * epoch:3 * epoch + 3]) for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == 12 and not per_rank[0] & per_rank[1]
        assert per_rank[0] | per_rank[1] == set(range(24))
    assert [a | b for a, b in zip(*ranks)] == single
    assert single[:3] != single[3:]  # a new order each epoch


class _Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, k: int) -> int:
        return k


def test_multi_node_flags_reach_torchrun(smoke_data, tmp_path, monkeypatch):
    args = ["train", "--profile", "smoke", "--model", "swin_micro", "--data-dir", str(smoke_data), "--output-dir",
            str(tmp_path), "--device", "cpu", "--nproc_per_node", "2"]
    launched = []
    monkeypatch.setattr(launch_module, "launch", lambda cfg, nodes: launched.append((cfg, nodes)) or
                        RunResult(cfg, cfg.run_dir, summary={}))
    assert main(args + ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29500"]) == 0
    (cfg, nodes), = launched
    processes = Processes(cfg.nproc_per_node, cfg.max_restarts)
    command = torchrun_command(processes, tmp_path / "config.json", nodes)
    assert "--standalone" not in command
    assert command[3:8] == ["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=node0:29500", "--nproc-per-node=2", "-m"]

    parsed = build_parser().parse_args(args + ["--nnodes", "2", "--rdzv_endpoint", "n0:1", "--rdzv-backend", "c10d",
                                               "--rdzv-id", "job7"])
    nodes = Nodes(parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint, parsed.rdzv_backend, parsed.rdzv_id)
    nodes.check(cfg.find_batch_size)
    with pytest.raises(ConfigError, match="find_batch_size=True is invalid on several nodes"):
        nodes.check(find_batch_size=True)
    assert nodes.torchrun_flags() == ["--nnodes=2", "--rdzv-endpoint=n0:1", "--rdzv-backend=c10d", "--rdzv-id=job7"]
    assert torchrun_command(processes, tmp_path / "config.json")[3:5] == ["--standalone", "--nproc-per-node=2"]


@pytest.mark.parametrize("nodes, message", [
    (Nodes(nnodes=2), r"--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (Nodes(nnodes=2, rdzv_endpoint="node0:29500"),
     r"static rendezvous needs --node-rank on every node: 0 on the node at node0:29500, 1 to 1 on the others"),
    (Nodes(nnodes=2, node_rank=2, rdzv_endpoint="node0:29500"), r"--node-rank 2 is invalid with --nnodes 2"),
    (Nodes(node_rank=1), r"describe a job over several nodes"),
    (Nodes(nnodes=2, node_rank=0, rdzv_endpoint="n:1", rdzv_backend="etcd"), r"--rdzv-backend etcd is not known"),
])
def test_bad_node_flags_are_refused(nodes, message):
    with pytest.raises(ConfigError, match=message):
        nodes.check()


def test_bad_node_flags_print_the_fix_without_a_traceback(capsys):
    assert main(["train", "--profile", "smoke", "--device", "cpu", "--nnodes", "2"]) == 2
    assert capsys.readouterr().err.startswith("gallery: error: --nnodes 2 needs --rdzv-endpoint HOST:PORT")


@pytest.mark.parametrize("fields, message", [
    (dict(compile=True, compile_mode="reduce-overhead"),
     (r"compile_mode='reduce-overhead' captures CUDA graphs, and data_parallel='zero2' all-gathers .* use "
      r"compile_mode='default' or 'max-autotune-no-cudagraphs' with zero2, or data_parallel='ddp'")),
    (dict(compile=True, compile_mode="max-autotune"), r"compile_mode='max-autotune' captures CUDA graphs"),
    (dict(amp_level="O2"), r"amp_level='O2' is invalid with data_parallel='zero2'.* Use amp_level='O1'"),
    (dict(compile=True, compile_scope="blocks", precompile_workers=2),
     r"precompile_workers=2 is invalid with data_parallel='zero2'.* Set precompile_workers=0"),
])
def test_zero2_refuses_what_cannot_work(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(model="swin_micro", data_parallel="zero2", **fields)
    RunConfig(model="swin_micro", data_parallel="ddp", **fields)  # each is fine with DDP


@pytest.mark.slow  # over 10 s on 2 cores: left out of the fast tier
def test_ddp_accumulates_with_one_all_reduce_per_step_as_one_process(smoke_data, tmp_path):
    """2 processes x 3 images x 2 accumulated batches against one process's batches of 12: the first batch's backward
    runs under DDP's no_sync, the last one all-reduces the sum."""
    reference = dist_cfg(smoke_data, tmp_path / "one", nproc_per_node=1, batch_size=12)
    run(reference)
    accumulated = dist_cfg(smoke_data, tmp_path / "ddp", batch_size=3, gradient_accumulation_steps=2)
    launch(accumulated, echo=None)
    assert losses(accumulated) == pytest.approx(losses(reference), **FP32)


def test_gradient_sync_skips_ddp_all_reduce_but_not_the_last_batch():
    from torch import nn

    from gallery_lib.accel.distributed import gradient_sync

    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self):
            nn.Module.__init__(self)
            self.require_backward_grad_sync = True

    ddp = FakeDDP()
    with gradient_sync(ddp, enabled=False):
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is True
    with gradient_sync(ddp, enabled=True):
        assert ddp.require_backward_grad_sync is True
    with gradient_sync(nn.Linear(2, 2), enabled=False):  # a plain or ZeRO-2 module: nothing to skip
        pass


@pytest.mark.parametrize("visible, own", [("4,6", "6"), (None, "1")])
def test_each_process_of_a_multi_gpu_run_sees_its_own_gpu_as_cuda_0(monkeypatch, visible, own):
    """So that every process compiles the graphs (keyed on their device, cuda:1 included) that one process does."""
    from gallery_lib.accel import distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    listed = {}  # a CUDA that lists its devices once, on the first question, from the variable then set
    monkeypatch.setattr(torch.cuda, "device_count", lambda: listed.setdefault(
        "n", len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) if "CUDA_VISIBLE_DEVICES" in os.environ else 2))
    assert distributed.see_only_own_gpu() and os.environ["CUDA_VISIBLE_DEVICES"] == own
    # where CUDA had listed the devices before, the process keeps the machine's numbering
    listed["n"] = 2
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert not distributed.see_only_own_gpu() and os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not distributed.see_only_own_gpu() and os.environ.get("CUDA_VISIBLE_DEVICES") == visible


def test_a_training_process_that_sees_its_own_gpu_alone_passes_the_machine_check(monkeypatch, smoke_data, tmp_path):
    """The launcher checked the machine's GPUs; the process itself, pinned to one, must not refuse nproc_per_node=2."""
    from gallery_lib.run import train

    cfg = dist_cfg(smoke_data, tmp_path, device="cuda")
    path = cfg.save(tmp_path / "config.json")
    started = {}

    def init_distributed(device_type, *, zero2, own_gpu):
        started.update(device_type=device_type, own_gpu=own_gpu)
        raise KeyboardInterrupt  # stop before the training starts

    monkeypatch.setattr(train, "see_only_own_gpu", lambda: True)
    monkeypatch.setattr("gallery_lib.config.machine.visible_cuda_devices", lambda: 1)
    monkeypatch.setattr(train, "init_distributed", init_distributed)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--config", str(path)])
    assert started == {"device_type": "cuda", "own_gpu": True}


def test_blocks_compiled_in_place_inside_ddp_keep_the_graphs_of_one_process(tmp_path):
    """Dynamo's DDPOptimizer splits the graph of a block compiled inside DDP at its gradient buckets: a multi-process
    run would compile other graphs than those a single process and the precompile workers leave in the caches."""
    import torch.distributed as torch_dist
    from torch import nn
    from torch._dynamo.testing import CompileCounter

    from gallery_lib.accel.distributed import keep_block_graphs_whole_under_ddp

    def graphs_compiled(whole: bool) -> int:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(optimize_ddp=True):
            if whole:
                keep_block_graphs_whole_under_ddp()
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))
                                    for _ in range(2)))
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)  # a bucket per 1 MiB Linear
            counter = CompileCounter()
            for block in model:
                block.compile(backend=counter)
            ddp(torch.randn(4, 512)).sum().backward()
            return counter.frame_count

    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1)
    try:
        assert graphs_compiled(whole=False) > 2  # split at the buckets
        assert graphs_compiled(whole=True) == 2  # one graph per block, as in one process
    finally:
        torch_dist.destroy_process_group()
        torch._dynamo.reset()
