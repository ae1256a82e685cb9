"""optimize(model) and regional_compile(): choice by timing in the loop, fallback with reasons, numerics equal to eager.

Inductor on this 2-core CPU compiles a tiny MLP in seconds but the tiny Swin in minutes, so the Swin
checks trace with ``aot_eager`` (Dynamo + AOTAutograd, no code generation) and inductor runs on the MLP.
"""

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gallery_lib.accel.compile.regional import regional_compile, undo_regional_compile
from gallery_lib.accel.optimize import Candidate, optimize


class _Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), _Block(), _Block(), _Block(), nn.Linear(16, 4))


def _trainer(model):
    """A real step: forward, backward, SGD; the data comes from a fixed generator so runs are comparable."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses = []

    def step(m):
        opt.zero_grad(set_to_none=True)
        loss = m(torch.randn(16, 8, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    return step, losses


def _tiny_swin():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=4, window_size=4, embed_dim=24, depths=(2, 2), num_heads=(2, 4), num_classes=10,
    ).eval()  # eval: drop-path is random in train mode; gradients flow the same


def test_eager_two_runs_are_bitwise_equal():
    runs = []
    for _ in range(2):
        model = _mlp()
        step, losses = _trainer(model)
        for _ in range(4):
            step(model)
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def _loop(model, steps, seed=1):
    """A plain training loop calling the model: ``steps`` SGD steps on a fixed data stream; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(16, 8, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_optimize_tries_candidates_in_the_loop_and_trains_like_eager(tmp_path):
    logs = []
    model, eager = _mlp(), _mlp()
    same = optimize(model, candidates=["eager", "inductor"], warmup_steps=2, timing_steps=3,
                    cache=tmp_path / "choices.json", log=logs.append)
    assert same is model and list(model.state_dict()) == list(eager.state_dict())  # the one-line change
    losses = _loop(model, 14)  # 2 x (2 + 3) trial steps, then the choice
    report = model.gallery_optimize
    assert report.choice in ("eager", "inductor") and report.trial_steps == 10 and not report.cached
    assert [r.name for r in report.candidates] == ["eager", "inductor"]
    for r in report.candidates:
        assert r.ok and r.steady_ms > 0 and r.compile_time_s >= 0 and r.p20_ms <= r.steady_ms <= r.p80_ms
    assert report.candidates[1].compile_time_s > report.candidates[0].compile_time_s  # compiling, apart from speed
    assert any(line.startswith("optimize: chose") and report.reason in line for line in logs)
    # every step, trials included, is a training step of the same function
    torch.testing.assert_close(losses, _loop(eager, 14), rtol=1e-5, atol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the next run of the same model and shapes starts with the cached choice, no trials
    again = optimize(_mlp(), candidates=["eager", "inductor"], cache=tmp_path / "choices.json", log=logs.append)
    _loop(again, 2)
    assert again.gallery_optimize.cached and again.gallery_optimize.choice == report.choice
    assert again.gallery_optimize.trial_steps == 0 and "cached in" in logs[-1]


def test_the_choices_go_to_the_gallery_cache_dir_where_set_else_the_users_cache(monkeypatch, tmp_path):
    from gallery_lib.accel.optimize import default_cache_file

    assert default_cache_file() == Path(os.environ["GALLERY_CACHE_DIR"]) / "optimize.json"  # the test run's own
    assert Path.home() / ".cache" not in default_cache_file().parents
    monkeypatch.delenv("GALLERY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_file() == tmp_path / "gallery_lib" / "optimize.json"


def test_a_failing_candidate_is_skipped_with_its_reason_and_the_step_still_trains(tmp_path):
    logs = []
    model, eager = _mlp(), _mlp()
    optimize(model, candidates=[Candidate("bad-backend", {"backend": "no_such_backend"}), "eager"],
             warmup_steps=1, timing_steps=2, cache=False, log=logs.append)
    losses = _loop(model, 6)
    report = model.gallery_optimize
    assert report.choice == "eager" and "failed: bad-backend" in report.reason
    assert [r.ok for r in report.candidates] == [False, True] and "no_such_backend" in report.candidates[0].error
    assert any("bad-backend failed" in line and "runs eagerly" in line for line in logs)
    torch.testing.assert_close(losses, _loop(eager, 6), rtol=1e-6, atol=1e-6)


def test_on_a_cpu_each_candidate_is_timed_over_fewer_steps_than_on_a_gpu():
    """The default timing: 4 steps per candidate on a CPU (they pick what to keep; no speedup is quoted there), 10
    on a GPU; an explicit count wins."""
    from gallery_lib.accel.keep_if_faster import SteadyStepTimer
    from gallery_lib.accel.optimize import default_timing_steps

    assert (default_timing_steps(on_cuda=False), default_timing_steps(on_cuda=True)) == (4, 10)
    model = optimize(_mlp(), candidates=["eager", "eager"], warmup_steps=1, cache=False, log=lambda s: None)
    _loop(model, 12)
    assert model.gallery_optimize.trial_steps == 2 * (1 + 4)
    model = optimize(_mlp(), candidates=["eager"], warmup_steps=1, timing_steps=6, cache=False, log=lambda s: None)
    _loop(model, 9)
    assert model.gallery_optimize.trial_steps == 1 + 6
    calls = []
    SteadyStepTimer(warmup_steps=2)(lambda: calls.append(1), torch.device("cpu"))
    assert len(calls) == 2 + 4


def test_every_candidate_failing_ends_in_eager():
    model = optimize(_mlp(), candidates=[Candidate("bad", {"backend": "no_such_backend"})], warmup_steps=1,
                     timing_steps=2, cache=False, log=lambda s: None)
    _loop(model, 3)
    assert model.gallery_optimize.choice == "eager" and "every candidate failed" in model.gallery_optimize.reason


def test_conv_models_try_channels_last_and_compile_in_the_faster_layout(monkeypatch):
    """The default plan: eager in both layouts, then the compiled candidates in the faster one (aot_eager stands
    in for Inductor here); evaluation calls during the trials run eagerly and are not counted."""
    monkeypatch.setattr("gallery_lib.accel.optimize.COMPILED", ("aot_eager",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimize(model, warmup_steps=1, timing_steps=2, cache=False, log=lambda s: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10):
        if step == 2:
            with torch.no_grad():
                model(torch.randn(2, 3, 9, 9))  # an evaluation in the middle of the trials
        opt.zero_grad()
        model(torch.randn(4, 3, 9, 9)).square().mean().backward()
        opt.step()
    report = model.gallery_optimize
    names = [r.name for r in report.candidates]
    assert names[:2] == ["eager", "eager+channels_last"] and report.trial_steps == 9
    faster_layout = min(report.candidates[:2], key=lambda r: r.steady_ms).name
    assert names[2] == ("aot_eager+channels_last" if faster_layout.endswith("channels_last") else "aot_eager")
    assert all(p.is_contiguous() for p in model.parameters())  # parameters keep their layout


def test_explicit_backend_and_bad_input():
    model = optimize(_mlp(), backend="aot_eager", log=lambda s: None)
    _loop(model, 2)
    assert model.gallery_optimize.choice == "aot_eager" and model.gallery_optimize.trial_steps == 0
    with pytest.raises(TypeError, match="takes the nn.Module"):
        optimize(lambda x: x)
    with pytest.raises(ValueError, match="unknown backend 'turbo'"):
        optimize(_mlp(), backend="turbo")
    with pytest.raises(ValueError, match="already compiled"):
        optimize(model)
    with pytest.raises(ValueError, match="pass block_types"):
        regional_compile(nn.Linear(2, 2))


def test_regional_compile_reuses_one_graph_for_identical_blocks():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = _mlp()
    x = torch.randn(4, 8)
    ref = model(x)
    names = regional_compile(model, block_types=(_Block,), backend="inductor")
    assert names == ["1", "2", "3"]
    out = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # three blocks, one compiled graph
    undo_regional_compile(model, names)
    assert all(model.get_submodule(n)._compiled_call_impl is None for n in names)


@pytest.mark.slow  # over 30 s on 2 cores: left out of the fast tier
@pytest.mark.isa
def test_regional_compile_tiny_swin_matches_eager_forward_and_backward():
    model = _tiny_swin()
    compiled = copy.deepcopy(model)
    names = regional_compile(compiled, backend="aot_eager")  # auto-detected SwinTransformerBlock
    assert names == ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"]
    assert compiled.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 3, 32, 32)
    for m in (model, compiled):
        m(x).square().mean().backward()
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(compiled.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_optimize_is_the_public_one_line_hook():
    import gallery_lib

    assert gallery_lib.optimize is optimize and "optimize" in gallery_lib.__all__


def test_coordinate_descent_tuning_reaches_inductor_with_the_mode_and_trains_like_eager():
    """torch.compile takes a mode or options: the switch turns the mode into its options plus the tuning, and
    Inductor compiles with it set (seen from inside a compile pass)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from gallery_lib.accel.accelerate import compile_kwargs
    from gallery_lib.config import RunConfig

    cfg = RunConfig(model="swin_micro", compile=True)
    assert compile_kwargs(cfg.sections.compile) == {"mode": None}
    assert compile_kwargs(cfg.replace(compile_mode="reduce-overhead").sections.compile) == {"mode": "reduce-overhead"}
    tuned = cfg.replace(coordinate_descent_tuning=True)
    assert compile_kwargs(tuned.replace(compile_mode="reduce-overhead").sections.compile) == {
        "options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}}
    kwargs = compile_kwargs(tuned.sections.compile)
    assert kwargs == {"options": {"coordinate_descent_tuning": True}}

    seen = []

    class Spy(CustomGraphPass):
        def __call__(self, graph):
            seen.append(torch._inductor.config.coordinate_descent_tuning)

        def uuid(self):
            return None  # not cacheable: every compile runs the pass

    torch._dynamo.reset()
    model, eager = _mlp(), _mlp()
    compiled = torch.compile(model, options={**kwargs["options"], "post_grad_custom_post_pass": Spy()})
    torch.testing.assert_close(_loop(compiled, 4), _loop(eager, 4), rtol=1e-5, atol=1e-5)
    assert seen and all(seen)  # forward and backward graphs compiled with the tuning on


def test_compile_mode_auto_reaches_torch_compile_and_the_log_as_the_mode_it_resolves_to():
    """``auto`` is the recipes' intent: the run compiles with, and its log line names, the mode it resolves to for
    its step; ``compile_kwargs`` refuses the intent unresolved."""
    from gallery_lib.accel.accelerate import apply_accelerations, compile_kwargs
    from gallery_lib.accel.distributed import DistInfo
    from gallery_lib.accel.precision import Precision
    from gallery_lib.config import RunConfig

    cfg = RunConfig(model="swin_micro", device="cpu", compile=True, compile_mode="auto", gradient_accumulation_steps=2)
    assert compile_kwargs(cfg.sections.compile, cfg.resolved_compile_mode) == {"mode": None}  # accumulated: no graphs
    replayed = cfg.replace(gradient_accumulation_steps=1)
    assert compile_kwargs(replayed.sections.compile, replayed.resolved_compile_mode) == {"mode": "reduce-overhead"}
    with pytest.raises(ValueError, match="compile_mode='auto' is resolved for the run's step"):
        compile_kwargs(cfg.sections.compile)
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    notes = apply_accelerations(torch.nn.Linear(4, 4), cfg, Precision.from_settings(cfg.sections.precision, "cpu"),
                                cpu).notes
    assert "torch.compile(mode='default'); compilation happens in the first warm-up steps" in notes


def test_tiled_reductions_reach_inductor_beside_the_mode_and_the_tuning():
    from gallery_lib.accel.accelerate import compile_kwargs
    from gallery_lib.config import RunConfig

    cfg = RunConfig(model="swin_micro", compile=True, tiled_reductions=True)
    tiling = {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True}
    assert compile_kwargs(cfg.sections.compile) == {"options": tiling}
    graphs_tuned = cfg.replace(compile_mode="reduce-overhead", coordinate_descent_tuning=True)
    assert compile_kwargs(graphs_tuned.sections.compile) == {
        "options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True, **tiling}}
    torch._dynamo.reset()
    model, eager = _mlp(), _mlp()  # Inductor takes the options, and the compiled model trains as the eager one
    torch.testing.assert_close(_loop(torch.compile(model, **compile_kwargs(cfg.sections.compile)), 4), _loop(eager, 4),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # over 10 s on 2 cores: left out of the fast tier
@pytest.mark.isa
def test_channels_last_graphs_lay_out_the_backward_graph_too_and_train_like_eager(monkeypatch):
    """Inductor's heuristic never lays out a backward graph (it counts forward convolutions only); the switch makes
    it do so, and the compiled channels_last convnet still trains as the eager one."""
    from torch._inductor.graph import GraphLowering

    from gallery_lib.accel.accelerate import compile_kwargs
    from gallery_lib.accel.compile.attention_layout import KeepAttentionLayout
    from gallery_lib.config import RunConfig

    cfg = RunConfig(model="swin_micro", compile=True, channels_last_graphs=True)
    assert compile_kwargs(cfg.sections.compile) == {"options": {"force_layout_optimization": True,
                                               "post_grad_custom_post_pass": KeepAttentionLayout()}}
    decided, decide = [], GraphLowering.decide_layout_opt

    def spy(gm, *, is_inference):
        decided.append(decide(gm, is_inference=is_inference))
        return decided[-1]

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(spy))

    def convnet():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 3))
        return net.to(memory_format=torch.channels_last)

    def train(model):
        opt, gen, losses = torch.optim.SGD(model.parameters(), lr=0.05), torch.Generator().manual_seed(1), []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 3, 10, 10, generator=gen).to(memory_format=torch.channels_last)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    eager = train(convnet())
    for options, backward_laid_out in (({}, False), (compile_kwargs(cfg.sections.compile)["options"], True)):
        torch._dynamo.reset()
        decided.clear()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            torch.testing.assert_close(train(torch.compile(convnet(), options=options)), eager, rtol=1e-4, atol=1e-5)
        assert len(decided) == 2 and decided[1] is backward_laid_out  # forward graph, then backward graph


@pytest.mark.parametrize("name", ["coordinate_descent_tuning", "tiled_reductions", "channels_last_graphs"])
def test_kernel_tuning_without_compile_is_refused(name):
    from gallery_lib.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=f"{name}=True changes the kernels .*: set compile=True too"):
        RunConfig(model="swin_micro", **{name: True})
