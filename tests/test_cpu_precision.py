"""A CPU without fast low-precision math (x86 with AVX2 only) computes the mixed-precision recipes in fp32 and says so
(``accel/precision.py``): O1 without autocast, O2 without casting the weights, and a run trains exactly as O0 does.
The rest of the suite keeps bf16 on every CPU (``GALLERY_CPU_AMP=1`` in conftest); these tests take it away and fake
the CPU's answer, so they check both answers on any machine."""

from __future__ import annotations

import pytest
import torch

from gallery_lib.accel import precision as precision_module
from gallery_lib.accel.precision import CPU_AMP_ENV, Precision, resolve_amp_dtype, slow_on_cpu_reason
from gallery_lib.config import RunConfig
from gallery_lib.models import build_model
from gallery_lib.run.metrics import read_metrics
from gallery_lib.run.train import run
from test_train import micro_cfg


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.delenv(CPU_AMP_ENV, raising=False)
    monkeypatch.setattr(precision_module, "_onednn_has", lambda dtype: False)


def settings(**kw):
    return RunConfig(model="swin_micro", batch_size=2, steps=2, warmup_steps=0, **kw).sections.precision


def test_a_cpu_without_fast_bf16_computes_in_fp32_and_says_why(cpu_without_bf16):
    assert slow_on_cpu_reason(torch.bfloat16).startswith("this CPU (") and "has no fast bfloat16 math" in \
        slow_on_cpu_reason(torch.bfloat16)
    for level in ("O1", "O2"):
        assert resolve_amp_dtype(settings(amp_level=level), "cpu") is None
    assert resolve_amp_dtype(settings(amp_level="O1", amp_dtype="float16"), "cpu") is None
    o2 = Precision.from_settings(settings(amp_level="O2"), "cpu")
    model = build_model("swin_micro", num_classes=4)
    o2.cast_model(model)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not o2.master_params
    assert o2.describe().startswith("O2 as fp32 weights and math: this CPU (") and o2.scaler is None
    assert Precision.from_settings(settings(amp_level="O0"), "cpu").describe() == "O0: fp32 weights and math"


def test_the_fallback_is_only_where_the_cpu_lacks_it_or_the_user_keeps_it(cpu_without_bf16, monkeypatch):
    assert resolve_amp_dtype(settings(amp_level="O1"), "cuda") is not None  # a GPU run is the GPU's to decide
    monkeypatch.setenv(CPU_AMP_ENV, "1")  # asked for anyway: bf16, slow
    assert resolve_amp_dtype(settings(amp_level="O1"), "cpu") == torch.bfloat16
    monkeypatch.delenv(CPU_AMP_ENV)
    monkeypatch.setattr(precision_module, "_onednn_has", lambda dtype: dtype == torch.bfloat16)  # AVX-512, AMX
    assert resolve_amp_dtype(settings(amp_level="O2"), "cpu") == torch.bfloat16
    assert slow_on_cpu_reason(torch.bfloat16) is None and slow_on_cpu_reason(torch.float16) is not None


def test_an_o2_run_on_such_a_cpu_trains_as_o0_step_for_step(cpu_without_bf16, smoke_data, tmp_path):
    common = dict(steps=4, warmup_steps=1, log_every=4, mixup_alpha=0, cutmix_alpha=0)
    ref = run(micro_cfg(smoke_data, tmp_path / "ref", amp_level="O0", **common))
    o2_cfg = micro_cfg(smoke_data, tmp_path / "o2", amp_level="O2", **common)
    o2 = run(o2_cfg)
    ref_steps = read_metrics(tmp_path / "ref/out/swin_transformer/baseline/metrics.jsonl")[0]
    o2_steps, o2_summary = read_metrics(o2_cfg.run_dir / "metrics.jsonl")
    assert [s["loss"] for s in o2_steps] == [s["loss"] for s in ref_steps] and ref["final_loss"] == o2["final_loss"]
    assert any("O2 as fp32 weights and math: this CPU" in note for note in o2_summary["notes"])
