# The memory plan under a cap, as on a smaller GPU: `gallery run` of one model's recipes with --gpu-memory-gib CAP,
# the card's memory sampled by nvidia-smi beside it. $OUT gets the log, every run's summary and failure, and a header
# (command, commit, source hash, torch, GPU). CAPS_TIMEOUT_S stops the runs in time for the summary within one call.
#   bash benchmarks/gpu_memory_caps.sh NAME CAP [gallery run flags...]   (on the GPU machine; diffusers in .whl/)
#   e.g. GALLERY_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_memory_caps.sh sd_22 22 --model sd15 --steps 12
name=$1; cap=$2; shift 2
# cuDNN's frontend too, for ResNet-50's conv_bn_relu kernel (.whl/cudnn, as benchmarks/gpu_tests.sh installs it)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl/cudnn/*.whl 2>/dev/null)
python3 benchmarks/device_site.py /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
runs=/tmp/caps_$name
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$out/smi_$name.csv" 2>&1 &
sampler=$!
start=$SECONDS
(mkdir -p /tmp/work && cd /tmp/work && timeout "${CAPS_TIMEOUT_S:-86400}" python3 -m gallery_lib.app.cli run --profile full --gpu-memory-gib "$cap" \
  --output-dir "$runs" "$@") > "$out/run_$name.log" 2>&1
code=$?
kill "$sampler" 2>/dev/null
python3 - "$out/caps_$name.json" "$runs" "$cap" "$code" "$((SECONDS - start))" "$*" <<'PY'
import glob, json, os, sys, torch
from gallery_lib.reports.provenance import source_version
path, runs, cap, code, seconds, flags = sys.argv[1:]
record = {"command": f"bash benchmarks/gpu_memory_caps.sh {os.path.basename(runs)[5:]} {cap} {flags}",
          **source_version(), "cap_gib": float(cap), "exit_code": int(code), "wall_s": int(seconds),
          "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "runs": {}}
for run_dir in sorted(glob.glob(f"{runs}/*/*/")):
    name = os.path.basename(run_dir.rstrip("/"))
    entry = {}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        lines = [json.loads(l) for l in open(metrics) if l.strip()]
        summary = next((l for l in reversed(lines) if l.get("type") == "summary"), None)
        if summary:
            entry = {k: summary.get(k) for k in ("samples_per_s", "median_step_time_ms", "p20_step_time_ms",
                     "p80_step_time_ms", "peak_mem_mb", "peak_reserved_mb", "global_batch_size", "memory_plan",
                     "final_loss", "warmup_time_s", "precompile_time_s", "steps")}
        entry["losses"] = [l.get("loss") for l in lines if l.get("type") == "step"]
    failure = os.path.join(run_dir, "failure.json")
    if os.path.exists(failure):
        entry["failure"] = json.load(open(failure))
    record["runs"][name] = entry
json.dump(record, open(path, "w"), indent=1)
for name, entry in record["runs"].items():
    plan = (entry.get("memory_plan") or {}).get("note", "")
    print(name, entry.get("samples_per_s"), (entry.get("peak_reserved_mb") or 0) / 1024, plan, entry.get("failure"))
PY
grep "memory plan\|\[gallery\] [a-z]*: \|stopped\|Error" "$out/run_$name.log" | tail -30
# where each attempt ran out of memory: its rank log's error lines (the retries' logs stay on the machine)
grep -rh "out of memory\|OutOfMemoryError" "$runs" --include="rank*.log" | cut -c1-400 | sort | uniq -c | tee "$out/oom_$name.txt"
