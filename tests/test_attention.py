"""Attention registry: constraints, auto selection (with a fake timer), CPU numerics of the hooks, reversibility."""

import json

import pytest
import torch

from gallery_lib.accel import attention as attention_module
from gallery_lib.accel.attention import backends as attention_backends
from gallery_lib.accel.attention import (BACKENDS, BackendSelector, attention, describe, hook_diffusers_attention,
                                   hook_swin_attention, rule_choice, select_backend)
from gallery_lib.accel.attention.gate import GateReport

H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
BF16 = torch.bfloat16
SD_SHAPES = [(8, 8, 4096, 40), (8, 8, 1024, 80), (8, 8, 256, 160), (8, 8, 64, 160)]


def _reference(q, k, v, bias=None, scale=None):
    scores = (q.double() @ k.double().transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    if bias is not None:
        scores = scores + bias.double()
    return (scores.softmax(-1) @ v.double()).to(q.dtype)


class _FakeTimer:
    """Made-up timings per (backend, head dim): each SD shape has a different winner, and `flash_attn3`
    claims to be fastest everywhere, so the constraints (not the timings) must keep it out when it does not apply."""

    table = {
        40: {"cudnn": 2.4, "flash": 4.0, "efficient": 8.9, "math": 29.8, "flash_attn": 3.1},
        80: {"cudnn": 1.1, "flash": 0.9, "efficient": 2.0, "math": 7.0, "flash_attn": 1.0},
        160: {"cudnn": 0.33, "flash": 0.26, "efficient": 0.76, "math": 0.99, "flash_attn": 0.3},
        304: {"efficient": 5.0, "math": 9.0},
    }

    def __init__(self):
        self.calls = []

    def __call__(self, backend, q_shape, kv_shape, dtype, device, has_bias):
        self.calls.append((backend.name, q_shape, has_bias))
        why = backend.why_not(q_shape, dtype, "cuda", has_bias, H100[1])
        assert why is None, f"the selector timed a backend that cannot run: {why}"
        if backend.name == "flash_attn3":
            return 0.01
        if backend.name == "cudnn" and q_shape[-1] == 80:
            raise RuntimeError("cuDNN refused this shape")
        return self.table[q_shape[-1]][backend.name]


class _PassingGate:
    """The correctness gate where the tests fake a GPU: nothing runs, every backend passes
    (tests/test_attention_gate.py checks the real gate on the CPU)."""

    def __init__(self, q_shape, kv_shape, dtype, device, has_bias):
        pass

    def check(self, backend):
        return GateReport(backend.name, {}, {})

    def summary(self):
        return {}


def _fake_selector(tmp_path=None, installed_all=True, monkeypatch=None):
    if installed_all and monkeypatch is not None:  # pretend FA2/FA3 are installed so their constraints matter
        import dataclasses
        for name in ("flash_attn", "flash_attn3"):
            monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], installed=True))
    path = tmp_path / "attn.json" if tmp_path else None
    return BackendSelector(cache_path=path, timer=_FakeTimer(), device_info=lambda d: H100, gate=_PassingGate)


def test_constraints_name_the_problem():
    flash = BACKENDS["flash"]
    assert flash.why_not((8, 8, 256, 160), BF16, "cuda", False, (9, 0)) is None
    assert "float32" in flash.why_not((8, 8, 256, 64), torch.float32, "cuda", False, (9, 0))
    assert "bias" in flash.why_not((8, 8, 256, 64), BF16, "cuda", True, (9, 0))
    assert "up to 256" in flash.why_not((8, 8, 256, 320), BF16, "cuda", False, (9, 0))
    assert "multiple of 8" in flash.why_not((8, 8, 256, 42), BF16, "cuda", False, (9, 0))
    assert "not cpu" in flash.why_not((8, 8, 256, 64), BF16, "cpu", False)
    assert "capability" in flash.why_not((8, 8, 256, 64), BF16, "cuda", False, (7, 5))
    fa3 = BACKENDS["flash_attn3"]
    assert "capability <=" in fa3.why_not((1, 1, 8, 64), BF16, "cuda", False, (10, 0)) or not fa3.installed
    math_ = BACKENDS["math"]
    for args in [((2, 3, 49, 13), torch.float32, "cpu", True), ((2, 3, 49, 999), torch.float64, "cuda", True)]:
        assert math_.why_not(*args, (7, 0)) is None
    assert BACKENDS["efficient"].supports_bias and not BACKENDS["cudnn"].supports_bias


def test_auto_picks_fastest_eligible_per_shape(monkeypatch):
    sel = _fake_selector(monkeypatch=monkeypatch)
    timer = sel.timer
    for shape in SD_SHAPES:
        for has_bias in (False, True):
            choice = sel.select(shape, BF16, "cuda", has_bias)
            eligible = {n for n, why in sel.eligible(shape, BF16, "cuda", has_bias).items() if why is None}
            table = {n: ms for n, ms in timer.table[shape[-1]].items() if n in eligible}
            if "flash_attn3" in eligible:
                table["flash_attn3"] = 0.01
            if shape[-1] == 80:
                table.pop("cudnn", None)  # the fake raises for it
            assert choice == min(table, key=table.get)
            assert BACKENDS[choice].why_not(shape, BF16, "cuda", has_bias, H100[1]) is None
            if has_bias:
                assert choice == "efficient"  # the fastest backend that accepts a bias in the table
    # FA3 (0.01 ms in the fake) wins wherever it applies: no bias, bf16, Hopper
    assert sel.select((8, 8, 4096, 40), BF16, "cuda", False) == "flash_attn3"
    assert sel.cache[next(iter(sel.cache))]["timings_ms"]["flash_attn3"] == 0.01
    # fp32 excludes every half-precision kernel; head dim 304 leaves efficient and math
    assert sel.select((2, 4, 128, 160), torch.float32, "cuda", False) in ("efficient", "math")
    assert sel.select((2, 4, 128, 304), BF16, "cuda", False) == "efficient"


def test_auto_without_optional_packages_and_failures_recorded(monkeypatch):
    import dataclasses
    for name in ("flash_attn", "flash_attn3"):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], installed=False))
    sel = _fake_selector()
    assert sel.select((8, 8, 4096, 40), BF16, "cuda", False) == "cudnn"
    assert sel.select((8, 8, 256, 160), BF16, "cuda", False) == "flash"
    assert sel.select((8, 8, 1024, 80), BF16, "cuda", False) == "flash"
    entry = [e for k, e in sel.cache.items() if "80)" in k.split("|")[0]][0]
    assert "cuDNN refused this shape" in entry["failed"]["cudnn"] and "cudnn" not in entry["timings_ms"]
    assert all(n not in c for c in sel.timer.calls for n in ("flash_attn", "flash_attn3"))


def test_cache_is_reused_and_persisted(tmp_path, monkeypatch):
    sel = _fake_selector(tmp_path, monkeypatch=monkeypatch)
    first = sel.select((8, 8, 256, 160), BF16, "cuda", False, kv_shape=(8, 8, 77, 160))
    n_calls = len(sel.timer.calls)
    assert sel.select((8, 8, 256, 160), BF16, "cuda", False, kv_shape=(8, 8, 77, 160)) == first
    assert len(sel.timer.calls) == n_calls  # cached: no new timing
    saved = json.loads((tmp_path / "attn.json").read_text())
    assert [e["backend"] for e in saved.values()] == [first]
    reloaded = BackendSelector(cache_path=tmp_path / "attn.json", timer=_FakeTimer(), device_info=lambda d: H100)
    assert reloaded.select((8, 8, 256, 160), BF16, "cuda", False, kv_shape=(8, 8, 77, 160)) == first
    assert reloaded.timer.calls == []
    other_gpu = BackendSelector(timer=_FakeTimer(), device_info=lambda d: ("NVIDIA A100", (8, 0)), gate=_PassingGate)
    other_gpu.select((8, 8, 256, 160), BF16, "cuda", False)
    assert other_gpu.timer.calls  # a different GPU name is a different key


def test_a_cached_choice_made_before_the_gate_is_measured_again(tmp_path):
    """A cache file written before the correctness gate holds choices nothing checked: they are chosen again."""
    key = "(8, 8, 256, 160)|(8, 8, 256, 160)|bfloat16|NVIDIA H100 80GB HBM3|bias=False"
    (tmp_path / "attn.json").write_text(json.dumps({key: {"backend": "cudnn", "timings_ms": {"cudnn": 0.3},
                                                          "failed": {}}}))
    sel = BackendSelector(cache_path=tmp_path / "attn.json", timer=_FakeTimer(), device_info=lambda d: H100,
                          gate=_PassingGate)
    assert sel.select((8, 8, 256, 160), BF16, "cuda", False) == "flash"  # the fake table's fastest at head dim 160
    assert sel.timer.calls and "gate" in json.loads((tmp_path / "attn.json").read_text())[key]


def test_cpu_rule_and_numerics():
    assert select_backend((2, 3, 10, 16), torch.float32, "cpu", True) == "math"
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    bias = torch.randn(2, 3, 10, 7)
    torch.testing.assert_close(attention(q, k, v), _reference(q, k, v))
    torch.testing.assert_close(attention(q, k, v, bias=bias, scale=0.3), _reference(q, k, v, bias, 0.3))
    keep = torch.rand(1, 1, 10, 7) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(attention(q, k, v, bias=keep), _reference(q, k, v, additive))


def test_explicit_backend_errors_name_the_fix():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="'flash' cannot run this call: flash runs on cuda, not cpu"):
        attention(q, q, q, backend="flash")
    with pytest.raises(ValueError, match="unknown backend 'xformers'"):
        attention(q, q, q, backend="xformers")


def test_describe_lists_backends_and_choices(monkeypatch):
    sel = _fake_selector(monkeypatch=monkeypatch)
    assert "nothing chosen yet" in describe(sel)
    sel.select((8, 8, 64, 160), BF16, "cuda", True)
    text = describe(sel)
    for name in BACKENDS:
        assert name in text
    assert "auto chose:" in text and "(8, 8, 64, 160)" in text and ": efficient" in text


def _tiny_unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8).eval()


def test_diffusers_hook_matches_and_reverts():
    unet = _tiny_unet()
    sample, text = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 24)
    ref = unet(sample, 3, encoder_hidden_states=text).sample
    before = {k: type(p).__name__ for k, p in unet.attn_processors.items()}
    keys = set(unet.state_dict())
    with hook_diffusers_attention(unet) as hook:
        assert len(hook.modules) == len(before) >= 2  # self- and cross-attention layers
        assert {type(p).__name__ for p in unet.attn_processors.values()} == {"GalleryAttnProcessor"}
        out = unet(sample, 3, encoder_hidden_states=text).sample
        assert set(unet.state_dict()) == keys
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert {k: type(p).__name__ for k, p in unet.attn_processors.items()} == before


def test_diffusers_processor_with_mask_group_norm_and_4d_input():
    attention_processor = pytest.importorskip("diffusers.models.attention_processor")  # a submodule loaded lazily
    from gallery_lib.accel.attention import GalleryAttnProcessor

    torch.manual_seed(0)
    attn = attention_processor.Attention(
        query_dim=16, heads=2, dim_head=8, norm_num_groups=4, residual_connection=True, rescale_output_factor=2.0)
    x = torch.randn(2, 16, 3, 3)  # 4-D input path, group norm, residual, rescale
    ref = attn(x)
    attn.set_processor(GalleryAttnProcessor())
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)
    cross = attention_processor.Attention(query_dim=16, cross_attention_dim=12, heads=2, dim_head=8)
    h, ctx, mask = torch.randn(2, 5, 16), torch.randn(2, 4, 12), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ref = cross(h, encoder_hidden_states=ctx, attention_mask=(1 - mask) * -10000.0)
    cross.set_processor(GalleryAttnProcessor())
    torch.testing.assert_close(cross(h, encoder_hidden_states=ctx, attention_mask=(1 - mask) * -10000.0), ref,
                               rtol=1e-5, atol=1e-5)


def _tiny_swin():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=4, window_size=4, embed_dim=24, depths=(2, 2), num_heads=(2, 4), num_classes=10,
    ).eval()  # eval: drop-path is random in train mode


def test_swin_hook_matches_forward_and_grads_and_reverts():
    model = _tiny_swin()
    x = torch.randn(2, 3, 32, 32)
    model(x).square().mean().backward()
    ref_out = model(x).detach()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad()
    shifted = [m for m in model.modules() if type(m).__name__ == "SwinTransformerBlock" and m.shift_size]
    assert shifted and any(getattr(m, "attn_mask", None) is not None for m in shifted)  # the mask path runs
    hook = hook_swin_attention(model)
    assert hook.modules == [f"layers.{i}.blocks.{j}.attn" for i in range(2) for j in range(2)]
    out = model(x)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    assert model.state_dict().keys() == keys.keys()
    hook.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(x), ref_out, rtol=0, atol=0)


@pytest.mark.isa
def test_on_a_cpu_the_hooked_swin_compiles_to_the_graphs_of_timms_own_attention():
    """Compiled on a CPU, where ``auto``'s rule is math, the hook leaves timm's attention in the graph: the accelerated
    recipe's graphs are the compiled recipe's node for node, and the compile caches serve both."""
    from compile_testing import aot_graphs

    plain = _tiny_swin()
    hooked = _tiny_swin()
    hooked.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with hook_swin_attention(hooked) as hook:
        plain_graphs, hooked_graphs = aot_graphs(plain, x), aot_graphs(hooked, x)
        assert hook.selector.chosen == {}  # the registry chose nothing: timm's attention ran
        hooked(x)  # eager, the registry still routes the call (its CPU rule)
        assert set(hook.selector.chosen.values()) == {"math (the CPU rule)"}
    assert len(hooked_graphs) == 2 and hooked_graphs == plain_graphs  # one forward, one backward


def test_swin_hook_refuses_backends_without_bias():
    with pytest.raises(ValueError, match="cannot take Swin's additive relative-position bias"):
        hook_swin_attention(_tiny_swin(), backend="flash")
    with pytest.raises(ValueError, match="no timm WindowAttention"):
        hook_swin_attention(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_eligible_backend_matches_math():
    torch.manual_seed(0)
    cap = torch.cuda.get_device_capability()
    for shape in [(2, 4, 256, 40), (2, 4, 64, 160), (2, 3, 49, 32)]:
        q, k, v = (torch.randn(shape, device="cuda", dtype=BF16) for _ in range(3))
        ref = _reference(q.float(), k.float(), v.float())
        for name, b in BACKENDS.items():
            if b.why_not(shape, BF16, "cuda", False, cap) is None:
                err = (attention(q, k, v, backend=name).float() - ref).abs().max().item()
                assert err < 2e-2, (name, shape, err)
        assert select_backend(shape, BF16, "cuda", False) in BACKENDS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(2, 3, 77, 40), (1, 5, 130, 80), (2, 2, 64, 160)])
def test_gpu_every_eligible_backend_computes_attention_and_its_gradients_in_bf16(shape):
    """Forward and the three input gradients of each backend that takes the (odd) shape, flash-attn's runners
    included where installed, against float64 math: at most 2x the error of PyTorch's own bf16 op, the
    ``scaled_dot_product_attention`` a plain model calls (not its math kernel: see RESULTS.md#flash-attn)."""
    torch.manual_seed(0)
    cap = torch.cuda.get_device_capability()
    q, k, v = (torch.randn(shape, device="cuda") for _ in range(3))
    grad_out = torch.randn(shape, device="cuda")

    def out_and_grads(run, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.backward(grad_out.to(dtype))
        return [t.double() for t in (out, *(leaf.grad for leaf in leaves))]

    exact = out_and_grads(_reference, torch.float64)
    errors = lambda got: [(g - e).abs().max().item() for g, e in zip(got, exact)]  # noqa: E731
    pytorch_own = errors(out_and_grads(torch.nn.functional.scaled_dot_product_attention, BF16))
    ran = []
    for name, backend in BACKENDS.items():
        if name == "flash_attn4" and shape[-1] % 32:
            continue  # its dq is known wrong there: test_attention_gate.py checks that the gate refuses it
        if backend.why_not(shape, BF16, "cuda", False, cap) is None:
            ran.append(name)
            got = errors(out_and_grads(lambda *qkv: attention(*qkv, backend=name), BF16))
            for what, err, limit in zip(("out", "dq", "dk", "dv"), got, pytorch_own):
                assert err <= 2 * limit + 1e-3, (name, shape, what, err, limit)
    assert "math" in ran and len(ran) >= 2


def test_rule_without_timing_follows_the_measured_table():
    """Where auto cannot time (compile tracing, graph capture): cuDNN first on Hopper without a bias, flash first
    before Hopper, efficient with a bias, math when nothing else applies."""
    def eligible(shape, has_bias, capability, dtype=BF16):
        return [b for b in BACKENDS.values() if b.why_not(shape, dtype, "cuda", has_bias, capability) is None]

    assert rule_choice(eligible((8, 8, 4096, 40), False, (9, 0)), (9, 0)) == "cudnn"
    assert rule_choice(eligible((8, 8, 4096, 40), False, (8, 0)), (8, 0)) == "flash"
    assert rule_choice(eligible((512, 12, 49, 32), True, (9, 0)), (9, 0)) == "efficient"
    assert rule_choice([BACKENDS["math"]], (9, 0)) == "math"


def test_selector_uses_the_rule_while_tracing_and_caches_nothing(monkeypatch):
    sel = _fake_selector()
    monkeypatch.setattr(attention_backends, "_cannot_benchmark", lambda: True)
    assert sel.select((8, 8, 4096, 40), BF16, "cuda", False) == "cudnn"
    assert sel.select((512, 12, 49, 32), BF16, "cuda", True) == "efficient"
    assert sel.timer.calls == [] and sel.cache == {}


def test_auto_traces_without_graph_breaks_once_the_device_is_known(monkeypatch):
    """Inside torch.compile the selector must not query CUDA (each query is a graph break): with the device info
    remembered, selecting for a CUDA shape is plain Python that Dynamo traces into one graph."""
    monkeypatch.setitem(attention_backends._DEVICE_INFO, 0, H100)

    def step(x):
        choice = select_backend((512, 12, 49, 32), BF16, torch.device("cuda", 0), True)
        return x * 2 if choice == "efficient" else x

    explained = torch._dynamo.explain(step)(torch.randn(3))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert torch.compile(step, backend="eager", fullgraph=True)(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.gpu
def test_gpu_hooked_swin_compiles_into_one_graph():
    """On a GPU the hooked window attention traces without graph breaks (fullgraph) and matches timm's own path."""
    from gallery_lib.families.swin import build_swin_micro

    torch.manual_seed(0)
    model = build_swin_micro(num_classes=10).cuda()
    reference = build_swin_micro(num_classes=10).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 64, 64, device="cuda")
    with hook_swin_attention(model, "auto"):
        torch._dynamo.reset()
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        out.float().sum().backward()
    torch.testing.assert_close(out, reference(x), atol=2e-4, rtol=2e-4)


def test_each_hook_records_its_own_choices_and_shares_measurements():
    """A hook's record says what its model ran, not what the process ran before; measurements stay shared."""
    from gallery_lib.accel.attention import default_selector
    from gallery_lib.families.swin import build_swin_micro

    select_backend((2, 3, 10, 16), torch.float32, "cpu", True)  # a choice made elsewhere in the process
    first, second = build_swin_micro(num_classes=10), build_swin_micro(num_classes=10, image_size=32)
    with hook_swin_attention(first) as hook_a, hook_swin_attention(second) as hook_b:
        first(torch.randn(1, 3, 64, 64))
        second(torch.randn(1, 3, 32, 32))
    assert set(hook_a.selector.chosen) == {"(16, 2, 16, 16)|(16, 2, 16, 16)|float32|CPU|bias=True",
                                           "(4, 4, 16, 16)|(4, 4, 16, 16)|float32|CPU|bias=True"}
    assert set(hook_b.selector.chosen) == {"(4, 2, 16, 16)|(4, 2, 16, 16)|float32|CPU|bias=True",
                                           "(1, 4, 16, 16)|(1, 4, 16, 16)|float32|CPU|bias=True"}
    assert hook_a.selector.cache is hook_b.selector.cache is default_selector().cache


class _AttendThenNormalize(torch.nn.Module):
    """Two kinds of SDPA call (one with a mask), dropout and BatchNorm: a probe must leave RNG and buffers alone."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        q = self.drop(x)
        a = torch.nn.functional.scaled_dot_product_attention(q, x, x)
        b = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], x, x, attn_mask=torch.ones(3, 5).bool())
        c = torch.nn.functional.scaled_dot_product_attention(q, x, x)  # a repeat: one record
        return self.norm((a + c).flatten(0, 1).flatten(1)[:, :8]).sum() + b.sum()


def test_record_sdpa_choices_names_what_pytorch_runs_and_changes_nothing():
    model = _AttendThenNormalize().train()
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    chosen = attention_module.record_sdpa_choices(model, lambda: model(x))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats))  # BatchNorm's statistics restored
    expected = attention_module.sdpa_choice(x, x, x)
    assert expected in BACKENDS  # PyTorch's pick in the registry's names (on a CPU: its flash kernel)
    assert chosen == {"(2, 3, 5, 8)|(2, 3, 5, 8)|float32|CPU|bias=False": f"{expected} (PyTorch's own SDPA choice)",
                      "(2, 3, 3, 8)|(2, 3, 5, 8)|float32|CPU|bias=True":
                          f"{attention_module.sdpa_choice(x[:, :, :3], x, x, torch.ones(3, 5).bool())} "
                          "(PyTorch's own SDPA choice)"}
    linear = torch.nn.Linear(8, 2)
    assert attention_module.record_sdpa_choices(linear, lambda: linear(x)) == {}  # no attention: nothing to say


def test_sdpa_choice_says_unknown_without_the_private_helper(monkeypatch):
    x = torch.randn(1, 1, 4, 8)
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    assert attention_module.sdpa_choice(x, x, x) == "unknown"


@pytest.mark.gpu
def test_gpu_sdpa_choice_is_a_registry_backend_for_sd_shapes():
    q = torch.randn(2, 8, 4096, 40, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 8, 77, 40, device="cuda", dtype=torch.bfloat16)
    assert attention_module.sdpa_choice(q, q, q) in ("cudnn", "flash", "efficient")
    assert attention_module.sdpa_choice(q, kv, kv) in ("cudnn", "flash", "efficient")


def test_a_failing_probe_is_reported_not_raised():
    """The run's probe is a report: a forward that fails in it leaves the first step to meet (and name) the problem."""
    from types import SimpleNamespace

    from gallery_lib.run.attention_probe import attention_choices

    class Broken:
        def loss(self, module, batch, precision):
            raise torch.OutOfMemoryError("mocked")

    chosen = attention_choices(SimpleNamespace(attention=None, module=torch.nn.Linear(2, 2)), Broken(), None, None)
    assert list(chosen) == ["not recorded"] and "OutOfMemoryError: mocked" in chosen["not recorded"]
