# The optimization ladder on one GPU, in parts that fit a time-limited call (each part's JSON lands in $OUT).
#   bash benchmarks/gpu_ladder.sh PART RUNGS   e.g.  bash benchmarks/gpu_ladder.sh part1 tf32,amp,loader
# (on the GPU machine; the diffusers wheels in .whl/). Join the parts with bench_ladder.py --merge.
# On one machine, calls chained while it stays warm (its /tmp data and compile caches carry over), each under 600 s:
# part1 tf32,amp,loader,fused,attention,batch,ema; part2 zero2,bf16,compile; part3
# regional,cuda_graphs,cached_latents,channels_last; part4 kernels,checkpointing. On an H200 at 2c5160a, the first on a
# fresh machine, they took 342, 320, 373 and 244 s (results/ladder_h200_2c5160a; each rung's `wall_s` in the JSON
# says what it took). Pass GALLERY_COMMIT=<commit> to name the code. Under a cap, as on a smaller card: flags after the
# rungs go to bench_ladder.py (e.g. --set gpu_memory_gib=16); STEPS, WARMUP and LADDER_TIMEOUT_S shorten a call.
set -x
part=$1
rungs=$2
shift 2
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
timeout "${LADDER_TIMEOUT_S:-86400}" python3 benchmarks/bench_ladder.py --profile full --rungs "$rungs" \
  --steps "${STEPS:-30}" --set warmup_steps="${WARMUP:-10}" --set log_every=5 --set export_model=false \
  --output-dir /tmp/ladder --data-root /tmp/data --out "$out/ladder_$part.json" "$@" > "$out/ladder_$part.log" 2>&1
grep "\[ladder\]\|memory plan\|done:\|Error\|error:\|compilation\|precompil" "$out/ladder_$part.log" | tail -40
