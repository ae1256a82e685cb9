"""The correctness gate of ``auto``: a backend is a candidate for an attention shape only once its output and its
gradients dq, dk, dv at that shape are as close to exact attention as PyTorch's own op's.

The rule is the project's for half precision: at most ``RATIO`` (2) times the error of PyTorch's own op,
``F.scaled_dot_product_attention`` as a plain model calls it at the call's dtype, against exact math, per tensor
(max absolute error), with a floor of ``ABS_FLOOR`` so that an op with no error at all does not refuse everything.
A kernel can be right forward and wrong backward (FlashAttention-4's dq at head dims 40 and 80), so all four count.

"Exact math" is the attention formula in float64 on the same (rounded) inputs. float64 rather than float32: CUDA's
float32 matmuls follow the process's TF32 switches, which the gate must not flip (they are part of Inductor's cache
key, ``gallery_lib/accel/torch_switches.py``), and float64 never uses TF32.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

RATIO = 2.0
ABS_FLOOR = 1e-4
"""Below any half-precision op's error (bf16's rounding step near 1 is 4e-3), above float32's accumulation-order noise
over thousands of tokens."""
PROBE_TOKENS = 4096
PROBE_SCORES = 2**24
"""heads x q tokens x kv tokens of a probe: 128 MiB per float64 score matrix, a few of which the reference's backward
holds. Selection runs in a model's first forward, when its activations take most of the GPU's memory."""
TILE = 128
COMPARED = ("out", "dq", "dk", "dv")  # the output and the three input gradients


def probe_shapes(q_shape: Sequence[int], kv_shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes the gate checks for a call of these shapes: batch 1 (the batch only repeats the same work), the same
    head dim, every token up to ``PROBE_TOKENS`` per side, and as many heads as fit ``PROBE_SCORES``.

    Longer sequences keep their token count modulo ``TILE``, so that a kernel's partial last tile is still exercised;
    heads go before tokens because each head is computed alike, while a kernel's code depends on the token counts.
    """
    if len(q_shape) != 4 or len(kv_shape) != 4:
        raise ValueError(f"probe_shapes: expected (batch, heads, tokens, head_dim) shapes, got {tuple(q_shape)} and "
                         f"{tuple(kv_shape)}")
    _, heads, q_tokens, head_dim = q_shape
    q_tokens, kv_tokens = _fewer_tokens(q_tokens), _fewer_tokens(kv_shape[2])
    heads = max(1, min(heads, PROBE_SCORES // (q_tokens * kv_tokens)))
    return (1, heads, q_tokens, head_dim), (1, heads, kv_tokens, kv_shape[3])


def _fewer_tokens(tokens: int) -> int:
    if tokens <= PROBE_TOKENS:
        return tokens
    return PROBE_TOKENS - TILE + (tokens % TILE or TILE)


@dataclass(frozen=True)
class GateReport:
    """One backend's max absolute errors against exact math at one shape, and what the gate allows."""

    backend: str
    errors: dict[str, float]
    allowed: dict[str, float]

    @property
    def over(self) -> list[str]:
        """The tensors whose error is past the allowance (``not <=``, so that a NaN counts as past it)."""
        return [name for name, err in self.errors.items() if not err <= self.allowed[name]]

    @property
    def passed(self) -> bool:
        return not self.over

    def refusal(self) -> str:
        """Why the backend is refused, e.g. ``dq error 0.37 > allowed 0.0034``; empty when it passed."""
        return "; ".join(f"{name} error {self.errors[name]:.2g} > allowed {self.allowed[name]:.2g}"
                         for name in self.over)


class GateProbe:
    """The gate for one kind of call: random inputs at ``probe_shapes``, their exact attention and gradients, and the
    allowance from PyTorch's own op; ``check(backend)`` then measures one backend. Seeded with its own generator, so
    the decision is reproducible and the process's random streams are left alone."""

    def __init__(self, q_shape: Sequence[int], kv_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str, has_bias: bool, seed: int = 0):
        self.device = torch.device(device)
        self.dtype = dtype
        self.q_shape, self.kv_shape = probe_shapes(q_shape, kv_shape)
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def sample(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator, device=self.device).to(dtype)

        with _plain_autograd(self.device):
            q, k, v = sample(*self.q_shape), sample(*self.kv_shape), sample(*self.kv_shape)
            bias = sample(1, self.q_shape[1], self.q_shape[2], self.kv_shape[2]) if has_bias else None
            grad_out = sample(*self.q_shape[:3], self.kv_shape[3])
            self.inputs = (q, k, v, bias, grad_out)
            self.reference = _out_and_grads(_exact_attention, *(None if t is None else t.double()
                                                                for t in self.inputs))
            self.pytorch_errors = self.errors(
                lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
        self.allowed = {name: max(RATIO * err, ABS_FLOOR) for name, err in self.pytorch_errors.items()}

    def errors(self, run: Callable[..., torch.Tensor]) -> dict[str, float]:
        """Max absolute error of ``run(q, k, v, bias)``'s output and of dq, dk, dv against exact math."""
        with _plain_autograd(self.device):
            got = _out_and_grads(run, *self.inputs)
        errors = {}
        for name, g, want in zip(COMPARED, got, self.reference):
            if g.shape != want.shape:
                raise ValueError(f"{name} has shape {tuple(g.shape)}, expected {tuple(want.shape)}")
            diff = (g.double() - want).abs()
            errors[name] = float(diff.max()) if bool(torch.isfinite(diff).all()) else math.inf
        return errors

    def check(self, backend: Any) -> GateReport:
        """``backend`` (an ``AttentionBackend``) measured at the probe; exceptions of the kernel pass through."""
        errors = self.errors(lambda q, k, v, bias: backend.run(q, k, v, bias, None))
        return GateReport(backend.name, errors, self.allowed)

    def summary(self) -> dict[str, Any]:
        """What the selector's cache keeps of the probe."""
        return {"q_shape": list(self.q_shape), "kv_shape": list(self.kv_shape), "allowed": self.allowed,
                "pytorch_errors": self.pytorch_errors}


@contextlib.contextmanager
def _plain_autograd(device: torch.device):
    """Gradients on (inside ``no_grad`` or ``inference_mode`` too) and autocast off, which would otherwise run the
    float64 reference in half precision."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        yield


def _exact_attention(q, k, v, bias):
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    return scores.softmax(-1) @ v


def _out_and_grads(run, q, k, v, bias, grad_out) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = run(*leaves, bias)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]
