"""AMP levels: O0 (fp32), O1 (autocast) and O2 (low-precision weights with fp32 master copies).

``Precision`` owns everything about number formats in a step: the autocast context, the
GradScaler (float16 only: bfloat16 has fp32's exponent range and needs no loss scaling), and for
O2 the fp32 master weights that the optimizer updates and copies back into the bf16 model. O2 still
runs under autocast, so softmax, norms and the loss keep fp32 math as in O1; what changes is that
weights are stored, read and all-reduced in bf16 (half the weight and gradient traffic).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from gallery_lib.accel.clipping import clip_then_step
from gallery_lib.config.sections.training import Precision as PrecisionSettings


def resolve_amp_dtype(settings: PrecisionSettings, device: str) -> torch.dtype | None:
    """The low-precision dtype of a run's precision ``settings`` on ``device`` (``None``: fp32): bfloat16 becomes
    float16 (with a GradScaler) on a GPU without bfloat16 tensor cores (``no_bfloat16_reason``), and a CPU without
    fast low-precision math runs fp32 (``slow_on_cpu_reason``)."""
    if settings.amp_level == "O0":
        return None
    dtype = _asked_dtype(settings, device)
    if device == "cpu" and slow_on_cpu_reason(dtype):
        return None
    return torch.float16 if dtype == torch.bfloat16 and no_bfloat16_reason(device) else dtype


def _asked_dtype(settings: PrecisionSettings, device: str) -> torch.dtype:
    """The low-precision dtype the ``settings`` ask for on ``device``, before what the hardware runs fast."""
    if settings.amp_dtype == "auto":
        # The Swin reference trains with float16 + GradScaler; CPUs have no fast float16 path.
        return torch.float16 if device == "cuda" and settings.amp_level == "O1" else torch.bfloat16
    return getattr(torch, settings.amp_dtype)


def no_bfloat16_reason(device: str) -> str | None:
    """Why this CUDA device cannot run bfloat16 math fast (pre-Ampere: T4, V100), or ``None``."""
    if device != "cuda" or not torch.cuda.is_available():  # a config planned for a GPU this machine lacks
        return None
    major, minor = torch.cuda.get_device_capability()
    if major >= 8:
        return None
    return (f"this GPU (compute capability {major}.{minor}) has no bfloat16 tensor cores, so bfloat16 was replaced "
            "by float16 with a GradScaler")


CPU_AMP_ENV = "GALLERY_CPU_AMP"
"""Set to 1: a CPU without fast low-precision math computes in the precision asked anyway (slow; the tests set it to
check the mixed-precision numerics on every CPU)."""


def slow_on_cpu_reason(dtype: torch.dtype) -> str | None:
    """Why this CPU has no fast ``dtype`` math, or ``None``: where oneDNN has no bfloat16 (float16) kernels for it
    (x86 without AVX-512: AVX2 only), PyTorch's convolutions take a reference path under autocast; SD's tiny UNet
    stepped about 6x slower in bfloat16 than in fp32 on an AVX2-only EPYC (benchmarks/RESULTS.md#cpu-gallery)."""
    if os.environ.get(CPU_AMP_ENV) == "1" or _onednn_has(dtype):
        return None
    name = str(dtype).replace("torch.", "")
    return f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no fast {name} math"


def _onednn_has(dtype: torch.dtype) -> bool:
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return check is None or bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without oneDNN's checks: keep what the config asked
        return True


@dataclass
class Precision:
    level: str
    dtype: torch.dtype | None
    device: str
    scaler: torch.amp.GradScaler | None = None
    fallback: str | None = None
    """Why ``dtype`` is not the one the config asked for (bfloat16 on a GPU without it), or ``None``."""
    master_params: dict[torch.nn.Parameter, torch.Tensor] = field(default_factory=dict)
    """O2 only: model parameter -> its fp32 master copy."""

    @classmethod
    def from_settings(cls, settings: PrecisionSettings, device: str) -> Precision:
        """The precision a run's ``settings`` (``cfg.sections.precision``) give on ``device``."""
        dtype = resolve_amp_dtype(settings, device)
        scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
        fallback = no_bfloat16_reason(device) if settings.amp_dtype == "bfloat16" and dtype == torch.float16 else None
        if dtype is None and settings.amp_level != "O0":  # a CPU without fast low-precision math
            fallback = slow_on_cpu_reason(_asked_dtype(settings, device))
        return cls(level=settings.amp_level, dtype=dtype, device=device, scaler=scaler, fallback=fallback)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.dtype)

    def cast_model(self, model: torch.nn.Module) -> None:
        """O2: keeps an fp32 master copy of every trainable parameter, then stores the model in ``dtype``.

        ``Module.to`` swaps ``param.data`` and keeps the Parameter objects, so references taken
        before the cast (e.g. the optimizer's parameter groups) stay valid.
        """
        if self.level != "O2" or self.dtype is None:
            return
        self.master_params = {p: p.detach().clone().float() for p in model.parameters() if p.requires_grad}
        model.to(self.dtype)

    def optimizer_params(self, groups: list[dict]) -> list[dict]:
        """Maps parameter groups built on the model to the tensors the optimizer must update."""
        if not self.master_params:
            return groups
        return [{**g, "params": [self.master_params[p] for p in g["params"]]} for g in groups]

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_grad: float | None,
             fold_clipping: bool = False) -> None:
        """Unscales/copies gradients, clips, steps the optimizer and (O2) writes the masters back. ``fold_clipping``:
        the fused optimizer applies the clip factor as it reads the gradients (``gallery_lib.accel.clipping``)."""
        if self.master_params:
            params = [p for p in self.master_params if p.grad is not None]
            masters = [self.master_params[p] for p in params]
            for p, m in zip(params, masters):
                if m.grad is None:
                    m.grad = torch.empty_like(m)
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
            for p in params:  # the optimizer only clears the masters' grads; the model's must not accumulate
                p.grad = None
            clip_then_step(optimizer, masters, clip_grad, fold=fold_clipping)
            torch._foreach_copy_([p.data for p in params], masters)
            return
        if self.scaler:
            self.scaler.unscale_(optimizer)
            if clip_grad:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip_grad,
                                               foreach=True)
            self.scaler.step(optimizer)
            self.scaler.update()
            return
        clip_then_step(optimizer, [p for p in model.parameters() if p.grad is not None], clip_grad, fold=fold_clipping)

    def describe(self) -> str:
        if self.dtype is None:
            return f"{self.level} as fp32 weights and math: {self.fallback}" if self.fallback else \
                "O0: fp32 weights and math"
        name = str(self.dtype).replace("torch.", "")
        if self.fallback:
            name += f" ({self.fallback})"
        if self.level == "O2":
            return f"O2: {name} weights, fp32 master copies in the optimizer, autocast math"
        return f"O1: fp32 weights, {name} autocast" + (" with GradScaler" if self.scaler else "")
