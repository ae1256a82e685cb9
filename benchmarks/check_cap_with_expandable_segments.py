"""Whether a per-process cap (``torch.cuda.set_per_process_memory_fraction``) holds with the CUDA allocator's
expandable segments: allocates 256 MiB blocks under a 4 GiB cap until out of memory and prints what was reserved.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/check_cap_with_expandable_segments.py
"""

import json
import os
import sys

import torch

from gallery_lib.reports.provenance import source_version

CAP_GIB = 4.0
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total, 0)
blocks = []
try:
    while len(blocks) < 64:
        blocks.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
    stopped = "no out-of-memory error"
except torch.OutOfMemoryError:
    stopped = "out of memory"
print(json.dumps({**source_version(), "command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
                  "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "cap_gib": CAP_GIB, "stopped": stopped,
                  "allocated_gib": len(blocks) * 0.25,
                  "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}))
