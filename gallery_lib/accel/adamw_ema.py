"""``AdamWWithEma``: PyTorch's fused AdamW that also moves an attached EMA of the weights, in the same kernel.

An EMA of the weights (``ModelEma``) is one more pass over them after each optimizer step: on the SD-1.5 UNet it read
and wrote 10 GB a step, 1.2% of the step at batch 32. ``ModelEma(mode="optimizer")`` hands its averaged tensors to this
optimizer instead, whose kernel (``kernels/adamw_ema.py``) updates each weight and then its EMA while the weight is in
registers, so the EMA costs only its own read and write.

Everything else is ``torch.optim.AdamW(fused=True)``: the arguments, parameter groups, state (``step`` as a float32
tensor on the parameter's device, ``exp_avg``, ``exp_avg_sq``), ``state_dict``, learning-rate schedulers and the
``found_inf`` flag that skips a step. A step the kernel cannot take whole runs ``torch.optim.AdamW``'s own step and
leaves the whole EMA update to ``ModelEma.update``: a closure, a GradScaler's ``grad_scale``, amsgrad, maximize, capturable or
differentiable groups, a tensor learning rate, or a parameter the kernel cannot read (sharded, sparse, a layout of its
own; said once in a warning).
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

from gallery_lib.accel.kernels import _triton_utils as tu
from gallery_lib.accel.kernels import adamw_ema as kernel


class FusedEma(Protocol):
    """What ``AdamWWithEma`` needs of an EMA (``ModelEma`` in ``optimizer`` mode)."""

    def next_update_weight(self) -> float:
        """The lerp weight of the coming update (``1 - decay``)."""

    def updated_in_optimizer(self, indices: tuple[int, ...]) -> None:
        """The averaged tensors at ``indices`` were updated by this step's kernel."""


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device``: CUDA with Triton, or a CPU under Triton's interpreter."""
    return tu.has_triton and (device.type == "cuda" or (device.type == "cpu" and tu.interpreter_ready()))


class AdamWWithEma(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` whose step also updates an attached EMA (``attach_ema``)."""

    def __init__(self, params, **kwargs: Any) -> None:
        if kwargs.pop("fused", True) is not True:
            raise ValueError("AdamWWithEma is the fused AdamW; drop fused=False (use torch.optim.AdamW for the "
                             "foreach or per-tensor implementations)")
        super().__init__(params, fused=True, **kwargs)
        self._ema: FusedEma | None = None
        self._ema_of: dict[int, tuple[int, torch.Tensor]] = {}
        self._tables: dict[tuple, list[tuple[dict, tuple[int, ...]]]] = {}
        self._warned = False
        self.table_builds = 0  # how often the pointer tables were (re)built: once, unless tensors move

    def attach_ema(self, ema: FusedEma, model_tensors: list[torch.Tensor], ema_tensors: list[torch.Tensor]) -> None:
        """From now on each step also moves ``ema_tensors[i]`` towards ``model_tensors[i]`` for the parameters it
        updates, with ``ema.next_update_weight()``, and reports them with ``ema.updated_in_optimizer``."""
        self._ema = ema
        self._ema_of = {id(p): (i, e) for i, (p, e) in enumerate(zip(model_tensors, ema_tensors))}
        self._tables.clear()

    @torch.no_grad()
    def step(self, closure=None):
        rows = self._fused_rows() if self._ema is not None and closure is None else None
        if rows is None:
            return super().step(closure)
        found_inf = getattr(self, "found_inf", None)
        steps = [row[5] for group_rows in rows for row in group_rows]
        torch._foreach_add_(steps, 1)
        covered: list[int] = []
        for group, group_rows, (tables, indices) in zip(self.param_groups, rows, self._tables_for(rows)):
            beta1, beta2 = group["betas"]
            for table in tables:
                kernel.launch(table, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"], ema_weight=self._ema.next_update_weight(),
                              found_inf=found_inf)
            covered.extend(indices)
        if found_inf is not None:  # as the fused AdamW does: a skipped step does not count
            torch._foreach_sub_(steps, [found_inf] * len(steps))
        self._ema.updated_in_optimizer(tuple(covered))
        return None

    def _fused_rows(self) -> list[list[tuple[torch.Tensor, ...]]] | None:
        """Per group, ``(param, grad, exp_avg, exp_avg_sq, ema, step)`` for every parameter with a gradient, its state
        created as the fused AdamW creates it; ``None`` when this step must run as ``torch.optim.AdamW``'s."""
        if getattr(self, "grad_scale", None) is not None:
            return None
        rows = []
        for group in self.param_groups:
            if (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
                    or isinstance(group["lr"], torch.Tensor)):
                return None
            group_rows = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                partner = self._ema_of.get(id(p))
                if partner is None or not kernel_runs_on(p.device) or type(p.data) is not torch.Tensor:
                    return self._cannot(p, "it has no EMA partner" if partner is None else "of its device or type")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                row = (p, p.grad, state["exp_avg"], state["exp_avg_sq"], partner[1], state["step"])
                if not kernel.fusable(*row[:5]):
                    return self._cannot(p, "of its dtype, layout or alignment")
                group_rows.append(row)
            rows.append(group_rows)
        return rows

    def _cannot(self, param: torch.Tensor, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"AdamWWithEma: a parameter of shape {tuple(param.shape)} cannot take the fused AdamW + EMA "
                          f"kernel because {why}; steps run as torch.optim.AdamW's, with a separate EMA pass.",
                          stacklevel=3)
        return None

    def _tables_for(self, rows) -> list[tuple[list[dict], tuple[int, ...]]]:
        """The kernel tables of each group and the EMA indices they cover, rebuilt only when a tensor moved."""
        key = tuple(t.data_ptr() for group_rows in rows for row in group_rows for t in row)
        if key not in self._tables:
            if len(self._tables) >= 4:  # gradients may cycle through a few addresses; more means they keep moving
                self._tables.clear()
            self.table_builds += 1
            self._tables[key] = [(kernel.build_tables(group_rows),
                                  tuple(self._ema_of[id(row[0])][0] for row in group_rows)) for group_rows in rows]
        return self._tables[key]
