"""What a compiled recipe's memory-plan tries cost in compilation: the plan's training process tries its settings one
after another, batch sizes falling, and resets Dynamo between tries (``run/batch_size.py``), so each try compiles
anew. Here a small MLP compiled with Inductor on a CPU takes one forward and backward at each batch size, Dynamo
reset between them as there: with torch's defaults, and with a profile-guided job id
(``torch.compiler.config.job_id``), under which Dynamo keeps what it saw across the reset, so from the second try
on the batch is symbolic and later tries load the graphs from Inductor's caches.

    python benchmarks/probe_compile_tries.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time




def tries(job_id: str | None, sizes: tuple[int, ...]) -> list[dict]:
    """Seconds of each try's first step and Inductor's FX-graph cache hits so far, in a fresh cache folder."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compiler.config.job_id = job_id
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    rows = []
    try:
        for size in sizes:
            compiled = torch.compile(model)
            start = time.perf_counter()
            compiled(torch.randn(size, 64)).sum().backward()
            rows.append({"batch": size, "first_step_s": round(time.perf_counter() - start, 2),
                         "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"]})
            torch._dynamo.reset()
    finally:
        torch.compiler.config.job_id = None
    return rows


JOB_IDS = {"defaults": None, "job_id": "gallery-probe-compile-tries"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--one", choices=JOB_IDS, help=argparse.SUPPRESS)  # one way, in a process of its own
    args = parser.parse_args()
    sizes = (48, 24, 16, 12, 8)
    if args.one:
        print(json.dumps(tries(JOB_IDS[args.one], sizes)))
        return
    from gallery_lib.reports.provenance import write_result

    runs = {}
    for name in JOB_IDS:
        with tempfile.TemporaryDirectory() as cache:  # each in a fresh process, from a cold cache
            done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                  env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}, check=True)
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, runs[name], flush=True)
    write_result(args.out, probe="compile cost of the memory plan's tries", device="cpu", tries=runs)


if __name__ == "__main__":
    main()
