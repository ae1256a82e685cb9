"""Swap a model instance's layers for the fused ones, reversibly, keeping ``state_dict`` keys: the kernels
package's top floor, which puts the layers of ``modules.py`` and ``conv_bn_block.py`` in a model.

`apply_kernels` walks a plain ``nn.Module`` tree and replaces, per instance (never per class), as the rows of
``KERNEL_SWAPS`` say (the first row matching a module decides):

* ``nn.GroupNorm`` -> `FusedGroupNorm`. Where diffusers applies SiLU right after a GroupNorm it is fused too:
  in ``ResnetBlock2D`` (``norm1 -> nonlinearity``, and ``norm2 -> nonlinearity`` when
  ``time_embedding_norm="default"``) and in ``UNet2DConditionModel`` (``conv_norm_out -> conv_act``).
  ``ResnetBlock2D`` uses ``self.nonlinearity`` for the time embedding as well, so its SiLU cannot simply be
  removed: the block gets an instance-level ``forward`` (`_resnet_block_forward`, the same computation with the
  SiLU folded into the norms). ``UNet2DConditionModel`` uses ``conv_act`` only after ``conv_norm_out``, so there
  ``conv_act`` becomes ``nn.Identity``.
* ``nn.LayerNorm`` (and timm's ``LayerNorm``, same math) over the last dim -> `FusedLayerNorm`.
* diffusers ``GEGLU`` -> `FusedGEGLU` (the same ``proj`` Linear, fused gate).
* timm's ResNet ``Bottleneck`` gets an instance-level ``forward``, `conv_bn_block.bottleneck_forward`: its batch
  norms folded into cuDNN's fused convolutions (off unless asked for: the fusions run in float16 only).

Fused modules share the original parameters, so an optimizer built before patching keeps working and a baseline
checkpoint loads with ``strict=True``. `PatchReport.undo` (or `revert_kernels`) restores the original modules and
forwards. diffusers and timm are never imported here: their classes are looked up only if already loaded.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from gallery_lib.accel.kernels.conv_bn_block import bottleneck_forward, bottleneck_problem
from gallery_lib.accel.kernels.modules import FusedGEGLU, FusedGroupNorm, FusedLayerNorm


@dataclass
class PatchReport:
    """What `apply_kernels` changed: ``swapped`` as (qualified name, kind), ``skipped`` as (name, reason)."""

    swapped: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    _undo_steps: list[Callable[[], None]] = field(default_factory=list, repr=False)
    undone: bool = False

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(kind for _, kind in self.swapped))

    def undo(self) -> None:
        """Restore every swapped module and overridden forward (idempotent)."""
        for step in reversed(self._undo_steps):
            step()
        self._undo_steps.clear()
        self.undone = True

    def summary(self, verbose: bool = False) -> str:
        """One line of swaps, and one per reason a module was left alone (how many, the first of them), so a run's
        log stays readable; ``verbose`` lists every module left alone, as ``skipped`` has them."""
        lines = [f"swapped {len(self.swapped)}: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))]
        if verbose:
            return "\n".join(lines + [f"  left alone {name}: {reason}" for name, reason in self.skipped])
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.skipped:
            by_reason.setdefault(reason, []).append(name)
        lines += [f"  left alone {len(names)} module{'s' if len(names) > 1 else ''} ({reason}), e.g. {names[0]}"
                  for reason, names in by_reason.items()]
        return "\n".join(lines)


def _loaded_class(module_name: str, class_name: str) -> type | None:
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if module is not None else None


def _resnet_block_forward(self: nn.Module, input_tensor: torch.Tensor, temb: torch.Tensor | None,
                          *args, **kwargs) -> torch.Tensor:
    """diffusers ``ResnetBlock2D.forward`` with ``norm1``/``norm2`` already applying SiLU (see module docstring)."""
    hidden = self.norm1(input_tensor)  # GroupNorm + SiLU
    if self.upsample is not None:
        if hidden.shape[0] >= 64:  # diffusers' workaround for nearest upsampling of large NHWC batches
            input_tensor, hidden = input_tensor.contiguous(), hidden.contiguous()
        input_tensor, hidden = self.upsample(input_tensor), self.upsample(hidden)
    elif self.downsample is not None:
        input_tensor, hidden = self.downsample(input_tensor), self.downsample(hidden)
    hidden = self.conv1(hidden)
    if self.time_emb_proj is not None:
        if not self.skip_time_act:
            temb = self.nonlinearity(temb)
        temb = self.time_emb_proj(temb)[:, :, None, None]
    if self.time_embedding_norm == "default":
        if temb is not None:
            hidden = hidden + temb
        hidden = self.norm2(hidden)  # GroupNorm + SiLU
    else:  # scale_shift: the SiLU comes after the modulation, so norm2 is a plain fused GroupNorm
        if temb is None:
            raise ValueError("`temb` should not be None when `time_embedding_norm` is scale_shift")
        scale, shift = torch.chunk(temb, 2, dim=1)
        hidden = self.nonlinearity(self.norm2(hidden) * (1 + scale) + shift)
    hidden = self.conv2(self.dropout(hidden))
    if self.conv_shortcut is not None:
        input_tensor = self.conv_shortcut(input_tensor.contiguous() if self.training else input_tensor)
    return (input_tensor + hidden) / self.output_scale_factor


_RESNET_ATTRS = ("norm1", "norm2", "conv1", "conv2", "nonlinearity", "time_emb_proj", "time_embedding_norm",
                 "skip_time_act", "upsample", "downsample", "dropout", "conv_shortcut", "output_scale_factor")


def _resnet_block_problem(block: nn.Module) -> str | None:
    missing = [a for a in _RESNET_ATTRS if not hasattr(block, a)]
    if missing:
        return f"ResnetBlock2D without {missing} (unsupported diffusers version)"
    if "forward" in vars(block):
        return "forward already overridden on this instance"
    if type(block.norm1) is not nn.GroupNorm or type(block.norm2) is not nn.GroupNorm:
        return "norm1/norm2 are not plain nn.GroupNorm"
    if type(block.nonlinearity) is not nn.SiLU:
        return f"nonlinearity is {type(block.nonlinearity).__name__}, not SiLU"
    if block.time_embedding_norm not in ("default", "scale_shift"):
        return f"time_embedding_norm={block.time_embedding_norm!r}"
    return None


class _Patcher:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.report = PatchReport()
        self.replacements: dict[int, tuple[nn.Module, str]] = {}  # id(old) -> (new module, kind)
        self.names = {id(m): name or "<root>" for name, m in model.named_modules(remove_duplicate=False)}
        self.handled: set[int] = set()  # modules a row above has swapped already (a block's own norms)

    def replace(self, old: nn.Module, new: nn.Module, kind: str) -> None:
        self.replacements[id(old)] = (new, kind)
        self.report.swapped.append((self.names[id(old)], kind))

    def commit(self) -> None:
        """Swap every replaced module at each place it is attached (shared modules included)."""
        for parent in list(self.model.modules()):
            for attr, child in list(parent._modules.items()):
                if child is not None and id(child) in self.replacements:
                    parent._modules[attr] = self.replacements[id(child)][0]
                    self.report._undo_steps.append(lambda p=parent, a=attr, c=child: p._modules.__setitem__(a, c))

    def override_forward(self, module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
        # A partial of a module-level function, not a bound method: a bound method pickles as getattr(module,
        # "_resnet_block_forward"), which fails to load (precompile workers and checkpoints of whole modules).
        module.forward = functools.partial(forward, module)
        self.report._undo_steps.append(lambda m=module: vars(m).pop("forward", None))


@dataclass(frozen=True)
class _LoadedClasses:
    """The diffusers and timm classes the table matches, those already imported (never imported here)."""

    resnet_block: type | None
    unet: type | None
    geglu: type | None
    bottleneck: type | None
    layer_norms: tuple[type, ...]

    @classmethod
    def now(cls) -> _LoadedClasses:
        timm_layer_norm = _loaded_class("timm.layers.norm", "LayerNorm")
        return cls(resnet_block=_loaded_class("diffusers.models.resnet", "ResnetBlock2D"),
                   unet=_loaded_class("diffusers.models.unets.unet_2d_condition", "UNet2DConditionModel"),
                   geglu=_loaded_class("diffusers.models.activations", "GEGLU"),
                   bottleneck=_loaded_class("timm.models.resnet", "Bottleneck"),
                   layer_norms=tuple(t for t in (nn.LayerNorm, timm_layer_norm) if t is not None))


def _fuse_resnet_block(patcher: _Patcher, name: str, block: nn.Module, classes: _LoadedClasses) -> None:
    if problem := _resnet_block_problem(block):
        patcher.report.skipped.append((name, f"GroupNorm+SiLU not fused: {problem}"))
        return
    silu2 = "silu" if block.time_embedding_norm == "default" else None
    patcher.replace(block.norm1, FusedGroupNorm.from_module(block.norm1, "silu"), "group_norm_silu")
    patcher.replace(block.norm2, FusedGroupNorm.from_module(block.norm2, silu2),
                    "group_norm_silu" if silu2 else "group_norm")
    patcher.override_forward(block, _resnet_block_forward)
    patcher.handled.update({id(block.norm1), id(block.norm2)})


def _fuse_unet_output_norm(patcher: _Patcher, name: str, unet: nn.Module, classes: _LoadedClasses) -> None:
    norm, act = getattr(unet, "conv_norm_out", None), getattr(unet, "conv_act", None)
    if type(norm) is nn.GroupNorm and type(act) is nn.SiLU:
        patcher.replace(norm, FusedGroupNorm.from_module(norm, "silu"), "group_norm_silu")
        patcher.replace(act, nn.Identity(), "silu_folded")
        patcher.handled.update({id(norm), id(act)})


def _fuse_group_norm(patcher: _Patcher, name: str, norm: nn.Module, classes: _LoadedClasses) -> None:
    if type(norm) is not nn.GroupNorm:
        patcher.report.skipped.append((name, f"subclass {type(norm).__name__} may change forward"))
    else:
        patcher.replace(norm, FusedGroupNorm.from_module(norm), "group_norm")


def _fuse_layer_norm(patcher: _Patcher, name: str, norm: nn.Module, classes: _LoadedClasses) -> None:
    if type(norm) not in classes.layer_norms:
        patcher.report.skipped.append((name, f"subclass {type(norm).__name__} may change forward"))
    elif len(norm.normalized_shape) != 1:
        patcher.report.skipped.append((name, f"normalizes over {norm.normalized_shape}, not the last dim only"))
    else:
        patcher.replace(norm, FusedLayerNorm.from_module(norm), "layer_norm")


def _fold_bottleneck_norms(patcher: _Patcher, name: str, block: nn.Module, classes: _LoadedClasses) -> None:
    if problem := bottleneck_problem(block):
        patcher.report.skipped.append((name, f"norms not folded into the convolutions: {problem}"))
    else:
        patcher.override_forward(block, bottleneck_forward)
        patcher.report.swapped.append((name, "conv_bn_relu"))


def _fuse_geglu(patcher: _Patcher, name: str, geglu: nn.Module, classes: _LoadedClasses) -> None:
    patcher.replace(geglu, FusedGEGLU.from_module(geglu), "geglu")


@dataclass(frozen=True)
class KernelSwap:
    """One row of the table: a module that ``matches`` gets ``swap`` when kernel op ``op`` is on."""

    op: str
    matches: Callable[[nn.Module, _LoadedClasses], bool]
    swap: Callable[[_Patcher, str, nn.Module, _LoadedClasses], None]
    notes_when_off: bool = True
    """With ``op`` off: record "``op``=False" and stop at this row; ``False`` lets the rows below try the module."""


KERNEL_SWAPS: tuple[KernelSwap, ...] = (  # the first row that matches a module decides, in this order
    KernelSwap("group_norm_silu", lambda m, c: type(m) is c.resnet_block, _fuse_resnet_block, notes_when_off=False),
    KernelSwap("group_norm_silu", lambda m, c: type(m) is c.unet, _fuse_unet_output_norm, notes_when_off=False),
    KernelSwap("group_norm_silu", lambda m, c: isinstance(m, nn.GroupNorm), _fuse_group_norm),
    KernelSwap("layer_norm", lambda m, c: isinstance(m, nn.LayerNorm), _fuse_layer_norm),
    KernelSwap("conv_bn_relu", lambda m, c: type(m) is c.bottleneck, _fold_bottleneck_norms),
    KernelSwap("geglu", lambda m, c: type(m) is c.geglu, _fuse_geglu),
)
KERNEL_OPS = tuple(dict.fromkeys(row.op for row in KERNEL_SWAPS))
"""The ops ``RunConfig.kernel_ops`` names (``tests/test_patch.py`` checks that the config offers these)."""


def apply_kernels(model: nn.Module, *, group_norm_silu: bool = True, layer_norm: bool = True,
                  geglu: bool = True, conv_bn_relu: bool = False) -> PatchReport:
    """Swap ``model``'s layers for fused ones in place and return what changed.

    Args:
        model: any module tree (diffusers UNet, timm Swin/ResNet, plain modules).
        group_norm_silu: GroupNorm -> `FusedGroupNorm`, fusing the SiLU that follows in diffusers' blocks.
        layer_norm: last-dim LayerNorm -> `FusedLayerNorm`.
        geglu: diffusers ``GEGLU`` -> `FusedGEGLU`.
        conv_bn_relu: timm ``Bottleneck`` -> `bottleneck_forward` (norms folded into the convolutions).

    Returns:
        A `PatchReport`; ``report.undo()`` restores the original modules.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_kernels expects an nn.Module instance, got {type(model).__name__}")
    switched_on = {"group_norm_silu": group_norm_silu, "layer_norm": layer_norm, "geglu": geglu,
                   "conv_bn_relu": conv_bn_relu}
    patcher, classes = _Patcher(model), _LoadedClasses.now()
    for name, module in model.named_modules():
        name = name or "<root>"
        if id(module) in patcher.handled:
            continue
        for row in KERNEL_SWAPS:
            if not row.matches(module, classes):
                continue
            if switched_on[row.op]:
                row.swap(patcher, name, module, classes)
            elif row.notes_when_off:
                patcher.report.skipped.append((name, f"{row.op}=False"))
            else:
                continue
            break
    patcher.commit()
    return patcher.report


def revert_kernels(model: nn.Module, report: PatchReport) -> nn.Module:
    """Undo `apply_kernels` on ``model`` (same as ``report.undo()``); returns the model."""
    report.undo()
    return model
