"""Thin nn.Modules over the fused kernels, drop-in for torch's and diffusers' layers: the kernels package's middle
floor, between the ops it calls and the swap table (``patch.py``) that puts them in a model.

Parameter names match the modules they replace (``weight``/``bias``; ``proj`` for GEGLU), so ``state_dict`` keys
do not change when `gallery_lib.accel.kernels.patch.apply_kernels` swaps them in. ``from_module`` builds a fused
module that shares the original's parameters (optimizer state and checkpoints keep pointing at the same tensors).
Compiled on a CPU, where there is no Triton kernel, they give the compiler the replaced layers' ops
(`compiling_for_cpu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gallery_lib.accel.kernels import geglu, group_norm, layer_norm


def compiling_for_cpu(t: torch.Tensor) -> bool:
    """True while ``torch.compile`` traces a layer whose tensor ``t`` is on a CPU. The fused kernels are Triton's:
    traced on a CPU, the op would run its PyTorch reference as one opaque call. The layers hand the compiler torch's
    own ops instead, those of the layers they replaced, in the same order: Inductor fuses them itself, and the graphs
    are the unpatched model's, so the compile caches serve both (a CPU ladder compiles its block rungs' graphs once,
    not once per rung). ``t`` is the weight where there is one: Dynamo numbers a graph's inputs in the order it first
    touches them, and the replaced layers touch their weights before their input."""
    return torch.compiler.is_compiling() and t.device.type == "cpu"


class FusedGroupNorm(nn.Module):
    """``nn.GroupNorm`` optionally followed by SiLU, computed by one fused kernel."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 activation: str | None = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        if activation not in (None, "silu"):
            raise ValueError(f"activation must be None or 'silu', got {activation!r}")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.activation = activation
        if affine:
            self.weight = nn.Parameter(torch.ones(num_channels, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(num_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_module(cls, norm: nn.GroupNorm, activation: str | None = None) -> FusedGroupNorm:
        fused = cls(norm.num_groups, norm.num_channels, norm.eps, affine=False, activation=activation)
        fused.affine = norm.affine
        fused.weight, fused.bias = norm.weight, norm.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if compiling_for_cpu(x if self.weight is None else self.weight):
            y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
            return F.silu(y) if self.activation == "silu" else y
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.activation)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"activation={self.activation}")


class FusedLayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension, computed by the fused kernel."""

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"FusedLayerNorm normalizes the last dim only; got normalized_shape={shape}")
        self.normalized_shape, self.eps, self.elementwise_affine = shape, eps, elementwise_affine
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(shape, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(shape, **factory)) if elementwise_affine and bias else None

    @classmethod
    def from_module(cls, norm: nn.LayerNorm) -> FusedLayerNorm:
        fused = cls(norm.normalized_shape, norm.eps, elementwise_affine=False)
        fused.elementwise_affine = norm.elementwise_affine
        fused.weight, fused.bias = norm.weight, norm.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if compiling_for_cpu(x if self.weight is None else self.weight):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedGEGLU(nn.Module):
    """diffusers ``GEGLU`` (``proj`` then ``a * gelu(gate)``) with the gate fused; ``proj`` stays a cuBLAS matmul."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias)

    @classmethod
    def from_module(cls, module: nn.Module) -> FusedGEGLU:
        proj = module.proj
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.proj = proj
        return fused

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        hidden_states = self.proj(hidden_states)
        if compiling_for_cpu(hidden_states):
            hidden_states, gate = hidden_states.chunk(2, dim=-1)
            return hidden_states * F.gelu(gate)
        return geglu(hidden_states)

    def extra_repr(self) -> str:
        return f"dim_in={self.proj.in_features}, dim_out={self.proj.out_features // 2}"
