"""Fused kernels for memory-bound ops: GroupNorm(+SiLU), LayerNorm, the GEGLU gate, soft-target cross-entropy.

The package has three floors, and its modules import down them only:

1. the ops, one module each (``geglu``, ``group_norm``, ``layer_norm``, ``cross_entropy``, ``conv_bn``,
   ``ema_lerp``, ``adamw_ema``, ``window_attention``; ``_triton_utils`` under them): the kernel functions with
   their autograd and PyTorch reference. The four layer ops, the Triton switches and ``dense`` (the layouts read
   as flat memory) are importable from here;
2. the layers built from them: ``modules`` (``FusedGroupNorm``, ``FusedLayerNorm``, ``FusedGEGLU``) and
   ``conv_bn_block`` (timm's ResNet bottleneck with its norms folded into the convolutions);
3. ``patch``: the table of swaps (``KERNEL_SWAPS``) that puts those layers in a model, and ``apply_kernels``.

The rest of the library calls the ops, layers and switches by these names, never ``_triton_utils`` itself.

Each op is a ``torch.library`` op (``gallery::*``, a ``triton_op`` on torch >= 2.6) with a fake implementation
and registered autograd, so ``torch.compile`` traces it without a graph break. How a call is served:

* CUDA tensors: the Triton forward/backward kernels;
* CPU tensors with ``TRITON_INTERPRET=1`` set (read at call time): the same kernels under Triton's interpreter,
  which is how CPU CI checks the kernel logic;
* anything else, or inside ``set_triton_enabled(False)``: the PyTorch reference in the same file, written with
  the same math (fp32 statistics, output in the input dtype), so results match the kernels to rounding.

``conv_bn`` is the one op that is not Triton: a convolution with the batch norms around it folded in, run by cuDNN's
runtime fusion through its Python frontend (``gallery::scale_bias_relu_conv``), with the same reference fallback.
"""

from gallery_lib.accel.kernels._triton_utils import (dense, has_triton, is_triton_enabled, set_triton_enabled,
                                                     sm_count, use_triton)
from gallery_lib.accel.kernels.cross_entropy import soft_cross_entropy
from gallery_lib.accel.kernels.geglu import geglu
from gallery_lib.accel.kernels.group_norm import group_norm
from gallery_lib.accel.kernels.layer_norm import layer_norm

__all__ = [
    "dense",
    "geglu",
    "group_norm",
    "has_triton",
    "is_triton_enabled",
    "layer_norm",
    "set_triton_enabled",
    "sm_count",
    "soft_cross_entropy",
    "use_triton",
]
