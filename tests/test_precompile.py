"""precompile_blocks(): worker processes fill Inductor's caches so that the run's own compilation only loads.

Uses a small model with three block kinds (two widths, one block called at two sequence lengths) on the CPU with
Inductor's C++ backend, in a fresh cache directory: the workers compile every distinct graph, and the run's compile
of the same blocks then has no cache miss and computes what eager computes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gallery_lib.accel.compile.regional import compile_cache_stats, regional_compile
from gallery_lib.accel.compile.precompile import TensorSpec, precompile_blocks, record_block_calls
from compile_testing import compile_cache_counts


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("index", torch.arange(dim).flip(0))  # an index buffer: must stay valid in workers

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * torch.relu(self.fc(self.norm(x)))[..., self.index]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)  # so that a1's input requires grad, as a2's does (else two graphs)
        self.a1, self.a2 = Block(8), Block(8)  # same graph twice
        self.widen = nn.Linear(8, 12)
        self.b1, self.b2 = Block(12), Block(12)
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a2(self.a1(self.stem(x)))
        x = self.widen(x)
        y = self.b1(x, scale=0.5)
        z = self.b2(x[:, ::2].contiguous(), scale=0.5)  # same weights shape, shorter sequence: another graph
        return self.head(y).mean() + self.head(z).mean()


BLOCKS = ["a1", "a2", "b1", "b2"]


def test_record_finds_distinct_graphs_and_keeps_rng():
    model = Model()
    x = torch.randn(2, 6, 8)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    calls, seen = record_block_calls(model, lambda: model(x) + torch.rand(()), BLOCKS)
    assert seen == 4
    assert sorted(c.name for c in calls) == ["a1", "b1", "b2"]  # a2 repeats a1's graph
    assert torch.equal(torch.get_rng_state(), before)
    b2 = next(c for c in calls if c.name == "b2")
    assert b2.args == (TensorSpec((2, 3, 12), (36, 12, 1), torch.float32, True),) and b2.kwargs == {"scale": 0.5}


def test_the_recording_forward_keeps_no_autograd_graph_across_blocks():
    """Each block's output reaches the next as a leaf that still requires grad (so the specs are a training step's),
    and nothing before the last block is reachable from the forward's result: no activations are held across blocks."""
    model, x, result, seen_inputs = Model(), torch.randn(2, 6, 8), {}, []
    model.a2.register_forward_pre_hook(lambda m, args: seen_inputs.append(args[0]))
    calls, _ = record_block_calls(model, lambda: result.setdefault("loss", model(x)), BLOCKS)
    (a2_input,) = seen_inputs
    assert a2_input.requires_grad and a2_input.grad_fn is None
    assert all(c.args[0].requires_grad for c in calls)
    stem_grad, head_grad = torch.autograd.grad(result["loss"], [model.stem.weight, model.head.weight],
                                               allow_unused=True)
    assert stem_grad is None and head_grad is not None
    model.a1(x).sum().backward()  # the hooks are gone: a block trains as before
    assert model.a1.fc.weight.grad is not None


def test_running_a_call_eagerly_leaves_the_model_alone_and_its_copy_ready_to_compile():
    """``run_eagerly``, the kernels' first use: a forward and backward on the meta copy made real, then freed back to
    the meta device without gradients; the model's own weights and gradients are untouched."""
    from gallery_lib.accel.compile.precompile.record import compile_call, meta_copy, run_eagerly

    model, ran = Model(), []
    calls, _ = record_block_calls(model, lambda: model(torch.randn(2, 6, 8)), BLOCKS)
    call = next(c for c in calls if c.name == "b2")
    call.module, call.buffers = meta_copy(model.b2)
    call.module.fc.register_forward_hook(lambda m, a, out: ran.append(out.shape))
    weights = {n: p.clone() for n, p in model.named_parameters()}
    run_eagerly(call, torch.device("cpu"))
    assert ran == [torch.Size([2, 3, 12])]  # the recorded input shape, forward and backward
    assert all(p.is_meta and p.grad is None for p in call.module.parameters())
    assert all(torch.equal(p, weights[n]) and p.grad is None for n, p in model.named_parameters())
    assert call.module.get_buffer("index").is_meta  # compile_call copies the buffers' values in again
    compile_call(call, torch.device("cpu"), {"backend": "eager"})  # the copy still compiles afterwards
    assert len(ran) == 2


def test_queue_is_largest_first_and_each_graph_claimed_once(tmp_path):
    calls, _ = record_block_calls(Model(), lambda m=Model(): None, [])
    assert calls == []
    from gallery_lib.accel.compile.precompile.record import BlockCall, largest_first
    from gallery_lib.accel.compile.precompile.worker import _claim

    made = [BlockCall(str(c), (), {}, (), True, cost=c) for c in ((5, 1), (1, 9), (5, 3), (2, 2), (3, 0))]
    assert [c.cost for c in largest_first(made)] == [(5, 3), (5, 1), (3, 0), (2, 2), (1, 9)]
    assert [_claim(tmp_path, i) for i in (0, 1, 0, 1, 2)] == [True, True, False, False, True]


def test_a_block_with_more_layers_goes_first_even_with_fewer_parameters():
    """SD-1.5's attention blocks (29 submodules) compile slower than its widest resnets (8-9), which hold more
    parameters: the queue orders by submodule count."""
    from gallery_lib.accel.compile.precompile.record import largest_first

    deep, wide = nn.Sequential(*(Block(8) for _ in range(3))), Block(64)
    assert sum(p.numel() for p in wide.parameters()) > sum(p.numel() for p in deep.parameters())
    model = nn.Sequential(deep, nn.Linear(8, 64), wide)
    calls, _ = record_block_calls(model, lambda: model(torch.randn(2, 8)), ["0", "2"])
    assert [c.name for c in largest_first(calls)] == ["0", "2"]
    assert [c.cost[0] for c in largest_first(calls)] == [1 + 3 * 3, 3]


class Scaled(nn.Module):
    """A block whose forward reads a plain attribute: Dynamo guards on its value, so it is part of the graph."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.output_scale = scale

    def forward(self, x):
        return self.fc(x) / self.output_scale


def test_blocks_differing_only_in_a_plain_attribute_are_distinct_graphs():
    model = nn.Sequential(nn.Linear(4, 4), Scaled(1.0), Scaled(1.0), Scaled(2.0))
    calls, seen = record_block_calls(model, lambda: model(torch.randn(3, 4)), ["1", "2", "3"])
    assert seen == 3 and sorted(c.name for c in calls) == ["1", "3"]


def test_an_error_in_the_recording_forward_stops_the_workers():
    import time

    def forward():
        raise RuntimeError("broken forward")

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="broken forward"):
        precompile_blocks(Model(), forward, BLOCKS, workers=2, compile_kwargs={})
    assert time.perf_counter() - start < 60  # the workers were killed, not waited for


@pytest.mark.slow  # over 10 s on 2 cores: left out of the fast tier
def test_workers_started_early_exit_on_their_own_without_a_queue():
    """A run that fails before its precompile (a bad data folder, say) must not leave workers behind, even when the
    caller never closes them: they give up after their timeout."""
    from gallery_lib.accel.compile.precompile import CompileWorkers

    workers = CompileWorkers(1, "cpu", timeout_s=2.0)
    try:
        (proc, log_path), = workers.procs
        assert proc.wait(timeout=90) == 0, log_path.read_text()
        assert "ready: " in log_path.read_text()
    finally:
        workers.close()
    assert not workers.queue_path.parent.exists()  # its folder is removed


@pytest.mark.slow  # over 10 s on 2 cores: left out of the fast tier
def test_meanwhile_runs_once_while_the_workers_have_their_queue():
    """The run's other pre-step work (the attention probe) goes there: the workers are compiling by then."""
    from gallery_lib.accel.compile.precompile import CompileWorkers

    model, x = Model(), torch.randn(2, 6, 8)
    workers = CompileWorkers(1, "cpu")
    seen = []
    report = precompile_blocks(model, lambda: model(x), BLOCKS, workers=workers, compile_kwargs={"backend": "eager"},
                               log=lambda line: None, meanwhile=lambda: seen.append(workers.queue_path.exists()))
    assert seen == [True]
    assert report.failures == [] and sorted(report.graph_seconds) == ["a1", "b1", "b2"]


def test_bad_worker_count():
    with pytest.raises(ValueError, match="workers=0"):
        precompile_blocks(Model(), lambda: None, BLOCKS, workers=0, compile_kwargs={})


def test_finished_graphs_read_from_worker_logs_ignore_partial_lines(tmp_path):
    from gallery_lib.accel.compile.precompile.parallel import _finished_graphs

    log = tmp_path / "worker0.log"
    assert _finished_graphs(log) == []  # not written yet
    log.write_text('ready: {"python": 1.0}\ncompiled a1 in 2.5 s, started at 3.10 s\n'
                   'compiled b1 in 0.7 s, started at 5.60 s\ncompiled b2 i')
    assert _finished_graphs(log) == ["a1", "b1"]


def test_a_graph_that_fails_to_load_is_reported_and_left_to_the_run():
    from gallery_lib.accel.compile.precompile.parallel import BlockCall, _Loader

    broken = BlockCall("a1", (), {}, (), True, cost=1)  # no module to load: _compile_call raises
    loader = _Loader([broken], torch.device("cpu"), {"backend": "inductor"})
    assert loader.load(["not_queued"]) is False
    assert loader.load(["a1"]) is True
    assert loader.seconds == {} and len(loader.failures) == 1 and loader.failures[0].startswith("a1: ")
    assert loader.load(["a1"]) is False  # never tried twice


@pytest.mark.slow  # ~30 s on 2 cores: worker processes start twice
def test_a_second_run_of_the_same_graphs_starts_no_workers(tmp_path, monkeypatch):
    """The first plan's workers compile the graphs and leave a marker beside them in the cache directory; a second
    plan of the same run starts no workers (its first step loads the graphs), unless it records other graphs."""
    from types import SimpleNamespace

    from gallery_lib.accel.compile.plan import CompilePlan
    from gallery_lib.accel.distributed import DistInfo
    from gallery_lib.accel.compile.precompile import warm

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    family = SimpleNamespace(block_types=(Block,), block_modules=(Block.__module__,))
    settings = SimpleNamespace(precompile_workers=2, precompile_overlap=True, precompile_first_use=True,
                               compile=True, compile_whole_types=())
    run = {"family": family, "job": SimpleNamespace(model="toy", recipe="accelerated"), "batch_size": 2,
           "image_size": 8}
    cpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    model = Model()
    x = torch.randn(2, 6, 8)

    def plan_run(batch: torch.Tensor) -> tuple[CompilePlan, bool, list[str], bool]:
        lines, ran = [], []
        with CompilePlan(cpu, compile=settings, **run) as plan:
            started = plan.workers is not None
            plan.compile_blocks(model, backend="eager")
            precompiled = plan.precompile(model, lambda: model(batch), lines.append, lambda: ran.append(1))
            assert precompiled == bool(ran)  # the meanwhile work runs beside workers, else the caller runs it
            plan.summary(lines.append)
        return plan, started, lines, precompiled

    first, started, lines, precompiled = plan_run(x)
    assert started and precompiled and first.report.failures == [] and first.cached_key is None, lines
    assert warm.hinted_warm(first.hint)
    second, started, lines, precompiled = plan_run(x)
    assert not started and not precompiled and second.report is None and second.cached_key is not None
    skipped = [line for line in lines if "pre-compilation skipped" in line]
    assert second.precompile_seconds > 0 and len(skipped) == 1 and "3 distinct block graphs" in skipped[0], lines
    third, started, lines, precompiled = plan_run(x[:1])  # another batch: other graphs, so workers after all
    assert not started and precompiled and third.report.workers == 2 and third.cached_key is None
    assert warm.is_warm(second.cached_key)  # the caches missed nothing in the second run: its marker stays


def test_without_workers_a_run_waits_for_another_compiling_the_same_graphs(tmp_path, monkeypatch):
    """Without workers the first step compiles the blocks, and the run holds this machine's lock on their graph set
    until then; a run recording graphs whose lock another process holds waits for it (its first step then loads
    them); a run after them finds the graphs marked warm and neither waits nor holds."""
    import fcntl
    import threading
    import time
    from types import SimpleNamespace

    from gallery_lib.accel.compile.plan import CompilePlan
    from gallery_lib.accel.distributed import DistInfo
    from gallery_lib.accel.compile.precompile import warm
    from gallery_lib.accel.compile.precompile.record import backend_flags

    monkeypatch.setattr(warm, "marker_dir", lambda: tmp_path / "markers")  # beside the session's compile cache
    family = SimpleNamespace(block_types=(Block,), block_modules=(Block.__module__,))
    settings = SimpleNamespace(precompile_workers=0, precompile_overlap=True, precompile_first_use=True,
                               compile=True, compile_whole_types=())
    run = {"family": family, "job": SimpleNamespace(model="toy", recipe="accelerated"), "batch_size": 2,
           "image_size": 8}
    cpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    batch, other_batch = torch.randn(2, 6, 8), torch.randn(1, 6, 8)

    def key_of(x: torch.Tensor) -> str:  # as a plan records it, once its compile_blocks has compiled its model
        model = Model()
        regional_compile(model, (Block,), backend="eager")
        calls, _ = record_block_calls(model, lambda: model(x), BLOCKS)
        return warm.graph_set_key((c.graph_key for c in calls), {"backend": "eager", "dynamic": False},
                                  backend_flags(), cpu.device)

    def held(key: str) -> bool:
        (tmp_path / "markers").mkdir(exist_ok=True)
        with open(tmp_path / "markers" / f"{key}.lock", "a") as file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(file, fcntl.LOCK_UN)
            return False

    def plan_run(x: torch.Tensor, before_its_first_step_is_done=lambda plan: True) -> list[str]:
        lines = []
        with CompilePlan(cpu, compile=settings, **run) as plan:
            model = Model()  # each run its own model, as in its own process
            plan.compile_blocks(model, backend="eager")
            assert not plan.precompile(model, lambda: model(x), lines.append, lambda: None)
            assert before_its_first_step_is_done(plan)
            plan.first_step_done()
        return lines

    key, other_key = key_of(batch), key_of(other_batch)
    assert plan_run(batch, lambda plan: held(key) and not warm.is_warm(key)) == []
    assert not held(key) and warm.is_warm(key)  # marked once its first step was done, and let go

    def other_run_compiling(seconds: float) -> None:
        lock = warm.CompileLock(other_key)
        lock.acquire()
        time.sleep(seconds)
        warm.mark_warm(other_key)
        lock.release()

    other = threading.Thread(target=other_run_compiling, args=(2.0,))
    other.start()
    while other.is_alive() and not held(other_key):
        time.sleep(0.05)
    lines = plan_run(other_batch, lambda plan: not held(other_key))  # it waited, and holds nothing
    other.join()
    assert len(lines) == 1 and "waited 2 s for another run" in lines[0] and "3 distinct block graphs" in lines[0]
    assert plan_run(batch) == [] and not held(key)  # warm: no wait, no hold


@pytest.fixture(scope="module")
def toy_kernel_builds(tmp_path_factory) -> Path:
    """Where the toy blocks' C++ kernel builds are kept between the tests below (no graphs: each test's cache has
    none, so its workers compile every graph; only the C++ compiler runs once per kernel)."""
    return tmp_path_factory.mktemp("toy-kernel-builds")


@pytest.mark.slow  # ~1 min on 2 cores for the first: Inductor's C++ backend compiles 3 forward and 3 backward graphs
@pytest.mark.xdist_group("precompile_toy_kernels")  # one worker: the second links the first's kernel builds
@pytest.mark.parametrize("load", [True, False], ids=["loaded-as-they-land", "loaded-by-the-run"])
def test_workers_fill_the_cache_the_run_then_hits(load, toy_kernel_builds, tmp_path):
    """``workers_fill_the_cache``, in a fresh process as a training run is one: what earlier tests left in a pytest
    worker's process (settings that Inductor's cache keys hold) is not what the precompile workers start with."""
    code = (f"import test_precompile; from pathlib import Path; "
            f"test_precompile.workers_fill_the_cache({load}, Path({str(tmp_path / 'inductor')!r}), "
            f"Path({str(toy_kernel_builds)!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])


def workers_fill_the_cache(load: bool, cache: Path, kernel_builds: Path) -> None:
    """With ``load`` this process loads every graph once a worker has exited, and the run then traces nothing;
    without it the run's first call traces and finds every graph in the caches. The run autotunes cuDNN, the workers
    do not: the graphs must hit all the same. ``cache`` starts with no graph, and with the C++ kernels in
    ``kernel_builds``, where it leaves its own."""
    from torch._dynamo.utils import counters

    from compile_testing import compile_cache_at, copy_kernel_builds

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    kwargs = {"backend": "inductor", "dynamic": False}
    x = torch.randn(2, 6, 8)
    expected_model = Model()
    expected = expected_model(x)
    expected.backward()
    copy_kernel_builds(kernel_builds, cache)
    with compile_cache_at(cache):
        torch._dynamo.reset()
        counters.clear()
        model = Model()
        lines = []
        rng = torch.get_rng_state()
        report = precompile_blocks(model, lambda: model(x), BLOCKS, workers=2, compile_kwargs=kwargs,
                                   log=lines.append, load=load, warm_kernels=True)
        assert torch.equal(torch.get_rng_state(), rng)  # the loads ran on random inputs, the run's stream is kept
        assert report.failures == [] and report.load_failures == [], (report.failures, report.load_failures)
        assert (report.blocks, report.graphs, report.workers) == (4, 3, 2)
        assert sorted(report.graph_seconds) == ["a1", "b1", "b2"] and min(report.graph_seconds.values()) > 0
        # who compiled what, when: every graph once, by one of the 2 workers, after the queue was in place
        assert {name: seconds for name, (_, _, seconds) in report.schedule.items()} == report.graph_seconds
        assert {worker for worker, _, _ in report.schedule.values()} <= {0, 1}
        assert min(start for _, start, _ in report.schedule.values()) >= 0
        assert report.compile_span() <= report.workers_done_seconds - report.record_seconds
        assert 0 < report.workers_busy() <= 1
        assert f"workers busy {report.workers_busy():.0%}" in lines[0]
        # where the workers' time went, by PyTorch's compile phases: nested within the graphs' compiles, longest first
        phase_seconds = list(report.worker_phases.values())
        assert phase_seconds and phase_seconds == sorted(phase_seconds, reverse=True)
        assert 0 < phase_seconds[0] <= sum(report.graph_seconds.values()) + 0.1 * len(report.graph_seconds)
        assert 0 < report.record_seconds < report.workers_done_seconds <= report.seconds
        assert list(report.startup_seconds) == ["python", "imports", "cuda", "pool"]
        assert 0 < report.startup_seconds["pool"] < report.seconds
        assert "3 distinct block graphs (of 4 blocks) in 2 parallel processes" in lines[0]
        assert sorted(report.load_seconds) == (["a1", "b1", "b2"] if load else [])
        assert bool(report.load_phases) == load  # loading traces each graph again and loads it from the caches
        # the blocks first ran uncompiled here (their kernels' first use), and the caches still hit
        assert report.first_use_seconds > 0 and not report.first_use_error
        assert "kernels first run here" in lines[0]
        loaded_here = compile_cache_counts()
        traced_before_run = counters["stats"]["unique_graphs"]
        names = regional_compile(model, (Block,), **kwargs)
        assert names == BLOCKS
        out = model(x)
        out.backward()
        hits, misses = compile_cache_counts()
        if load:
            assert loaded_here[0] >= 3 and loaded_here[1] == 0, compile_cache_stats()
            assert traced_before_run == 3 and counters["stats"]["unique_graphs"] == 3  # the run traced nothing
        else:
            assert traced_before_run == 0 and hits >= 3 and misses == 0, compile_cache_stats()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), expected_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    copy_kernel_builds(cache, kernel_builds)


def test_workers_copy_the_runs_cpu_code_width():
    """A run that switched to AVX2-width CPU code (accel/compile/cpu_codegen.py) hands that to its workers: their
    graphs must be the ones the run would compile, or every one of them misses the cache."""
    from torch._inductor import config

    from gallery_lib.accel.compile.precompile.record import apply_flags, backend_flags

    with config.patch({"cpp.simdlen": 256}):
        flags = backend_flags()
    assert flags["cpp_simdlen"] == 256
    with config.patch({"cpp.simdlen": None}):
        apply_flags(flags)  # as a worker does with the run's flags
        assert config.cpp.simdlen == 256


def _cache_key_switches():
    """The process-wide switches Inductor's FX graph cache key reads (torch/_inductor/codecache.py)."""
    matmul = torch.backends.cuda.matmul
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            matmul.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction, torch.get_default_dtype())


def test_workers_copy_the_switches_the_cache_key_reads():
    """A process that ran a fast run ("high" matmul precision) and then a deterministic one ("highest") keys its
    graphs with fp32_precision "ieee", a fresh worker with "none": the worker copies the exact value, or every graph
    it compiles misses the run's cache (seen on a GPU after another test's run in the same process)."""
    from gallery_lib.accel.compile.precompile.record import apply_flags, backend_flags

    matmul = torch.backends.cuda.matmul
    saved = (_cache_key_switches(), torch.get_float32_matmul_precision())
    try:
        torch.set_float32_matmul_precision("high")
        torch.set_float32_matmul_precision("highest")
        torch.use_deterministic_algorithms(True, warn_only=False)
        matmul.allow_bf16_reduced_precision_reduction = False
        run_switches, flags = _cache_key_switches(), backend_flags()
        assert run_switches[2] == "ieee"
        matmul.fp32_precision = "none"  # as in a fresh worker
        torch.use_deterministic_algorithms(False)
        matmul.allow_bf16_reduced_precision_reduction = True
        apply_flags(flags)
        assert _cache_key_switches() == run_switches
    finally:
        (det, warn_only, precision, fp16, bf16, _), legacy = saved
        torch.set_float32_matmul_precision(legacy)
        matmul.fp32_precision = precision
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = fp16, bf16


def test_recording_the_block_calls_leaves_batchnorm_statistics_as_they_were():
    """The recording forward runs in training mode, where BatchNorm moves its running statistics: the run's first step
    must start from the same ones as a run without pre-compilation."""
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
                          nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))).train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    _, seen = record_block_calls(model, lambda: model(torch.randn(2, 3, 8, 8)), ["0", "1"])
    assert seen == 2
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
