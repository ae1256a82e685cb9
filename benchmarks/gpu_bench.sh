# `gallery bench` on the GPU machine (the diffusers wheels in .whl/), its JSON, figure and log in $OUT.
#   bash benchmarks/gpu_bench.sh NAME [gallery bench flags...]   e.g.  bash benchmarks/gpu_bench.sh sd_b32 --models sd --batch-size 32
# Runs share one Inductor cache (/tmp), so a second run of a recipe in the same call shows the warm-cache start.
name=$1; shift
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
# the GPU's clocks, power and throttle reasons beside the runs, and each log line's time, to line up slow stretches of
# steps with what the GPU did then
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 250 > "$out/smi_$name.csv" 2>&1 &
sampler=$!
date "+start %F %T (nvidia-smi's clock; each line below: seconds from then)" > "$out/bench_$name.stamped.log"
python3 benchmarks/stamp_lines.py python3 -m gallery_lib.app.cli bench --profile full --data-root /tmp/data \
  --output-dir "/tmp/bench_$name" --out "$out/bench_$name.json" "$@" >> "$out/bench_$name.stamped.log"
tail -n +2 "$out/bench_$name.stamped.log" | cut -c9- > "$out/bench_$name.log"  # the log as it was, unstamped
kill $sampler 2>/dev/null; gzip -f "$out/smi_$name.csv"
grep "\[bench\] ===\|done:\|Error\|error:\|goal" "$out/bench_$name.log" | tail -30
