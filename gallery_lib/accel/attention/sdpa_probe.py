"""What PyTorch's own SDPA dispatch picks: ``sdpa_choice`` for one call, ``record_sdpa_choices`` for a model's
forward (a run's log names the kernels a model without this registry's hooks runs)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gallery_lib.accel.attention.backends import SDPBackend, _device_info, _remember_devices, call_key
from gallery_lib.accel.side_forward import side_forward

_SDPA_NAMES = {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
               "MATH": "math"}


def sdpa_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> str:
    """The kernel that plain ``F.scaled_dot_product_attention`` runs for these arguments in a training step (inputs
    that require grad), in this registry's names; ``unknown`` where PyTorch lacks its private helper for this
    (``torch._fused_sdp_choice``) or it fails."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None or SDPBackend is None:
        return "unknown"
    try:
        with torch.enable_grad():  # the dispatch rules differ when inputs need gradients, as in training
            q, k, v = (t.detach().requires_grad_(t.is_floating_point()) for t in (query, key, value))
            picked = SDPBackend(choose(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)).name
    except Exception:  # noqa: BLE001 - a report, never a reason to stop a run
        return "unknown"
    return _SDPA_NAMES.get(picked, picked.lower())


class _SdpaRecorder(torch.overrides.TorchFunctionMode):
    """Records, per kind of call, what each ``F.scaled_dot_product_attention`` call dispatches to."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            call = {**dict(zip(names, args)), **kwargs}
            q, k, mask = call["query"], call["key"], call.get("attn_mask")
            device_name = _device_info(q.device)[0] if q.is_cuda else "CPU"
            self.chosen.setdefault(call_key(q.shape, k.shape, q.dtype, device_name, mask is not None),
                                   f"{sdpa_choice(**call)} (PyTorch's own SDPA choice)")
        return func(*args, **kwargs)


def record_sdpa_choices(model: nn.Module, forward: Callable[[], Any]) -> dict[str, str]:
    """What plain ``F.scaled_dot_product_attention`` runs, per kind of attention call in ``forward()``: for a model
    without this registry's hooks, a run's log says which kernel PyTorch chose (a model without attention: empty).

    ``forward`` runs once eagerly without gradients (compiled parts too); the choices are those of a training step.
    Nothing changes, ``model``'s buffers (BatchNorm statistics) included (``gallery_lib.accel.side_forward``).
    """
    _remember_devices(model)  # outside any compilation, before the recorder asks for device names
    recorder = _SdpaRecorder()
    with side_forward(model), torch.no_grad(), recorder:
        forward()
    return recorder.chosen
