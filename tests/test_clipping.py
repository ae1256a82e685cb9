"""Gradient clipping folded into the fused optimizer's pass, against ``clip_grad_norm_`` then ``step``."""

from __future__ import annotations

import pytest
import torch

from gallery_lib.accel.clipping import can_fold, clip_then_step

SHAPES = [(37, 13), (13,), (5, 3, 3, 7), (1,)]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")])]


def _params(seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in SHAPES]


def _set_grads(params, step: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * scale).to(p.device)


def _make(kind: str, params, fused: bool) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, fused=fused)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, fused=fused)


@pytest.mark.isa  # the CPU's fused AdamW and SGD kernels differ by instruction set
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_folded_clipping_steps_like_clip_grad_norm_then_step(kind, device):
    """Steps whose total norm lies above the threshold (clipped) and below it (untouched): the same weights, optimizer
    state, returned norm and left-behind gradients as the two passes, to float32 round-off."""
    max_norm = 1.0
    ref_params, folded_params = _params(0, device), _params(0, device)
    ref_opt, folded_opt = _make(kind, ref_params, fused=True), _make(kind, folded_params, fused=True)
    assert can_fold(folded_opt, [torch.zeros(1)])
    for step, scale in enumerate([3.0, 0.05, 10.0, 0.2, 1.0]):
        _set_grads(ref_params, step, scale)
        _set_grads(folded_params, step, scale)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, foreach=True)
        ref_opt.step()
        norm = clip_then_step(folded_opt, folded_params, max_norm)
        assert getattr(folded_opt, "grad_scale", None) is None  # not left for the next step or a GradScaler
        torch.testing.assert_close(norm, ref_norm, rtol=0, atol=0)
        for ref, folded in zip(ref_params, folded_params):
            torch.testing.assert_close(folded, ref, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(folded.grad, ref.grad, rtol=1e-6, atol=1e-8)
    for ref, folded in zip(ref_opt.state.values(), folded_opt.state.values()):
        for key in ref:
            torch.testing.assert_close(folded[key], ref[key], rtol=1e-6, atol=1e-7)
    assert ref_norm > max_norm  # the last steps clipped: the comparison covered the factor


def test_the_fold_changes_the_update_only_through_the_clip_factor():
    """A threshold far above the norm leaves the step exactly as an unclipped one (factor 1: no rounding)."""
    params, plain = _params(1), _params(1)
    opt, plain_opt = _make("adamw", params, fused=True), _make("adamw", plain, fused=True)
    _set_grads(params, 0, 1.0)
    _set_grads(plain, 0, 1.0)
    clip_then_step(opt, params, max_norm=1e6)
    plain_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, plain))


def test_without_a_fused_optimizer_or_beside_a_grad_scaler_it_clips_as_its_own_pass():
    params, ref = _params(2), _params(2)
    opt, ref_opt = _make("adamw", params, fused=False), _make("adamw", ref, fused=False)
    assert not can_fold(opt, [p for p in params])
    _set_grads(params, 0, 5.0)
    _set_grads(ref, 0, 5.0)
    clip_then_step(opt, params, 1.0)
    torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=True)
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    fused = _make("adamw", _params(3), fused=True)
    fused.grad_scale = torch.tensor(4.0)  # a GradScaler's: the fold must not replace it
    assert not can_fold(fused, [torch.zeros(1)])


def test_a_step_the_guard_skips_moves_nothing():
    """The non-finite guard hands the fused optimizer ``found_inf``: with the fold, a flagged step still moves no
    weight, whatever the clip factor."""
    params = _params(4)
    before = [p.detach().clone() for p in params]
    opt = _make("adamw", params, fused=True)
    _set_grads(params, 0, 5.0)
    opt.found_inf = torch.tensor(1.0)
    clip_then_step(opt, params, 1.0)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
