"""Stands a big GPU in for a smaller card: holds all but FREE_GIB of the GPU's free memory in a process of its own
until killed, so that every process started after it (a notebook's kernel, its runs, their precompile workers)
shares what the smaller card leaves free, as on that card. A per-process cap (``--gpu-memory-gib``) gives each
process a share of its own instead, so it cannot show one process's memory taken from another's.

    python3 benchmarks/gpu_ballast.py 21.2 &   # an A10G's free memory (README's card tables)
"""
import sys
import time

import torch

free_gib = float(sys.argv[1])
free, _ = torch.cuda.mem_get_info()
hold = free - int(free_gib * 2**30)
if hold <= 0:
    sys.exit(f"gpu_ballast: only {free / 2**30:.1f} GiB free, not more than {free_gib} GiB: nothing to hold")
ballast = torch.empty(hold, dtype=torch.uint8, device="cuda")
print(f"gpu_ballast: holding {hold / 2**30:.1f} GiB, {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB left free",
      flush=True)
while True:
    time.sleep(3600)
