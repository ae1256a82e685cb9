"""timm's ResNet ``Bottleneck`` with its batch norms folded into the convolutions around them: on the kernels
package's middle floor with ``modules.py``, a layer built from the ``conv_bn`` op that the swap table (``patch.py``)
puts in a model.

`bottleneck_forward` computes what ``Bottleneck.forward`` computes, in training and in eval mode, with the same
parameters and running statistics:

* ``conv1`` runs as it is; its output's channel sums (one fused reduction) give ``bn1``'s statistics;
* ``conv2`` and ``conv3`` are `gallery_lib.accel.kernels.conv_bn.scale_bias_relu_conv`: each applies the previous
  norm and ReLU as it reads its input and returns its output's sums, from which the next norm's statistics come;
* ``bn3``, the residual add and the last ReLU are one elementwise expression, which ``torch.compile`` fuses.

Batch statistics come from sums and sums of squares in fp32 (mean = S/n, var = Q/n - mean^2), the way cuDNN's
fused norms compute them, instead of PyTorch's Welford; the running averages are updated as ``nn.BatchNorm2d``
updates them (unbiased variance, ``momentum``, ``num_batches_tracked``).
"""

from __future__ import annotations

import torch
from torch import nn

from gallery_lib.accel.kernels.conv_bn import scale_bias_relu_conv


def bottleneck_problem(block: nn.Module) -> str | None:
    """Why ``block`` (a timm ``Bottleneck``) cannot run `bottleneck_forward`, or ``None`` when it can."""
    if "forward" in vars(block):
        return "forward already overridden on this instance"
    for name in ("bn1", "bn2", "bn3"):
        norm = getattr(block, name, None)
        if type(norm) is not nn.BatchNorm2d or not norm.affine:
            return f"{name} is {type(norm).__name__}, not an affine nn.BatchNorm2d"
    for name in ("act1", "act2", "act3"):
        if type(getattr(block, name, None)) is not nn.ReLU:
            return f"{name} is not nn.ReLU"
    for name in ("drop_block", "aa"):
        if type(getattr(block, name, None)) is not nn.Identity:
            return f"{name} is not nn.Identity"
    if block.se is not None or block.drop_path is not None:
        return "has squeeze-excitation or drop path"
    for name in ("conv1", "conv2", "conv3"):
        conv = getattr(block, name)
        square = not isinstance(conv.padding, str) and len(set(conv.padding)) == 1 and len(set(conv.stride)) == 1
        if conv.groups != 1 or conv.bias is not None or set(conv.dilation) != {1} or not square:
            return f"{name} is grouped, dilated, biased or not square"
    return None


def channel_sums(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum and sum of squares of ``y`` in fp32."""
    yf = y.float()
    return yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))


def norm_scale_bias(norm: nn.BatchNorm2d, sums: torch.Tensor, squares: torch.Tensor,
                    count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm`` as a per-channel ``(scale, bias)`` in fp32: from the batch's sums in training (updating the running
    averages as ``nn.BatchNorm2d`` does), from the running averages in eval."""
    if norm.training or not norm.track_running_stats:
        mean = sums / count
        var = (squares / count - mean * mean).clamp_min(0)
        if norm.training and norm.track_running_stats:
            with torch.no_grad():
                norm.num_batches_tracked.add_(1)
                momentum = norm.momentum if norm.momentum is not None else 1 / float(norm.num_batches_tracked)
                norm.running_mean.lerp_(mean.detach().to(norm.running_mean.dtype), momentum)
                unbiased = var.detach() * (count / max(count - 1, 1))
                norm.running_var.lerp_(unbiased.to(norm.running_var.dtype), momentum)
    else:
        mean, var = norm.running_mean.float(), norm.running_var.float()
    scale = norm.weight.float() * torch.rsqrt(var + norm.eps)
    return scale, norm.bias.float() - mean * scale


def _count(y: torch.Tensor) -> int:
    return y.shape[0] * y.shape[2] * y.shape[3]


def bottleneck_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm ``Bottleneck.forward`` with the norms folded into the convolutions (see the module docstring)."""
    shortcut = x
    y1 = self.conv1(x)
    scale1, bias1 = norm_scale_bias(self.bn1, *channel_sums(y1), _count(y1))
    y2, sums2, squares2 = scale_bias_relu_conv(y1, scale1, bias1, self.conv2.weight.to(y1.dtype),
                                               self.conv2.stride[0], self.conv2.padding[0])
    scale2, bias2 = norm_scale_bias(self.bn2, sums2, squares2, _count(y2))
    y3, sums3, squares3 = scale_bias_relu_conv(y2, scale2, bias2, self.conv3.weight.to(y2.dtype),
                                               self.conv3.stride[0], self.conv3.padding[0])
    scale3, bias3 = norm_scale_bias(self.bn3, sums3, squares3, _count(y3))
    out = (y3.float() * scale3.view(1, -1, 1, 1) + bias3.view(1, -1, 1, 1)).to(y3.dtype)
    if self.downsample is not None:
        shortcut = self.downsample(shortcut)
    return torch.relu(out + shortcut)
