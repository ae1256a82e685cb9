"""Runs a notebook's code cells in this process, its parameters cell overridden: the GPU machine has no Jupyter.

    cd notebooks && python3 ../benchmarks/run_notebook_code.py your_model.ipynb '{"profile": "full"}'

Run from the notebook's folder (its relative paths are its own); a last line `ladder` prints the ladder's table.
Each cell's wall time goes to the log after it (``[cell 7: 123.4 s] <its first line>``), so a run stopped by a
time limit shows where its time went.
"""
import json
import sys
import time

path, params = sys.argv[1], json.loads(sys.argv[2])
cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
scope = {"display": print}
for number, cell in enumerate(cells, 1):
    start = time.perf_counter()
    source = "".join(cell["source"])
    if "parameters" in cell.get("metadata", {}).get("tags", []):
        exec(source, scope)
        scope.update(params)
        continue
    lines = source.rstrip().splitlines()
    if lines and lines[-1].strip() == "ladder":
        lines[-1] = "print(ladder.to_markdown())"
    exec("\n".join(lines), scope)
    first = next((line.strip() for line in lines if line.strip()), "")
    print(f"[cell {number}: {time.perf_counter() - start:.1f} s] {first[:80]}", flush=True)
