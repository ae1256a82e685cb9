"""Resume on a GPU with the compiled recipe's settings: close to the uninterrupted run, within a stated tolerance.

Run on the GPU machine with ``pytest tests/test_resume_gpu.py -m gpu -s`` (``-s`` shows the measured differences).
"""

from __future__ import annotations

import pytest
import torch

from gallery_lib.run.checkpoint import read_checkpoint
from gallery_lib.config import RunConfig
from gallery_lib.run.metrics import read_metrics
from gallery_lib.recipes import apply_recipe
from gallery_lib.run.train import run
from resume_testing import resume_from_copy

STEPS = 8
LOSS_RTOL = 1e-2
PARAM_ATOL_OF_SCALE = 1e-2
UPDATE_RTOL = 0.1


def flat_params(path) -> torch.Tensor:
    """Every floating-point model tensor of a checkpoint, flattened into one fp32 vector (same key order)."""
    model = read_checkpoint(path)["model"]
    return torch.cat([v.float().flatten() for _, v in sorted(model.items()) if v.is_floating_point()])


@pytest.mark.gpu
def test_compiled_bf16_resume_on_gpu_matches_the_straight_run(smoke_data, tmp_path):
    """8 steps straight vs the same run resumed from its step-4 checkpoint for steps 4-7 (a fresh model, optimizer
    and compilation, in-process), with the compiled recipe: torch.compile, bf16 autocast O1, fused AdamW (so the
    device non-finite guard), no GradScaler.

    Bitwise equality is not expected on a GPU: backward kernels use atomics (the order of float additions varies
    between runs) and bf16 rounds every difference up. Tolerances, with what each catches:

    - per-step loss of steps 4-7: relative difference <= 1e-2 (bf16 noise is ~1e-3 here);
    - final weights: max |straight - resumed| <= 1e-2 * max |straight| (the param scale);
    - and, the check that can fail on a broken resume (with lr 1e-3 and 4 steps the weights move ~4e-3 at most, so
      the bound above is loose): the resumed steps' update, step-8 weights minus step-4 weights, differs from the
      straight run's update by <= 0.1 of the straight update's L2 norm. A lost optimizer state, learning-rate
      schedule or data position changes that update by far more.
    """
    values = dict(model="swin_micro", data_dir=str(smoke_data), output_dir=str(tmp_path / "straight"), image_size=64,
                  batch_size=16, steps=STEPS, warmup_steps=1, log_every=2, lr=1e-3, lr_warmup_steps=2,
                  num_workers=0, device="cuda", checkpoint_every=4, keep_checkpoints=2, mixup_alpha=0,
                  cutmix_alpha=0)
    straight = apply_recipe("compiled", RunConfig(**values))
    assert straight.compile and straight.amp_dtype == "bfloat16" and straight.fused_optimizer
    run(straight)

    resumed = resume_from_copy(straight, 4, tmp_path / "resumed")
    torch._dynamo.reset()  # compile again from scratch, as a new process would
    summary = run(resumed)
    assert summary["resumed_from_step"] == 4

    a = {s["step"]: s["loss"] for s in read_metrics(straight.run_dir / "metrics.jsonl")[0]}
    b = {s["step"]: s["loss"] for s in read_metrics(resumed.run_dir / "metrics.jsonl")[0]}
    assert sorted(b) == list(range(4, STEPS))
    loss_rel = max(abs(a[n] - b[n]) / abs(a[n]) for n in b)
    start = flat_params(straight.run_dir / "checkpoints" / "step_4.pt")
    p_a = flat_params(straight.run_dir / "checkpoints" / f"step_{STEPS}.pt")
    p_b = flat_params(resumed.run_dir / "checkpoints" / f"step_{STEPS}.pt")
    max_abs = (p_a - p_b).abs().max().item()
    scale = p_a.abs().max().item()
    update_rel = ((p_b - start) - (p_a - start)).norm().item() / (p_a - start).norm().item()
    print(f"\nGPU resume ({torch.cuda.get_device_name()}, torch {torch.__version__}): "
          f"losses steps 4-7 straight {[a[n] for n in b]} resumed {[b[n] for n in b]}; "
          f"max loss rel diff {loss_rel:.3e}; max abs param diff {max_abs:.3e} (param scale {scale:.3e}, "
          f"ratio {max_abs / scale:.3e}); update rel diff {update_rel:.3e}")
    assert loss_rel <= LOSS_RTOL
    assert max_abs <= PARAM_ATOL_OF_SCALE * scale
    assert update_rel <= UPDATE_RTOL
