"""optimize() and regional_compile(): choice by timing, fallback with reasons, numerics equal to eager.

Inductor on this 2-core CPU compiles a tiny MLP in seconds but the tiny Swin in minutes, so the Swin
checks trace with ``aot_eager`` (Dynamo + AOTAutograd, no code generation) and inductor runs on the MLP.
"""

import copy

import pytest
import torch
from torch import nn

from gallery_lib.accel.compile import regional_compile, undo_regional_compile
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


def test_auto_picks_a_candidate_reports_times_and_matches_eager():
    logs = []
    model = _mlp()
    eager = copy.deepcopy(model)
    step, losses = _trainer(model)
    res = optimize(model, example_step=step, candidates=["eager", "inductor"], warmup_steps=2, timing_steps=3,
                   log=logs.append)
    assert res.choice in ("eager", "inductor") and res.steps_run == 10 and len(losses) == 10
    assert [r.name for r in res.candidates] == ["eager", "inductor"]
    for r in res.candidates:
        assert r.ok and r.steady_ms > 0 and r.compile_time_s >= 0 and r.p20_ms <= r.steady_ms <= r.p80_ms
    inductor = res.candidates[1]
    assert inductor.compile_time_s > res.candidates[0].compile_time_s  # compiling is reported, apart from speed
    assert any(line.startswith("optimize: chose") and res.choice in line for line in logs)
    assert res.reason in logs[-1]
    # the 10 steps trained with both candidates follow the same trajectory as 10 eager steps
    eager_step, eager_losses = _trainer(eager)
    for _ in range(10):
        eager_step(eager)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_failing_candidates_fall_back_with_the_reason():
    model = _mlp()
    step, _ = _trainer(model)

    def explode(target):
        def run(*args, **kwargs):
            raise RuntimeError("kernel exploded on purpose")
        return run

    cands = [Candidate("broken-at-run", wrap=explode), Candidate("bad-backend", {"backend": "no_such_backend"}),
             "eager"]
    with pytest.warns(UserWarning) as record:
        res = optimize(model, example_step=step, candidates=cands, warmup_steps=1, timing_steps=2, log=lambda s: None)
    messages = [str(w.message) for w in record]
    assert any("broken-at-run" in m and "kernel exploded on purpose" in m for m in messages)
    assert any("bad-backend" in m and "no_such_backend" in m for m in messages)
    assert res.choice == "eager" and "failed: broken-at-run, bad-backend" in res.reason
    assert [r.ok for r in res.candidates] == [False, False, True]


def test_all_candidates_failing_ends_in_eager():
    model = _mlp()
    step, _ = _trainer(model)
    with pytest.warns(UserWarning, match="every candidate failed"), pytest.warns(UserWarning, match="'bad' failed"):
        res = optimize(model, example_step=step, candidates=[Candidate("bad", {"backend": "no_such_backend"})],
                       log=lambda s: None)
    assert res.choice == "eager" and res.target is model and "no_such_backend" in res.reason


def test_step_function_input_and_explicit_backend():
    model = _mlp()
    step, losses = _trainer(model)
    res = optimize(lambda: step(model), backend="aot_eager", warmup_steps=1, timing_steps=2, log=lambda s: None)
    assert res.choice == "aot_eager" and res.steady_ms > 0 and len(losses) == 3
    res.target()  # the compiled step keeps training
    assert len(losses) == 4


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="pass example_step"):
        optimize(_mlp())
    with pytest.raises(ValueError, match="unknown backend 'turbo'"):
        optimize(_mlp(), backend="turbo")
    with pytest.raises(ValueError, match="regional=True needs the nn.Module"):
        optimize(lambda: None, regional=True)
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


def test_regional_optimize_keeps_only_the_winner_compiled():
    model = _mlp()
    step, _ = _trainer(model)
    cands = [Candidate("aot-a", {"backend": "aot_eager"}), Candidate("aot-b", {"backend": "aot_eager"})]
    res = optimize(model, example_step=step, candidates=cands, regional=True, block_types=(_Block,),
                   warmup_steps=1, timing_steps=2, log=lambda s: None)
    assert res.choice in ("aot-a", "aot-b") and res.regional_modules == ["1", "2", "3"]
    assert res.target is model
    assert all(model.get_submodule(n)._compiled_call_impl is not None for n in res.regional_modules)


def test_optimize_is_the_public_one_line_hook():
    import gallery_lib

    assert gallery_lib.optimize is optimize and "optimize" in gallery_lib.__all__
