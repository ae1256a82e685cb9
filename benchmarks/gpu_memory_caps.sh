# The memory plan under a cap, as on a smaller GPU: `gallery run` of one model's recipes with --gpu-memory-gib CAP,
# the card's memory sampled by nvidia-smi beside it. $OUT gets the log, every run's summary and failure, and a header
# (command, commit, source hash, torch, GPU). CAPS_TIMEOUT_S stops the runs in time for the summary within one call.
#   bash benchmarks/gpu_memory_caps.sh NAME CAP [gallery run flags...]   (on the GPU machine; diffusers in .whl/)
#   e.g. GALLERY_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_memory_caps.sh sd_22 22 --model sd15 --steps 12
name=$1; cap=$2; shift 2
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
runs=/tmp/caps_$name
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$out/smi_$name.csv" 2>&1 &
sampler=$!
start=$SECONDS
(mkdir -p /tmp/work && cd /tmp/work && timeout "${CAPS_TIMEOUT_S:-86400}" python3 -m gallery_lib.app.cli run --profile full --gpu-memory-gib "$cap" \
  --output-dir "$runs" "$@") > "$out/run_$name.log" 2>&1
code=$?
kill "$sampler" 2>/dev/null
python3 benchmarks/run_summaries.py "$out/caps_$name.json" "$runs" \
  command="bash benchmarks/gpu_memory_caps.sh $name $cap $*" cap_gib="$cap" exit_code="$code" wall_s="$((SECONDS - start))"
grep "memory plan\|\[gallery\] [a-z]*: \|stopped\|Error" "$out/run_$name.log" | tail -30
# where each attempt ran out of memory: its rank log's error lines (the retries' logs stay on the machine)
grep -rh "out of memory\|OutOfMemoryError" "$runs" --include="rank*.log" | cut -c1-400 | sort | uniq -c | tee "$out/oom_$name.txt"
