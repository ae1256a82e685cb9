"""AdamW and the EMA in one pass (``AdamWWithEma``) against torch's fused AdamW followed by ``ModelEma``'s own update.

The one-pass kernel runs on CPU tensors under ``TRITON_INTERPRET=1`` (the ``triton`` cases, in a child process);
the ``fallback`` cases prove that without Triton the optimizer is torch's and the EMA averages in its own pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernel_testing import make_path_fixture, run_file_in_interpreter

from gallery_lib.accel.adamw_ema import AdamWWithEma, ema_in_pass
from gallery_lib.accel.clipping import clip_then_step
from gallery_lib.accel.ema import ModelEma
from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels.adamw_ema import torch_betas
from gallery_lib.config import RunConfig
from gallery_lib.run.metrics import read_metrics


@pytest.mark.slow  # over 20 s on 2 cores: left out of the fast tier
@pytest.mark.isa  # the reference, torch's CPU fused AdamW, takes other kernels on each instruction set
def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


path = make_path_fixture("_adamw_ema_blocks_kernel")


class _Net(nn.Module):
    """Rows of every kind: two whole 2048-element blocks and a tail (5000), whole blocks alone (4096), a tail alone,
    a channels_last convolution with whole blocks, a frozen weight and a buffer (copied, not averaged)."""

    def __init__(self):
        super().__init__()
        self.big = nn.Parameter(torch.randn(5000) * 0.1)
        self.exact = nn.Parameter(torch.randn(64, 64) * 0.1)
        self.lin = nn.Linear(7, 5)
        self.conv = nn.Conv2d(16, 32, 3).to(memory_format=torch.channels_last)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        image = x[:, :16 * 25].reshape(-1, 16, 5, 5).contiguous(memory_format=torch.channels_last)
        y = self.frozen(self.lin(x[:, :7])) + self.conv(image).mean() + (self.big[:7] @ x[:, :7].T).unsqueeze(1)
        self.seen += 1
        return y + self.exact.sum() * 1e-3


def _groups(model):  # decay on matrices, none on the rest, as the training loop's groups
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


def _train(one_pass: bool, steps: int = 4, max_norm: float | None = 0.5, flagged_step: int | None = 2,
           ratio_warmup: bool = False, device: str = "cpu"):
    """``steps`` steps of AdamW (clipped in its pass; one step flagged as non-finite) with an EMA of decay 0.9: the
    first update copies (weight 1, one lerp formula), the later ones average at weight 0.1 (the other)."""
    torch.manual_seed(0)
    model = _Net().to(device)
    cls = AdamWWithEma if one_pass else torch.optim.AdamW
    optimizer = cls(_groups(model), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, fused=True)
    ema = ModelEma(model, decay=0.9, ratio_warmup=ratio_warmup, mode="foreach")
    if one_pass:
        optimizer.attach_ema(ema, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    averaged = []
    for step in range(steps):
        x = torch.randn(6, 400, device=device)
        model(x).pow(2).mean().backward()
        optimizer.found_inf = torch.tensor(1.0 if step == flagged_step else 0.0, device=device)
        clip_then_step(optimizer, [p for p in model.parameters() if p.grad is not None], max_norm)
        del optimizer.found_inf
        averaged.append(getattr(optimizer, "averaged_update", None))
        ema.update(model)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, ema, averaged


def _assert_near(ours, reference, relative: float, name: str) -> None:
    """Agreement to rounding, measured against the tensor's largest value: torch's kernel computes some terms in
    double that the one-pass kernel computes in fp32, and the last-bit differences feed the next step's gradients."""
    difference = (ours - reference).abs().max().item()
    assert difference <= relative * reference.abs().max().item() + 1e-12, f"{name}: differs by {difference:.3g}"


def _assert_same_training(a, b):
    (model_a, opt_a, ema_a, _), (model_b, opt_b, ema_b, _) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        _assert_near(p, q, 1e-6, name)
        state_a, state_b = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert state_a.keys() == state_b.keys(), name
        if state_a:
            assert state_a["step"].item() == state_b["step"].item(), name
            _assert_near(state_a["exp_avg"], state_b["exp_avg"], 2e-6, f"{name}.exp_avg")
            _assert_near(state_a["exp_avg_sq"], state_b["exp_avg_sq"], 2e-6, f"{name}.exp_avg_sq")
    assert ema_a.step == ema_b.step
    for (name, e), f in zip(ema_a.module.state_dict().items(), ema_b.module.state_dict().values()):
        _assert_near(e, f, 1e-6, f"ema {name}")


@pytest.mark.isa
def test_triton_one_pass_trains_as_fused_adamw_then_the_ema(path):
    """Weights, both moments, step counts (a flagged step not counted), the EMA and its copied buffer, over 4 steps
    with the clip factor folded in, two groups and a changing learning rate."""
    reference = _train(one_pass=False)
    ours = _train(one_pass=True)
    _assert_same_training(ours, reference)
    assert ours[1].state[ours[0].big]["step"].item() == 3  # 4 steps, one flagged
    assert ours[3] == ([1, 2, 3, 4] if path == "triton" else [None] * 4)
    assert not torch.equal(ours[0].big, _Net().big) and ours[2].module.seen.item() == 4


def test_triton_one_pass_with_diffusers_warmup_and_no_clipping(path):
    """The ratio warm-up's weights (0.82, 0.75, ...) and no grad_scale, no flagged step."""
    _assert_same_training(_train(True, steps=3, max_norm=None, flagged_step=None, ratio_warmup=True),
                          _train(False, steps=3, max_norm=None, flagged_step=None, ratio_warmup=True))


def test_triton_a_parameter_the_ema_does_not_average_takes_torchs_step():
    """A parameter made trainable after the EMA was built: the kernel cannot take the step, so it is torch's and
    the EMA averages in its own pass (the update count still advances once)."""
    torch.manual_seed(0)
    model = _Net()
    model.frozen.weight.requires_grad_(False)
    ema = ModelEma(model, decay=0.9, mode="foreach")
    model.frozen.weight.requires_grad_(True)
    optimizer = AdamWWithEma(model.parameters(), lr=1e-2)
    optimizer.attach_ema(ema, model)
    model(torch.randn(6, 400)).pow(2).mean().backward()
    optimizer.step()
    ema.update(model)
    assert optimizer.averaged_update is None and ema.step == 1
    torch.testing.assert_close(ema.module.big, model.big, rtol=0, atol=0)  # the first update copies


def test_triton_the_tables_let_each_steps_gradients_go_and_follow_the_next(path):
    """The cached tables hold no gradient (the loop frees them after each step; holding them kept 3 GiB and made
    every step rebuild its tables) and follow gradients that come back at new addresses."""
    import gc
    import weakref

    torch.manual_seed(0)
    models = [_Net(), _Net()]
    models[1].load_state_dict(models[0].state_dict())
    ours = AdamWWithEma(models[0].parameters(), lr=1e-2, weight_decay=0.05)
    ema = ModelEma(models[0], decay=0.9, mode="foreach")
    ours.attach_ema(ema, models[0])
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    held = []
    for step in range(3):
        grads = [torch.randn_like(p) for p in models[0].parameters() if p.requires_grad]
        held.append([torch.empty_like(g) for g in grads])  # the next step's gradients land elsewhere
        for model in models:
            for p, g in zip((p for p in model.parameters() if p.requires_grad), grads):
                p.grad = g.clone()
        gone = weakref.ref(models[0].big.grad)
        ours.step()
        plain.step()
        ema.update(models[0])
        for optimizer in (ours, plain):
            optimizer.zero_grad(set_to_none=True)
        gc.collect()
        assert gone() is None, "the optimizer kept a gradient alive"
    assert ours.averaged_update == (3 if path == "triton" else None)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        _assert_near(a, b, 1e-6, name)


def test_state_dict_loads_into_torch_adamw_and_training_goes_on_the_same(tmp_path):
    """A checkpoint of one loads into the other: the same state keys, and torch's AdamW continues from it as the
    one-pass optimizer does."""
    model, optimizer, ema, _ = _train(one_pass=True, steps=2)
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    plain = torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
    plain.load_state_dict(torch.load(tmp_path / "opt.pt"))
    again = AdamWWithEma(_groups(model), lr=1e-2)
    again.load_state_dict(plain.state_dict())
    assert again.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    for key in ("step", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(plain.state[model.big][key], optimizer.state[model.big][key])


def test_the_betas_are_rounded_as_torchs_kernel_on_the_device_rounds_them():
    """On a GPU torch's fused AdamW takes 1 - beta from an fp32 beta: 1 - 0.999 is 1.287e-5 smaller there, and every
    second moment with it (the GPU test below fails at 1.3e-5 without this)."""
    assert torch_betas((0.9, 0.999), torch.device("cpu")) == (0.9, 0.999)
    on_gpu = torch_betas((0.9, 0.999), torch.device("cuda"))
    assert on_gpu[1] == torch.tensor(0.999, dtype=torch.float32).item() != 0.999
    assert (1 - on_gpu[1]) / (1 - 0.999) == pytest.approx(1 - 1.287e-5, abs=1e-8)


def test_fused_false_is_a_clear_error():
    with pytest.raises(ValueError, match="fused AdamW"):
        AdamWWithEma(_Net().parameters(), fused=False)


@pytest.mark.parametrize("change, expected", [
    ({}, True), ({"ema": "off"}, False), ({"ema_in_optimizer": False}, False), ({"optimizer": "sgd"}, False),
    ({"fused_optimizer": False}, False), ({"amp_level": "O2"}, False), ({"amp_dtype": "float16"}, False),
])
def test_the_rule_of_which_runs_average_in_the_pass(change, expected):
    cfg = RunConfig(**{"model": "swin_micro", "device": "cpu", "ema": "fused", "ema_in_optimizer": True,
                       "fused_optimizer": True, **change})
    dtype = torch.float16 if cfg.amp_dtype == "float16" else torch.bfloat16
    sections = cfg.sections
    assert ema_in_pass(sections.ema, sections.optimizer, sections.precision, data_parallel=cfg.data_parallel,
                       amp_dtype=dtype) is expected


def test_triton_training_loop_with_the_ema_in_the_pass(smoke_data, tmp_path, monkeypatch, path):
    """The loop, fp32 with clipping folded in: the same per-step losses and EMA as the EMA in its own pass, and the
    one-pass optimizer ran (its kernel on the Triton path)."""
    import gallery_lib.run.train as train

    emas = []
    real_build_ema = train.build_ema
    monkeypatch.setattr(train, "build_ema", lambda *a, **k: emas.append(real_build_ema(*a, **k)) or emas[-1])
    common = dict(model="swin_micro", data_dir=str(smoke_data), image_size=64, batch_size=4, steps=4, warmup_steps=1,
                  log_every=4, lr=1e-3, lr_warmup_steps=1, num_workers=0, device="cpu", amp_level="O0",
                  fused_optimizer=True, clip_grad=0.05, clip_in_optimizer=True, ema="foreach", ema_decay=0.9)
    apart = RunConfig(output_dir=str(tmp_path / "a"), **common)
    in_pass = RunConfig(output_dir=str(tmp_path / "b"), ema_in_optimizer=True, **common)
    train.run(apart)
    tu.launch_counts.clear()
    train.run(in_pass)
    (ema_apart, _), (ema_in, note) = emas
    assert "in the fused AdamW's pass" in note and ema_in.step == ema_apart.step == 4
    assert (tu.launch_counts["_adamw_ema_blocks_kernel"] > 0) == (path == "triton")
    a, b = ([s["loss"] for s in read_metrics(c.run_dir / "metrics.jsonl")[0]] for c in (apart, in_pass))
    assert b == pytest.approx(a, rel=1e-5) and len(a) == 4
    for name, tensor in ema_apart.module.state_dict().items():
        _assert_near(ema_in.module.state_dict()[name].float(), tensor.float(), 1e-5, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
def test_gpu_one_pass_trains_as_fused_adamw_then_the_ema():
    """The compiled kernel (pipelined loop, aligned rows) against torch's CUDA fused AdamW then the EMA."""
    ours = _train(True, device="cuda")
    _assert_same_training(ours, _train(False, device="cuda"))
    assert ours[3] == [1, 2, 3, 4] and ours[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
