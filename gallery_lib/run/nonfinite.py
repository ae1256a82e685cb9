"""The non-finite loss guard: a step whose loss is NaN or infinite on any rank does not move the weights.

Three modes (``guard_mode``):

- ``device``, with a fused optimizer (AdamW, SGD; the compiled and accelerated recipes): the optimizer gets a device
  flag (``found_inf``, the mechanism GradScaler uses) and skips its own update; no host sync. With a GradScaler,
  which hands the fused optimizer a ``found_inf`` of its own (from the unscaled gradients), a flagged step's
  gradients are made non-finite instead, so the scaler skips it and backs off its scale, as it does for an
  overflow. The learning-rate schedule and the EMA still advance on a skipped step (the weights did not move, so
  the EMA only moves towards them), and the skips are counted when the flags are read back at the next logging
  step (``count``). The per-step sync of the other mode is too costly for a launch-bound step
  (benchmarks/RESULTS.md#sd15-recipes, #resnet50-conv-bn-fusion).
- ``host`` otherwise: the loss is read on the host after backward (one sync per step, plus a one-element all-reduce
  when distributed) and the optimizer, scheduler and EMA are not stepped at all.
- ``off`` with ``max_nonfinite_steps=0``.

``max_nonfinite_steps`` skipped steps in a row stop the run (``should_stop``, then ``error``), with a checkpoint.
"""

from __future__ import annotations

from typing import Callable

import torch

from gallery_lib.accel.distributed import DistInfo, all_reduce_sum


def guard_mode(max_nonfinite_steps: int, fused_optimizer: bool) -> str:
    """``off``, ``device`` or ``host``: see the module docstring."""
    if max_nonfinite_steps == 0:
        return "off"
    return "device" if fused_optimizer else "host"


def nonfinite_flag(loss: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """A 0-d float tensor on the loss's device, > 0 when the loss is not finite on some rank (no sync)."""
    flag = (~torch.isfinite(loss.detach())).float().reshape(())
    if dist.world_size > 1:
        # MAX, not SUM: fused AdamW skips only when found_inf == 1.0 exactly; a 2.0 (two bad ranks) would step.
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag


def _make_gradients_nonfinite(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Where ``flag`` > 0, one gradient element becomes NaN (otherwise + 0), so GradScaler's check finds it; no sync.
    With ZeRO-2 each rank marks its own shard (every rank holds the same, all-reduced flag)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            if grad is not None and grad.numel():
                grad[(0,) * grad.dim()].add_(torch.where(flag > 0, float("nan"), 0.0).to(grad.dtype))  # a view
                return


def all_ranks_finite(loss: torch.Tensor, dist: DistInfo) -> bool:
    """Whether the loss is finite on every rank (one host sync; one all-reduce when distributed)."""
    bad = 0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0
    return all_reduce_sum(bad, dist) == 0


class NonfiniteGuard:
    """Runs each step's update unless the loss is not finite, and counts the skipped steps."""

    def __init__(self, max_nonfinite_steps: int, fused_optimizer: bool, precision, dist: DistInfo,
                 counters: dict[str, int] | None = None) -> None:
        self.mode = guard_mode(max_nonfinite_steps, fused_optimizer)
        self.scaler = precision.scaler
        self.limit = max_nonfinite_steps
        self.dist = dist
        counters = counters or {}
        self.in_a_row = counters.get("nonfinite_in_a_row", 0)
        self.total = counters.get("nonfinite_steps", 0)

    def update(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer,
               apply_update: Callable[[], None]) -> bool | torch.Tensor:
        """Runs ``apply_update`` (optimizer, scheduler and EMA step) as the mode allows; returns whether the step was
        skipped: a bool, or in ``device`` mode a device flag that ``count`` reads later."""
        if self.mode == "device":
            flag = nonfinite_flag(loss, self.dist)
            if self.scaler is not None:
                _make_gradients_nonfinite(optimizer, flag)
                apply_update()
                return flag
            optimizer.found_inf = flag
            try:
                apply_update()
            finally:
                del optimizer.found_inf
            return flag
        if self.mode == "host" and not all_ranks_finite(loss, self.dist):
            self._count(True)
            return True
        self._count(False)
        apply_update()
        return False

    def count(self, skips: list[bool]) -> None:
        """Counts the skip flags of ``device`` mode once they are read back (the other modes counted already)."""
        if self.mode == "device":
            for skipped in skips:
                self._count(skipped)

    def _count(self, skipped: bool) -> None:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += int(skipped)

    def should_stop(self) -> bool:
        return self.mode != "off" and self.in_a_row >= self.limit

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps, so a resumed run goes on counting."""
        return {"nonfinite_in_a_row": self.in_a_row, "nonfinite_steps": self.total}

    def error(self, last_step: int, saved_to, start: int = 0) -> NonfiniteLossError:
        """The error that stops the run after step ``last_step`` (the run began at ``start``), naming where the
        state was saved and what to try, which depends on when the loss stopped being finite."""
        first = last_step + 1 - self.in_a_row
        if first <= start + 1:  # at most one optimizer step was taken
            advice = ("The loss was not finite from the run's first steps: the recipe's numerics (amp_level, "
                      "amp_dtype, compile, kernels) or a learning rate far too large. If the baseline recipe trains "
                      "with a finite loss at this lr on the same data, switch this recipe's settings back one at a "
                      "time to find the one at fault; otherwise lower lr.")
        else:
            advice = "Lower the learning rate (lr) or check the data and amp_level, then continue with resume=True."
        return NonfiniteLossError(
            f"the loss was not finite for {self.in_a_row} steps in a row (steps {first}-{last_step}), "
            f"max_nonfinite_steps={self.limit}; those optimizer steps were skipped and the state was saved to "
            f"{saved_to}. {advice}", first_step=first)


class NonfiniteLossError(RuntimeError):
    """The run stopped after ``max_nonfinite_steps`` steps in a row whose loss was not finite."""

    def __init__(self, message: str, first_step: int) -> None:
        super().__init__(message)
        self.first_step = first_step
        """The first of them, numbered as ``metrics.jsonl`` numbers steps (from 0)."""
