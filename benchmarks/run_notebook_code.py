"""Runs a notebook's code cells in this process, its parameters cell overridden: the GPU machine has no Jupyter.

    cd notebooks && python3 ../benchmarks/run_notebook_code.py your_model.ipynb '{"profile": "full"}'

Run from the notebook's folder (its relative paths are its own); a last line `ladder` prints the ladder's table.
"""
import json
import sys

path, params = sys.argv[1], json.loads(sys.argv[2])
cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
scope = {"display": print}
for cell in cells:
    source = "".join(cell["source"])
    if "parameters" in cell.get("metadata", {}).get("tags", []):
        exec(source, scope)
        scope.update(params)
        continue
    lines = source.rstrip().splitlines()
    if lines and lines[-1].strip() == "ladder":
        lines[-1] = "print(ladder.to_markdown())"
    exec("\n".join(lines), scope)
