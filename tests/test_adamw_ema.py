"""AdamWWithEma + ModelEma(mode="optimizer") against torch's fused AdamW followed by a per-tensor EMA loop.

The kernel runs on CPU tensors in the ``TRITON_INTERPRET=1`` child (tests named ``triton``); the other cases check the
paths that run torch's own AdamW step, the wiring in ``build_ema``, and the state the optimizer keeps.
"""

import warnings

import pytest
import torch
from torch import nn

from gallery_lib.accel.adamw_ema import AdamWWithEma
from gallery_lib.accel.ema import ModelEma
from gallery_lib.accel.kernels import _triton_utils as tu
from kernel_testing import INTERPRETER_ONLY, run_file_in_interpreter

CUDA = torch.cuda.is_available()


class _Net(nn.Module):
    """Odd sizes, a channels_last convolution, a weight over two kernel blocks, a frozen layer, a parameter that has
    no gradient on some steps, an empty parameter and a buffer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.lin = nn.Linear(45, 37)
        self.big = nn.Parameter(torch.randn(4099) * 0.1)
        self.frozen = nn.Linear(37, 3).requires_grad_(False)
        self.sometimes = nn.Parameter(torch.randn(3))
        self.empty = nn.Parameter(torch.empty(0))
        self.register_buffer("running", torch.zeros(3))

    def forward(self, x, use_sometimes=True):
        y = self.frozen(self.lin(self.conv(x).flatten(1))) + self.big.sum() * 1e-3 + self.empty.sum()
        if use_sometimes:
            y = y + self.sometimes
        with torch.no_grad():
            self.running.lerp_(y.mean(0), 0.1)
        return y


def _train(optimizer_cls, ema_mode, *, steps=6, device="cpu", skip_at=None, set_to_none=True):
    """Trains ``_Net`` with two parameter groups (weight decay on matrices only) and an EMA; returns everything."""
    torch.manual_seed(0)
    model = _Net().to(device)
    model.conv.to(memory_format=torch.channels_last)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    opt = optimizer_cls([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=3e-3, betas=(0.8, 0.95), eps=1e-6, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's warning
        ema = ModelEma(model, decay=0.9, ratio_warmup=True, mode=ema_mode)
    if ema.effective_mode == "optimizer":
        ema.fuse_into(opt, model)
    for step in range(steps):
        x = torch.randn(4, 3, 5, 5, device=device).to(memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=set_to_none)
        model(x, use_sometimes=step % 3 != 1).pow(2).mean().backward()
        if step == skip_at:  # the non-finite guard's flag: the fused optimizers skip their update
            opt.found_inf = torch.ones((), device=device)
        opt.step()
        opt.__dict__.pop("found_inf", None)
        ema.update(model)
        for group in opt.param_groups:
            group["lr"] *= 0.9  # a schedule: every step a new learning rate
    return model, opt, ema


def _assert_same_training(ours, reference, *, exact_state=False):
    (model, opt, ema), (ref_model, ref_opt, ref_ema) = ours, reference
    tol = dict(rtol=0, atol=0) if exact_state else dict(rtol=2e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=name)
        assert p.stride() == q.stride(), name
        state, ref_state = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert state.keys() == ref_state.keys(), name
        for key in state:
            torch.testing.assert_close(state[key], ref_state[key], **tol, msg=f"{name} {key}")
    assert ema.step == ref_ema.step
    for (name, e), r in zip(ema.module.state_dict().items(), ref_ema.module.state_dict().values()):
        torch.testing.assert_close(e, r, **tol, msg=f"EMA {name}")


def test_interpreter_subprocess():
    run_file_in_interpreter(__file__)


@pytest.fixture
def interpreter():
    if not tu.interpreter_ready():
        pytest.skip(INTERPRETER_ONLY)


def test_triton_kernel_matches_fused_adamw_then_ema_loop(interpreter):
    ours = _train(AdamWWithEma, "optimizer")
    assert ours[2].effective_mode == "optimizer" and ours[1].table_builds >= 1
    _assert_same_training(ours, _train(torch.optim.AdamW, "loop"))


def test_triton_skipped_step_leaves_weights_and_moments_but_moves_the_ema(interpreter):
    ours = _train(AdamWWithEma, "optimizer", steps=4, skip_at=2)
    reference = _train(torch.optim.AdamW, "loop", steps=4, skip_at=2)
    _assert_same_training(ours, reference)
    assert int(ours[1].state[ours[0].lin.weight]["step"]) == 3  # four steps, one skipped


def test_triton_tables_are_built_once_while_the_tensors_stay(interpreter):
    _, opt, _ = _train(AdamWWithEma, "optimizer", set_to_none=False)
    assert opt.table_builds == 1  # zeroed, not freed: every gradient keeps its address (and every parameter steps)


def test_triton_closure_or_grad_scale_run_torch_adamw_and_the_ema_averages_everything(interpreter):
    model, opt, ema = _train(AdamWWithEma, "optimizer", steps=2)
    before = {n: p.detach().clone() for n, p in ema.module.named_parameters()}
    opt.zero_grad()
    model(torch.randn(4, 3, 5, 5)).pow(2).mean().backward()
    builds = opt.table_builds
    opt.step(closure=lambda: None)
    ema.update(model)
    assert opt.table_builds == builds  # torch's own step ran
    weight = 1 - ema.get_decay(ema.step)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(ema.module.get_parameter(name), before[name].lerp(p, weight), msg=name)


def test_without_the_kernel_it_is_torch_fused_adamw_and_a_foreach_ema():
    """No interpreter on a CPU: the EMA falls back to ``foreach`` and the optimizer is torch's fused AdamW."""
    if tu.interpreter_ready():
        pytest.skip("this process runs the kernel")
    ours = _train(AdamWWithEma, "optimizer")
    assert ours[2].effective_mode == "foreach" and ours[1].table_builds == 0
    _assert_same_training(ours, _train(torch.optim.AdamW, "foreach"), exact_state=True)


def test_state_dict_is_torch_adamw_s():
    model = nn.Linear(3, 2)
    opt = AdamWWithEma(model.parameters(), lr=1e-2)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    plain.load_state_dict(opt.state_dict())
    assert plain.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="fused"):
        AdamWWithEma(model.parameters(), fused=False)


def test_fuse_into_needs_the_optimizer_mode_and_the_fused_adamw():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="mode 'optimizer'"):
        ModelEma(model, mode="foreach").fuse_into(AdamWWithEma(model.parameters()), model)


@pytest.mark.parametrize("optimizer, amp_level, why", [
    ("sgd", "O1", "needs the fused AdamW"),
    ("adamw", "O2", "fp32 master copies"),
])
def test_build_ema_says_why_it_cannot_fuse(optimizer, amp_level, why, monkeypatch):
    from gallery_lib.accel.precision import Precision
    from gallery_lib.profiles import base_config
    from gallery_lib.run import train

    monkeypatch.setattr("gallery_lib.accel.ema.ema_mode_on", lambda mode, device: (mode, None))  # as on a GPU
    cfg = base_config("smoke", model="swin_micro").replace(ema="optimizer", optimizer=optimizer, amp_level=amp_level,
                                                             fused_optimizer=True)
    model = nn.Linear(3, 2)
    optimizer_ = train.build_optimizer(model, cfg, Precision.from_config(cfg, "cpu"))
    ema, note = train.build_ema(model, cfg, optimizer_)
    assert ema.mode == "fused" and "optimizer asked" in note and why in note


def test_build_optimizer_fuses_with_an_adamw_run():
    from gallery_lib.accel.precision import Precision
    from gallery_lib.profiles import base_config
    from gallery_lib.run import train

    cfg = base_config("smoke", model="swin_micro").replace(ema="optimizer", optimizer="adamw", fused_optimizer=True)
    model = nn.Linear(3, 2)
    optimizer = train.build_optimizer(model, cfg, Precision.from_config(cfg, "cpu"))
    assert isinstance(optimizer, AdamWWithEma)
    assert type(train.build_optimizer(model, cfg.replace(ema="fused"), Precision.from_config(cfg, "cpu"))) \
        is torch.optim.AdamW


@pytest.mark.gpu
def test_gpu_matches_fused_adamw_then_ema_loop():
    ours = _train(AdamWWithEma, "optimizer", device="cuda", skip_at=3)
    assert ours[2].effective_mode == "optimizer"
    _assert_same_training(ours, _train(torch.optim.AdamW, "loop", device="cuda", skip_at=3))
