"""Runs a command and prints each line of its output with the seconds since the start: where a run's time goes.

    python benchmarks/stamp_lines.py python benchmarks/bench_ladder.py --profile full --rungs loader > stamped.log
"""

import subprocess
import sys
import time

start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
for line in proc.stdout:
    print(f"{time.perf_counter() - start:7.1f} {line.rstrip()}", flush=True)
sys.exit(proc.wait())
