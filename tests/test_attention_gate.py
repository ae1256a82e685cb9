"""The correctness gate of ``auto`` (fake backends on the CPU), the head-dim padding runner, FlashAttention-4's runner
and the CUTLASS DSL path fix of its import; on a GPU with flash-attn-4 installed, FA4 itself against exact math."""

import dataclasses
import importlib.util
import json
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from gallery_lib.accel.attention import BACKENDS, AttentionBackend, BackendSelector, attention, describe
from gallery_lib.accel.attention import backends as attention_backends
from gallery_lib.accel.attention.backends import pad_head_dim
from gallery_lib.accel.attention.gate import ABS_FLOOR, GateProbe, probe_shapes

BF16 = torch.bfloat16
SHAPE = (2, 4, 64, 40)  # on the CPU: the gate's probe is batch 1 of it


def test_probe_shapes_keep_head_dim_and_token_counts_within_budget():
    # the SD self-attention shape: batch 1, one head of 4096 x 4096 scores
    assert probe_shapes((32, 8, 4096, 40), (32, 8, 4096, 40)) == ((1, 1, 4096, 40), (1, 1, 4096, 40))
    # cross-attention keeps every head: 8 x 4096 x 77 scores fit
    assert probe_shapes((32, 8, 4096, 40), (32, 8, 77, 40)) == ((1, 8, 4096, 40), (1, 8, 77, 40))
    assert probe_shapes((2, 3, 49, 32), (2, 3, 49, 32)) == ((1, 3, 49, 32), (1, 3, 49, 32))
    # past 4096 tokens the count shrinks but keeps its remainder modulo 128 (the partial last tile)
    q, kv = probe_shapes((2, 16, 5000, 64), (2, 16, 5000, 64))
    assert q == (1, 1, 3976, 64) and kv == (1, 1, 3976, 64) and 3976 % 128 == 5000 % 128
    with pytest.raises(ValueError, match=r"expected \(batch, heads, tokens, head_dim\)"):
        probe_shapes((8, 40), (8, 40))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient: a kernel whose dq is wrong and the rest right."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


def _pytorch_sdpa(q, k, v, bias, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def _fake(name, run, checked=True):
    return AttentionBackend(name, run, devices=("cpu",), dtypes=(BF16,), max_head_dim=None, head_dim_multiple=1,
                            supports_bias=True, min_capability=None, checked=checked)


class _Runs:
    """A backend's run function that counts its calls."""

    def __init__(self, run):
        self.run, self.calls = run, 0

    def __call__(self, *args):
        self.calls += 1
        return self.run(*args)


def test_gate_refuses_a_wrong_gradient_names_it_and_picks_the_right_backend(tmp_path, monkeypatch):
    right = _Runs(_pytorch_sdpa)
    fakes = {
        "fake_right": _fake("fake_right", right),
        "fake_wrong_dq": _fake("fake_wrong_dq", lambda q, k, v, b, s: _pytorch_sdpa(_ScaleGrad.apply(q), k, v, b, s)),
        "fake_nan": _fake("fake_nan", lambda q, k, v, b, s: _pytorch_sdpa(q, k, v, b, s) * float("nan")),
    }
    for name, backend in fakes.items():
        monkeypatch.setitem(BACKENDS, name, backend)
    # the wrong ones claim to be the fastest: the gate, not the timings, must keep them out
    fake_ms = {"fake_wrong_dq": 0.5, "fake_nan": 0.1, "fake_right": 1.0, "math": 9.0}
    timed = []

    def timer(backend, *call):
        timed.append(backend.name)
        return fake_ms[backend.name]

    sel = BackendSelector(cache_path=tmp_path / "attn.json", timer=timer)
    assert sel.select(SHAPE, BF16, "cpu", False) == "fake_right"
    assert "fake_wrong_dq" not in timed and "fake_nan" not in timed  # a refused backend is not even timed
    key = next(iter(sel.cache))
    entry = sel.cache[key]
    refusal = entry["refused"]["fake_wrong_dq"]
    numbers = re.fullmatch(r"dq error ([0-9.e+-]+) > allowed ([0-9.e+-]+)", refusal)
    assert numbers, refusal  # dq alone: out, dk and dv are right
    assert float(numbers[1]) > 10 * float(numbers[2])
    allowed = entry["gate"]["probe"]["allowed"]
    assert entry["gate"]["probe"]["q_shape"] == [1, 4, 64, 40]
    assert all(allowed[t] == max(2 * entry["gate"]["probe"]["pytorch_errors"][t], ABS_FLOOR) for t in allowed)
    assert all(err <= allowed[t] for t, err in entry["gate"]["errors"]["fake_right"].items())
    assert entry["refused"]["fake_nan"].startswith("out error inf > allowed")
    assert "fake_right" not in entry["refused"]
    # the log line and describe() say what was refused and why
    assert sel.chosen[key].startswith("fake_right (measured; refused ")
    assert f"fake_wrong_dq: {refusal}" in sel.chosen[key]
    assert f"fake_wrong_dq refused at {key}: {refusal}" in describe(sel)
    # the gate's findings are cached with the choice: a second call, or a new process, checks nothing again
    calls = right.calls
    assert sel.select(SHAPE, BF16, "cpu", False) == "fake_right" and right.calls == calls
    saved = json.loads((tmp_path / "attn.json").read_text())[key]
    assert saved["refused"] == entry["refused"]
    reloaded = BackendSelector(cache_path=tmp_path / "attn.json", timer=timer)
    assert reloaded.select(SHAPE, BF16, "cpu", False) == "fake_right" and right.calls == calls
    assert attention(*(torch.randn(SHAPE, dtype=BF16) for _ in range(3)), selector=sel).shape == SHAPE


def test_gate_with_a_bias_and_under_no_grad_and_a_gate_that_cannot_run(monkeypatch):
    monkeypatch.setitem(BACKENDS, "fake_right", _fake("fake_right", _pytorch_sdpa))
    sel = BackendSelector(timer=lambda backend, *call: 1.0 if backend.name == "fake_right" else 9.0)
    with torch.no_grad():  # selection happens inside an evaluation's forward too
        assert sel.select((2, 3, 10, 12), BF16, "cpu", True, kv_shape=(2, 3, 7, 12)) == "fake_right"
    entry = next(iter(sel.cache.values()))
    assert entry["gate"]["probe"]["kv_shape"] == [1, 3, 7, 12] and not entry["refused"].get("fake_right")

    def no_memory(*call):
        raise torch.OutOfMemoryError("mocked")

    broken = BackendSelector(timer=lambda backend, *call: 1.0, gate=no_memory)
    assert broken.select(SHAPE, BF16, "cpu", False) == "math"  # nothing checked: only the reference's own algorithm
    assert "OutOfMemoryError: mocked" in next(iter(broken.cache.values()))["failed"]["correctness gate"]


def test_pytorchs_own_kernels_are_not_gated(monkeypatch):
    """Their error is the allowance's measure: the gate checks kernels from outside PyTorch only, and is not even
    built for a shape where no such kernel is eligible."""
    monkeypatch.setitem(BACKENDS, "fake_own", _fake("fake_own", _pytorch_sdpa, checked=False))
    built = []
    sel = BackendSelector(timer=lambda backend, *call: 1.0 if backend.name == "fake_own" else 9.0,
                          gate=lambda *call: built.append(call))
    assert sel.select(SHAPE, BF16, "cpu", False) == "fake_own" and built == []


def test_cpu_rule_holds_while_math_is_the_only_cpu_backend():
    sel = BackendSelector(timer=lambda *call: pytest.fail("the CPU rule times nothing"))
    assert sel.select(SHAPE, BF16, "cpu", False) == "math" and sel.cache == {}
    assert set(sel.chosen.values()) == {"math (the CPU rule)"}


@pytest.mark.parametrize("head_dim, padded_to", [(40, 64), (20, 32)])
def test_padding_computes_the_same_attention_and_gradients(head_dim, padded_to):
    """The padded runner around a plain math kernel (float64, on the CPU) against the kernel at the odd head dim."""
    seen = []

    def inner(q, k, v, bias, scale):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], scale))
        return _pytorch_sdpa(q, k, v, bias, scale)

    torch.manual_seed(0)
    q = torch.randn(2, 3, 9, head_dim, dtype=torch.float64)
    k, v = torch.randn(2, 3, 6, head_dim, dtype=torch.float64), torch.randn(2, 3, 6, head_dim, dtype=torch.float64)
    grad_out = torch.randn(2, 3, 9, head_dim, dtype=torch.float64)
    for bias, scale in [(None, None), (torch.randn(2, 3, 9, 6, dtype=torch.float64), 0.3)]:
        results = []
        for run in (pad_head_dim(inner), _pytorch_sdpa):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = run(*leaves, bias, scale)
            results.append([out, *torch.autograd.grad(out, leaves, grad_out)])
        for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(got, want, msg=name)
    # the kernel saw the padded head dim and the original head dim's scale
    assert seen == [(padded_to, padded_to, padded_to, head_dim**-0.5), (padded_to, padded_to, padded_to, 0.3)]


def test_padding_leaves_a_multiple_alone_and_refuses_a_bad_multiple():
    q = torch.randn(1, 2, 5, 64)
    got = []
    pad_head_dim(lambda *args: got.append(args[0]) or args[0])(q, q, q, None, None)
    assert got[0] is q  # no copy
    with pytest.raises(ValueError, match="multiple must be a positive number"):
        pad_head_dim(_pytorch_sdpa, multiple=0)


def test_flash_attn4_backends_declare_hopper_no_bias_and_what_head_dims():
    fa4, padded = (dataclasses.replace(BACKENDS[n], installed=True) for n in ("flash_attn4", "flash_attn4_padded"))
    for backend in (fa4, padded):
        assert backend.why_not((1, 8, 1024, 40), BF16, "cuda", False, (9, 0)) is None
        assert backend.why_not((1, 8, 1024, 40), BF16, "cuda", False, (10, 0)) is None
        assert "capability >= (9, 0)" in backend.why_not((1, 8, 1024, 40), BF16, "cuda", False, (8, 0))
        assert "bias" in backend.why_not((1, 8, 1024, 40), BF16, "cuda", True, (9, 0))
        assert "float32" in backend.why_not((1, 8, 1024, 40), torch.float32, "cuda", False, (9, 0))
    assert "multiple of 8" in fa4.why_not((1, 8, 1024, 20), BF16, "cuda", False, (9, 0))
    assert padded.why_not((1, 8, 1024, 20), BF16, "cuda", False, (9, 0)) is None  # padded to 32
    assert BACKENDS["flash_attn4"].installed == BACKENDS["flash_attn4_padded"].installed


@pytest.mark.parametrize("returns_lse", [True, False])
def test_flash_attn4_runner_passes_layout_and_scale(monkeypatch, returns_lse):
    """FA4 takes (batch, tokens, heads, head_dim), the scale by keyword, and returns (out, lse) or out."""
    calls = []

    def fake_flash_attn_func(q, k, v, softmax_scale=None):
        calls.append(softmax_scale)
        out = _pytorch_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, softmax_scale)
        out = out.transpose(1, 2)
        return (out, torch.zeros(out.shape[:3])) if returns_lse else out

    monkeypatch.setattr(attention_backends, "_flash_attn4_func", fake_flash_attn_func)
    q, k, v = torch.randn(2, 3, 9, 40), torch.randn(2, 3, 6, 40), torch.randn(2, 3, 6, 40)
    torch.testing.assert_close(BACKENDS["flash_attn4"].run(q, k, v, None, None), _pytorch_sdpa(q, k, v, None, None))
    torch.testing.assert_close(BACKENDS["flash_attn4_padded"].run(q, k, v, None, None),
                               _pytorch_sdpa(q, k, v, None, None))
    assert calls == [None, 40**-0.5]  # padded to 64, the scale of head dim 40


@pytest.fixture
def restored_imports(monkeypatch):
    """Leaves sys.path and sys.modules as they were (a fake flash_attn and cutlass get imported)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    for name in [n for n in sys.modules if n.split(".")[0] in ("flash_attn", "cutlass", "nvidia_cutlass_dsl")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_flash_attn4_import_finds_the_cutlass_dsl_a_target_install_leaves_off_the_path(tmp_path, restored_imports):
    """``pip install --target`` does not run the CUTLASS DSL's .pth file: the import adds its folder itself."""
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("import cutlass\ndef flash_attn_func(q, k, v, softmax_scale=None):\n    pass\n")
    dsl_packages = tmp_path / "nvidia_cutlass_dsl" / "dsl_packages"
    (dsl_packages / "cutlass").mkdir(parents=True)
    (dsl_packages / "cutlass" / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    assert importlib.util.find_spec("cutlass") is None  # what the .pth file would have fixed
    flash_attn_func = attention_backends._import_flash_attn4()
    assert flash_attn_func is not None and flash_attn_func.__module__ == "flash_attn.cute"
    assert sys.path[0] == str(dsl_packages)


def test_flash_attn4_import_leaves_the_path_alone_when_something_else_is_missing(tmp_path, restored_imports):
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("import einops_missing_here\n")
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass").mkdir(parents=True)
    sys.path.insert(0, str(tmp_path))
    path = list(sys.path)
    assert attention_backends._import_flash_attn4() is None and sys.path == path


# --------------------------------------------------------------------- on a GPU, with flash-attn-4
def _flash_attn4_on_this_gpu():
    if not BACKENDS["flash_attn4"].installed:
        pytest.skip("flash-attn-4 is not installed (ci/install_flash_attn.sh)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FlashAttention-4 needs a Hopper or newer GPU")


@pytest.mark.gpu
def test_gpu_flash_attn4_and_padded_against_exact_math():
    """Both FA4 runners at head dims 40, 64, 80 (SD's 40 and 80 among them): the padded one within the gate's
    allowance everywhere, and the plain one wherever its head dim is a multiple of 32."""
    _flash_attn4_on_this_gpu()
    found = {}
    for head_dim in (40, 64, 80):
        probe = GateProbe((1, 8, 1024, head_dim), (1, 8, 1024, head_dim), BF16, "cuda", False)
        for name in ("flash_attn4", "flash_attn4_padded"):
            found[name, head_dim] = report = probe.check(BACKENDS[name])
            print(name, head_dim, report.errors, "allowed", report.allowed)
    assert all(found["flash_attn4_padded", d].passed for d in (40, 64, 80)), found
    assert found["flash_attn4", 64].passed, found["flash_attn4", 64]
    for head_dim in (40, 80):  # where FA4's dq was wrong, only dq may be off
        assert set(found["flash_attn4", head_dim].over) <= {"dq"}, found["flash_attn4", head_dim]


@pytest.mark.gpu
def test_gpu_auto_refuses_flash_attn4_where_its_dq_is_wrong_and_takes_the_padded_one():
    _flash_attn4_on_this_gpu()
    shape = (2, 8, 1024, 40)
    report = GateProbe(shape, shape, BF16, "cuda", False).check(BACKENDS["flash_attn4"])
    sel = BackendSelector()
    sel.select(shape, BF16, "cuda", False)
    entry = next(iter(sel.cache.values()))
    print(describe(sel))
    assert "flash_attn4_padded" not in entry["refused"] and "flash_attn4_padded" in entry["timings_ms"]
    if report.passed:  # a release that fixed dq at head dim 40
        assert "flash_attn4" not in entry["refused"]
    else:
        assert entry["refused"]["flash_attn4"].startswith("dq error") and "flash_attn4" not in entry["timings_ms"]
        assert entry["backend"] != "flash_attn4"
