"""Seconds of the first call of SD-1.5's attention and convolutions at batch 32 (forward and backward), against the
second: what a machine's first run pays once, and whether the CUDA driver's JIT cache (``CUDA_CACHE_PATH``) keeps
it for the next process (benchmarks/RESULTS.md#precompile-loading).

    CUDA_CACHE_PATH=/tmp/jit python benchmarks/archive/jit_first_use.py --stages attn_cudnn,attn_flash,conv --out R.json
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH = 32
ATTENTION = [(4096, 4096, 40), (4096, 77, 40), (1024, 1024, 80), (1024, 77, 80), (256, 256, 160), (256, 77, 160),
             (64, 64, 160), (64, 77, 160)]  # (query tokens, key tokens, head dim), 8 heads
CONV = [(320, 320, 64), (320, 640, 32), (640, 640, 32), (640, 1280, 16), (1280, 1280, 16), (1280, 1280, 8),
        (2560, 1280, 8), (1920, 640, 16), (960, 320, 32), (640, 320, 64)]  # (in, out, side), 3x3


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def attention(backend: SDPBackend):
    def run(shape):
        q_len, k_len, dim = shape
        q = torch.randn(BATCH, 8, q_len, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(BATCH, 8, k_len, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v).sum().backward()
    return run


def conv(shape):
    cin, cout, side = shape
    x = torch.randn(BATCH, cin, side, side, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True).contiguous(memory_format=torch.channels_last)
    w = torch.randn(cout, cin, 3, 3, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True).contiguous(memory_format=torch.channels_last)
    F.conv2d(x, w, padding=1).sum().backward()


STAGES = {"attn_cudnn": (attention(SDPBackend.CUDNN_ATTENTION), ATTENTION),
          "attn_flash": (attention(SDPBackend.FLASH_ATTENTION), ATTENTION),
          "attn_efficient": (attention(SDPBackend.EFFICIENT_ATTENTION), ATTENTION), "conv": (conv, CONV)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="attn_cudnn,conv")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.zeros(1, device="cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "jit_cache": os.environ.get("CUDA_CACHE_PATH", "~/.nv/ComputeCache"), "stages": {}}
    for stage in args.stages.split(","):
        fn, shapes = STAGES[stage]
        first = [timed(lambda: fn(s)) for s in shapes]
        second = [timed(lambda: fn(s)) for s in shapes]
        result["stages"][stage] = {"first_s": sum(first), "second_s": sum(second),
                                   "first_per_shape_s": [round(t, 3) for t in first]}
        print(f"{stage}: first calls {sum(first):.2f} s, second {sum(second):.2f} s, per shape "
              f"{[round(t, 2) for t in first]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
