#!/usr/bin/env bash
# The CPU gallery from a fresh clone, timed: clones this repo's HEAD, runs `bash ci/gallery.sh` with empty caches
# (uv's, Inductor's, the precompiled C++ headers Inductor keeps under $TMPDIR, and the user cache where `optimize`
# keeps its choices: a second run skips the ResNet-50 notebook's trials), and writes
# benchmarks/results/cpu_gallery/gallery_<commit>.txt (the command, the CPU and its vector flags, every notebook's
# time, every run's wall, steps, warm-up and compile line, each notebook's slowest cells).
#
#   bash benchmarks/cpu_gallery.sh [WORK_DIR]       (default /tmp/cpu_gallery; nothing else should run beside it)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/cpu_gallery}
commit=$(git -C "$repo" rev-parse --short HEAD)
rm -rf "$work" && mkdir -p "$work/uv" "$work/inductor" "$work/tmp" "$work/user_cache"
git clone -q "$repo" "$work/clone"
started=$(date -u "+%H:%M:%S UTC %Y-%m-%d")
start=$(date +%s)
(cd "$work/clone" && UV_CACHE_DIR="$work/uv" TORCHINDUCTOR_CACHE_DIR="$work/inductor" TMPDIR="$work/tmp" \
  XDG_CACHE_HOME="$work/user_cache" \
  /usr/bin/time -f "%U %S" -o "$work/cpu_time" bash ci/gallery.sh > "$work/gallery.log" 2>&1)
code=$?
wall=$(( $(date +%s) - start ))
out="$repo/benchmarks/results/cpu_gallery/gallery_$commit.txt"
# the record, from the clone's output, its log and its CPU time
python3 - "$work" "$commit" "$started" "$code" "$wall" > "$out" <<'EOF'
import glob, json, os, re, subprocess, sys
from datetime import datetime

work, commit, started, code, wall = sys.argv[1:6]
clone = os.path.join(work, "clone")
user, system = open(os.path.join(work, "cpu_time")).read().split()[-2:]
flags = open("/proc/cpuinfo").read().split("flags\t\t: ", 1)[1].split("\n", 1)[0].split()
model = re.search(r"model name\s*: (.*)", open("/proc/cpuinfo").read()).group(1).strip()
vector = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni")]
print("# command: bash benchmarks/cpu_gallery.sh (git clone <repo>; UV_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, TMPDIR and "
      "XDG_CACHE_HOME empty folders; bash ci/gallery.sh)")
print(f"# commit {commit} (clean clone); started {started}; exit {code}, wall {wall} s "
      f"({int(wall) // 60} min {int(wall) % 60} s), set-up included; CPU time {user} user {system} sys")
torch = subprocess.run([os.path.join(clone, ".venv", "bin", "python"), "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True).stdout.strip()
isa = "with AVX-512" if any(f.startswith("avx512") for f in flags) else "without AVX-512"
print(f"# machine: {os.cpu_count()} cores ({model} {isa}, vector flags: {' '.join(vector)}), no GPU; torch {torch}")
log = open(os.path.join(work, "gallery.log")).read().splitlines()
print("\n## the run's notebook lines")
print("\n".join(line for line in log if "[notebooks]" in line or "torch " in line[:60]))
print("\n## every run's wall, steps and warm-up (s), and its compile line")
rows = []
for metrics in glob.glob(os.path.join(clone, "output", "**", "metrics.jsonl"), recursive=True):
    run = os.path.dirname(metrics)
    log_path = os.path.join(run, "logs", "rank0.log")
    lines = [json.loads(line) for line in open(metrics)]
    summary = next((line for line in lines if line["type"] == "summary"), {})
    steps = sum(line["step_time_ms"] for line in lines if line["type"] == "step") / 1000
    run_wall = os.path.getmtime(log_path) - os.path.getmtime(os.path.join(run, "config.json"))
    compiled = re.findall(r"compilation in this run: (.*)", open(log_path).read())
    name = os.path.relpath(run, os.path.join(clone, "output"))
    rows.append((summary.get("warmup_time_s", 0.0), run_wall, steps, name, compiled[-1] if compiled else "-"))
for warm, run_wall, steps, name, compiled in sorted(rows, reverse=True):
    print(f"{run_wall:7.1f} {steps:7.1f} {warm:7.1f}  {name}: {compiled}")
print("\n## each notebook's cells over 3 s (papermill's times)")
for path in sorted(glob.glob(os.path.join(clone, "output", "notebooks", "*.ipynb"))):
    cells = json.load(open(path))["cells"]
    for index, cell in enumerate(cells):
        times = cell.get("metadata", {}).get("papermill", {})
        if times.get("start_time") and times.get("end_time"):
            took = (datetime.fromisoformat(times["end_time"])
                    - datetime.fromisoformat(times["start_time"])).total_seconds()
            if took > 3:
                first = "".join(cell["source"]).strip().split("\n")[0][:70]
                print(f"{os.path.basename(path)} cell {index}: {took:.1f} s  {first}")
EOF
echo "[cpu_gallery] exit $code in $wall s -> $out"
