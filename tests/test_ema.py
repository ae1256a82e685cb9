"""ModelEma: every mode follows the per-tensor loop reference; skip, warm-up, swap and checkpoint behaviour."""

import warnings

import pytest
import torch
from torch import nn

from gallery_lib.accel.ema import MODES, ModelEma
from gallery_lib.accel.kernels import has_triton

CUDA = torch.cuda.is_available()


class _Net(nn.Module):
    """Covers what the EMA must handle: a frozen layer, a param without grad on some steps, an empty param,
    a float buffer and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 3).requires_grad_(False)
        self.sometimes = nn.Parameter(torch.randn(3))
        self.empty = nn.Parameter(torch.empty(0))
        self.big = nn.Parameter(torch.randn(4099) * 0.1)  # more than one 4096-element kernel block
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x, use_sometimes=True):
        y = self.frozen(self.lin(x)) + self.big.sum() + self.empty.sum()
        if use_sometimes:
            y = y + self.sometimes
        with torch.no_grad():
            self.running.lerp_(y.mean(0).to(self.running.dtype), 0.1)
            self.count += 1
        return y


def _train_with_emas(dtype, device, modes, steps=7, **ema_kw):
    torch.manual_seed(0)
    model = _Net().to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU fallback warnings are tested separately
        emas = {m: ModelEma(model, mode=m, **ema_kw) for m in modes}
    for e in emas.values():
        if e.effective_mode == "stream":
            e.attach_optimizer(opt)
    for step in range(steps):
        x = torch.randn(8, 5, device=device, dtype=dtype)
        opt.zero_grad(set_to_none=True)
        model(x, use_sometimes=step % 3 != 1).float().pow(2).mean().backward()
        opt.step()
        for e in emas.values():
            e.update(model)
    return model, emas


def _assert_state_close(a: dict, b: dict, dtype, factor=1):
    assert a.keys() == b.keys()
    for name in a:
        if dtype == torch.float32 or not a[name].is_floating_point():
            torch.testing.assert_close(a[name], b[name], msg=name)
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1.6e-2 * factor, atol=1e-5 * factor, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_mode_matches_loop_after_7_steps(dtype):
    model, emas = _train_with_emas(dtype, "cpu", MODES, decay=0.8, ratio_warmup=True)
    ref = emas["loop"].module.state_dict()
    # the average really moved away from the model (and from its start), so equality is not trivial
    assert not torch.allclose(ref["lin.weight"], model.lin.weight)
    for mode in MODES[1:]:
        _assert_state_close(emas[mode].module.state_dict(), ref, dtype, factor=1 if dtype == torch.float32 else 5)
    # copied tensors follow the model exactly
    assert torch.equal(ref["count"], model.count) and ref["count"].item() == 7
    assert torch.equal(ref["frozen.weight"], model.frozen.weight)
    assert torch.equal(ref["running"], model.running)


@pytest.mark.parametrize("mode", ["fused", "stream"])
def test_cpu_fallback_warns_once_and_says_so(mode):
    model = _Net()
    with pytest.warns(UserWarning, match="using 'foreach' instead") as record:
        ema = ModelEma(model, mode=mode)
    assert len([w for w in record if "foreach" in str(w.message)]) == 1
    assert ema.effective_mode == "foreach" and ema.mode == mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warnings on update
        ema.update(model)


@pytest.mark.skipif(not has_triton, reason="needs Triton")
def test_fused_tables_take_channels_last_pairs_and_leave_mixed_layouts_to_foreach():
    from gallery_lib.accel.kernels.ema_lerp import build_tables

    conv = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    pairs = {"channels_last both": (conv.clone(), conv),
             "contiguous both": (torch.randn(5, 7), torch.randn(5, 7)),
             "channels_last EMA, contiguous model": (conv.clone(), conv.contiguous()),
             "strided": (torch.randn(7, 5).t(), torch.randn(7, 5).t())}
    tables, rest_e, _ = build_tables([e for e, _ in pairs.values()], [m for _, m in pairs.values()])
    fused = [e for table in tables for e, _ in table["tensors"]]
    assert [e is pairs["channels_last both"][0] for e in fused].count(True) == 1
    assert len(fused) == 2 and len(rest_e) == 2  # the kernel reads flat memory: one layout for both, dense
    assert any(e is pairs["channels_last EMA, contiguous model"][0] for e in rest_e)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        ModelEma(_Net(), mode="turbo")
    with pytest.raises(ValueError, match="0 <= decay <= 1"):
        ModelEma(_Net(), decay=1.5)
    with pytest.raises(ValueError, match="keys 'module' and 'step'"):
        ModelEma(_Net()).load_state_dict({"lin.weight": torch.zeros(7, 5)})


def test_first_update_copies_then_averages():
    model = _Net()
    ema = ModelEma(model, decay=0.5)
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    ema.update(model)  # step 1: decay 0 -> copy
    assert torch.equal(ema.module.lin.weight, model.lin.weight)
    before = ema.module.lin.weight.clone()
    with torch.no_grad():
        model.lin.weight.add_(2.0)
    ema.update(model)  # step 2: decay 0.5
    torch.testing.assert_close(ema.module.lin.weight, 0.5 * before + 0.5 * model.lin.weight)


def test_warmup_decay_values():
    """diffusers' EMAModel ramp: (1 + step) / (10 + step) after the copy step, capped at decay."""
    ema = ModelEma(_Net(), decay=0.9999, ratio_warmup=True)
    assert ema.get_decay(None) == 0.9999
    assert ema.get_decay(0) == ema.get_decay(1) == 0.0
    decays = [ema.get_decay(s) for s in range(2, 2000, 37)]
    assert all(0 < a < b for a, b in zip(decays, decays[1:]))  # increasing ramp
    assert ema.get_decay(81) == pytest.approx(0.9) and ema.get_decay(891) == pytest.approx(0.99)
    assert ema.get_decay(10**9) == 0.9999  # capped at decay
    assert ModelEma(_Net(), decay=0.9).get_decay(2) == 0.9  # no warm-up: constant after the copy step


def test_skipped_step_changes_nothing():
    model, emas = _train_with_emas(torch.float32, "cpu", ["foreach"], steps=3, decay=0.9)
    ema = emas["foreach"]
    before, step = {k: v.clone() for k, v in ema.module.state_dict().items()}, ema.step
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    ema.update(model, skipped=True)
    assert ema.step == step
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_update_from_scaler_skips_when_grads_overflow():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ema = ModelEma(model, decay=0.5)
    ema.update(model)
    before = ema.module.weight.clone()

    def step(poison):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scale_before = scaler.get_scale()
        scaler.update()
        return ema.update_from_scaler(model, scaler, scale_before)

    assert step(poison=True) is False
    assert ema.step == 1 and torch.equal(ema.module.weight, before)
    assert step(poison=False) is True
    assert ema.step == 2 and not torch.equal(ema.module.weight, before)


def test_swap_puts_ema_in_and_restores_exactly():
    model, emas = _train_with_emas(torch.float32, "cpu", ["foreach"], steps=4, decay=0.7)
    ema = emas["foreach"]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swap(model) as swapped:
        assert swapped is model
        for k, v in ema.module.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
        assert not torch.equal(model.lin.weight, original["lin.weight"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k]), k
    with pytest.raises(RuntimeError, match="boom"):  # restored on errors too
        with ema.swap(model):
            raise RuntimeError("boom")
    assert torch.equal(model.lin.weight, original["lin.weight"])


def test_state_dict_round_trip():
    _, emas = _train_with_emas(torch.float32, "cpu", ["foreach"], steps=5, decay=0.7)
    saved = emas["foreach"].state_dict()
    fresh = ModelEma(_Net(), decay=0.7)
    fresh.load_state_dict(saved)
    assert fresh.step == 5
    for k, v in saved["module"].items():
        assert torch.equal(fresh.module.state_dict()[k], v), k


def test_ema_of_compiled_wrapper_uses_the_inner_model():
    model = _Net()
    ema = ModelEma(model, decay=0.5)

    class Wrapper(nn.Module):  # stands for torch.compile's OptimizedModule
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    ema.update(Wrapper(model))
    assert torch.equal(ema.module.lin.weight, model.lin.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_every_mode_matches_loop(dtype):
    _, emas = _train_with_emas(dtype, "cuda", MODES, decay=0.8, ratio_warmup=True)
    assert emas["fused"].effective_mode == "fused" and emas["stream"].effective_mode == "stream"
    ref = emas["loop"].state_dict()["module"]
    for mode in MODES[1:]:
        _assert_state_close(emas[mode].state_dict()["module"], ref, dtype, factor=1 if dtype == torch.float32 else 5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_stream_checkpoint_right_after_update_equals_sync_ema():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    sync = ModelEma(model, decay=0.9, mode="foreach")
    streamed = ModelEma(model, decay=0.9, mode="stream", stream_programs=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streamed.attach_optimizer(opt)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        opt.step()  # waits for the previous streamed update through the pre-hook
        sync.update(model)
        streamed.update(model)
    # no torch.cuda.synchronize(): state_dict must order itself after the side stream
    got, want = streamed.state_dict()["module"], sync.state_dict()["module"]
    for k in want:
        torch.testing.assert_close(got[k], want[k])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_fused_ema_of_channels_last_convs_matches_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 8, 1)).cuda()
    model = model.to(memory_format=torch.channels_last)
    emas = {mode: ModelEma(model, decay=0.8, mode=mode) for mode in MODES}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    emas["stream"].attach_optimizer(opt)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 3, 9, 9, device="cuda").to(memory_format=torch.channels_last)).square().mean().backward()
        opt.step()
        for ema in emas.values():
            ema.update(model)
    tables, rest_e, _ = emas["fused"]._tables[next(iter(emas["fused"]._tables))]
    assert not rest_e and sum(len(table["tensors"]) for table in tables) == 4  # conv weights and biases, fused
    ref = emas["loop"].state_dict()["module"]
    for mode in MODES[1:]:
        _assert_state_close(emas[mode].state_dict()["module"], ref, torch.float32)


def _offloaded_pair(device, steps=7):
    """One model trained ``steps`` steps with two foreach EMAs beside it: one on its device, one offloaded."""
    torch.manual_seed(0)
    model = _Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    on_device = ModelEma(model, decay=0.8, ratio_warmup=True, mode="foreach")
    offloaded = ModelEma(model, decay=0.8, ratio_warmup=True, mode="foreach", offload=True)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 5, device=device), use_sometimes=step % 3 != 1).pow(2).mean().backward()
        opt.step()
        on_device.update(model)
        offloaded.update(model)
    return model, on_device, offloaded


def test_an_offloaded_ema_averages_as_the_one_on_the_device():
    model, on_device, offloaded = _offloaded_pair("cpu")
    want, got = on_device.state_dict(), offloaded.state_dict()
    assert got["step"] == want["step"] == 7
    for name, tensor in want["module"].items():
        assert torch.equal(got["module"][name], tensor), name  # the same ops on the same values
    assert all(t.device.type == "cpu" for t in offloaded.module.state_dict().values())
    with offloaded.swap(model):
        assert torch.equal(model.lin.weight, want["module"]["lin.weight"])
    fresh = ModelEma(_Net(), decay=0.8, offload=True)
    fresh.load_state_dict(got)
    assert fresh.step == 7 and torch.equal(fresh.module.big, want["module"]["big"])
    with pytest.warns(UserWarning, match="but the EMA lives on cpu"):  # on a GPU: stream (test_ema_offload.py)
        assert ModelEma(model, mode="fused", offload=True).effective_mode == "foreach"
    with pytest.raises(ValueError, match="offload keeps a whole copy in the CPU's memory, and a template"):
        ModelEma(model, offload=True, template=model)


def test_the_ema_is_offloaded_where_the_config_asks_and_says_so():
    from gallery_lib.accel.adamw_ema import ema_in_pass
    from gallery_lib.accel.on_any_model import add_ema
    from gallery_lib.config import ConfigError, RunConfig

    ema = add_ema(_Net(), mode="stream", offload=True, echo=None)
    assert ema.offloaded and ema.effective_mode == "foreach"
    assert "foreach update (stream asked, but the EMA lives on cpu)" in ema.change.what
    assert "its weights kept in the CPU's memory between updates" in ema.change.what
    cfg = RunConfig(model="swin_micro", ema="foreach", ema_offload=True, ema_in_optimizer=True, fused_optimizer=True)
    def in_pass(run: RunConfig) -> bool:
        return ema_in_pass(run.sections.ema, run.sections.optimizer, run.sections.precision,
                           data_parallel=run.data_parallel, amp_dtype=torch.bfloat16)

    assert not in_pass(cfg) and in_pass(cfg.replace(ema_offload=False))
    with pytest.raises(ConfigError, match="ema_offload=True keeps the EMA in the CPU's memory, but ema='off'"):
        RunConfig(model="swin_micro", ema_offload=True)
    with pytest.raises(ConfigError, match="ema_offload=True is invalid with data_parallel='zero2'"):
        RunConfig(model="swin_micro", ema="foreach", ema_offload=True, data_parallel="zero2")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_an_offloaded_ema_frees_its_gpu_memory_and_averages_alike():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    before = torch.cuda.memory_allocated()
    offloaded = ModelEma(model, decay=0.9, mode="foreach", offload=True)
    assert torch.cuda.memory_allocated() == before  # no copy of the weights stays on the GPU
    assert all(t.is_pinned() for t in offloaded.module.state_dict().values())
    _, on_device, offloaded = _offloaded_pair("cuda")
    # no torch.cuda.synchronize(): reading the offloaded EMA waits for its copies back
    want, got = on_device.state_dict()["module"], offloaded.state_dict()["module"]
    for name, tensor in want.items():
        assert torch.equal(got[name].cuda(), tensor), name
