"""AdamW whose step also moves the EMA of the weights: one pass over them instead of two (``ema_in_optimizer``).

``AdamWWithEma`` is ``torch.optim.AdamW(fused=True)``: the same hyperparameters, state and ``state_dict``, so a
checkpoint of one loads into the other. Once ``attach_ema(ema, model)`` has named each parameter's average, its
``step`` applies AdamW and the EMA's next update in one Triton kernel (``kernels/adamw_ema.py``), which reads each
weight, gradient, moment and average once; ``ModelEma.update`` then counts the update and copies the buffers without
averaging again. It keeps torch's contract for ``grad_scale`` (the folded gradient clipping) and ``found_inf`` (a
flagged step leaves the weights; the average still moves towards them, as ``ModelEma`` does after a device-side
skip), except that the gradients are left as the backward wrote them, not divided by ``grad_scale``.

Where the kernel cannot take a step, it is torch's AdamW's, and the EMA averages in its own pass as it would
without this class: tensors Triton cannot serve (a CPU without the interpreter), options the kernel lacks
(``amsgrad``, ``maximize``, ``capturable``, ``differentiable``, a tensor learning rate), a tensor it cannot read (not
fp32, strided, misaligned, sharded), or a parameter the EMA does not average.
"""

from __future__ import annotations

from typing import Any

import torch

from gallery_lib.accel.kernels import adamw_ema as one_pass
from gallery_lib.accel.kernels import use_triton
from gallery_lib.config.sections.training import EMA as EMASettings
from gallery_lib.config.sections.training import Optimizer as OptimizerSettings
from gallery_lib.config.sections.training import Precision as PrecisionSettings

_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def ema_in_pass(ema: EMASettings, optimizer: OptimizerSettings, precision: PrecisionSettings, *, data_parallel: str,
                amp_dtype: torch.dtype | None) -> bool:
    """Whether a run with these settings (its autocast dtype ``amp_dtype``) builds an ``AdamWWithEma``: it asks for
    it, keeps an EMA on the GPU (not offloaded to the CPU's memory), and steps a fused AdamW on fp32 weights the EMA
    averages (not O2's masters, nor ZeRO-2's shards); float16 brings a GradScaler, whose skipped steps must not move
    the EMA."""
    return bool(ema.ema_in_optimizer and ema.ema != "off" and not ema.ema_offload and optimizer.optimizer == "adamw"
                and optimizer.fused_optimizer and precision.amp_level != "O2" and amp_dtype != torch.float16
                and data_parallel != "zero2")


class AdamWWithEma(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` that also applies a ``ModelEma``'s update in its pass (module docstring).

        optimizer = AdamWWithEma(model.parameters(), lr=1e-4, weight_decay=1e-2)
        ema = ModelEma(model, mode="fused")
        optimizer.attach_ema(ema, model)
        ...
        optimizer.step(); ema.update(model)   # the update counts; the kernel already averaged
    """

    def __init__(self, params, **kwargs: Any) -> None:
        if kwargs.pop("fused", True) is not True:
            raise ValueError("AdamWWithEma is the fused AdamW: leave out fused=, or use torch.optim.AdamW")
        super().__init__(params, fused=True, **kwargs)
        self._ema = None
        self._average_of: dict[torch.Tensor, torch.Tensor] = {}
        self._tables: dict[int, dict] = {}  # group index -> its tables and what they were built for
        self.averaged_update: int | None = None
        """The EMA update count whose averaging the last ``step`` did (``ModelEma.update`` reads it)."""

    def attach_ema(self, ema, model: torch.nn.Module) -> None:
        """Makes each ``step`` apply ``ema``'s next update too, for the parameters of ``model`` it averages."""
        self._ema = ema
        self._average_of = dict(ema.averaged_pairs(model))
        self._tables.clear()
        ema.averaged_by(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._tables.clear()  # the moments and step counts are new tensors

    @torch.no_grad()
    def step(self, closure=None):
        self.averaged_update = None
        launches = self._launches() if closure is None and self._ema is not None else None
        if launches is None:
            return super().step(closure)
        ema_weight = 1.0 - self._ema.get_decay(self._ema.step + 1)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group, tables in launches:
            torch._foreach_add_(tables.step_counts, 1)  # torch's order: count, update, take a flagged step back
            one_pass.launch(tables, one_pass.Hyper(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
                                               ema_weight=ema_weight), grad_scale, found_inf)
            if found_inf is not None:
                torch._foreach_sub_(tables.step_counts, [found_inf] * len(tables.step_counts))
        self.averaged_update = self._ema.step + 1
        return None

    def _launches(self) -> list[tuple[dict, one_pass.Tables]] | None:
        """Each group's tables for this step, or ``None`` when the kernel cannot take the whole step. The tables are
        built when a group's parameters with gradients change; a step whose gradients moved only re-points them."""
        launches = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if (any(group.get(option) for option in _UNSUPPORTED) or torch.is_tensor(group["lr"])
                    or not use_triton(params[0])):
                return None
            grads = [p.grad for p in params]
            grad_addresses = tuple(g.data_ptr() for g in grads)
            members = (tuple(map(id, params)), tuple(group["betas"]))
            cached = self._tables.get(index)
            if cached is None or cached["members"] != members:
                if any(p not in self._average_of for p in params):
                    return None
                rows = [(p, g, *self._moments(p), self._average_of[p]) for p, g in zip(params, grads)]
                if not all(one_pass.fusable(*row) for row in rows):
                    return None
                steps = [self.state[p]["step"] for p in params]
                cached = self._tables[index] = dict(members=members, grads=grad_addresses,
                                                    tables=one_pass.build_tables(rows, steps, group["betas"]))
            elif cached["grads"] != grad_addresses:
                if not all(one_pass.fusable(p, g) for p, g in zip(params, grads)):
                    return None
                one_pass.point_to_grads(cached["tables"], grads)
                cached["grads"] = grad_addresses
            launches.append((group, cached["tables"]))
        return launches

    def _moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``param``'s first and second moments, created as torch's fused AdamW creates them on its first step."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state["exp_avg"], state["exp_avg_sq"]
