"""Registers this source tree's entry points (its model families, its dynamo backend) in a ``--target`` site folder,
for the GPU machine, where the gallery runs from the copied tree on ``PYTHONPATH`` without ``pip install -e .``.

    python3 benchmarks/device_site.py /tmp/site   (the device scripts run it after installing .whl/)
"""

import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parents[1]
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"gallery_lib-{project.get('version', '0')}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project.get('version', '0')}\n")
groups = project.get("entry-points", {}) | {"console_scripts": project.get("scripts", {})}
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
    for group, entries in groups.items() if entries))
print(f"device_site: {info.name} registers {', '.join(groups)}")
