"""The SD transformer block's NaN gradients on an AVX-512 CPU, with torch alone (torch 2.14.1, GCC 12.2).

    python nan_grads_repro.py            # compiled gradients: NaN or garbage where AVX-512 C++ is generated
    python nan_grads_repro.py --simdlen 256    # AVX2-width code: the gradients match eager's
    python nan_grads_repro.py --tiles    # the four-line function behind it, without autograd

TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 keeps an earlier run's compiled code out (its cache key does not change with
ATEN_CPU_CAPABILITY).
"""
import sys

import torch
import torch.nn.functional as F

if "--simdlen" in sys.argv:
    torch._inductor.config.cpp.simdlen = int(sys.argv[sys.argv.index("--simdlen") + 1])
torch.manual_seed(0)

if "--tiles" in sys.argv:
    def tiles(c, a, b):  # a and b channels-last, c and the output contiguous: two tile transposes in one kernel
        return (c.float() + a.float() * 2 + b.float()).to(torch.bfloat16)
    c = torch.randn(2, 64, 8, 8, dtype=torch.bfloat16)
    a, b = (torch.randn(2, 64, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
            for _ in range(2))
    out = torch.compile(tiles)(c, a, b)
    print("elements that differ from eager:", (out != tiles(c, a, b)).sum().item(), "of", out.numel())
    sys.exit()

# Group norm, then a 1x1 convolution, plus the residual: the entry of every diffusers Transformer2DModel.
gn_w, gn_b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
conv_w = torch.randn(64, 64, 1, 1, requires_grad=True)


def block(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.conv2d(F.group_norm(x, 8, gn_w, gn_b, 1e-6), conv_w) + x


def input_grad(fn):
    x = torch.randn(4, 64, 8, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    fn(x).float().square().sum().backward()
    return x.grad


eager, compiled = input_grad(block), input_grad(torch.compile(block))
print("non-finite input gradients:", (~torch.isfinite(compiled)).sum().item(), "of", compiled.numel(),
      "| largest difference from eager:", (compiled.float() - eager.float()).abs().max().item())
