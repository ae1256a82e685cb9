# `gallery bench` of recipes on 1 GPU, then on N GPUs of the same machine (DDP unless --set data_parallel=zero2),
# their JSON and logs in $OUT. The N-GPU run starts with the compile caches the 1-GPU run left, as a user's would.
#   bash benchmarks/gpu_scaling.sh NAME N [gallery bench flags...]
#   e.g.  bash benchmarks/gpu_scaling.sh sd_b32 2 --models sd --recipes accelerated --batch-size 32
name=$1; procs=$2; shift 2
source "$(dirname "$0")/device_env.sh"
# on a copy of a checkout (the GPU machine's, whose .git may be older): GALLERY_COMMIT=<commit>[+dirty] names the code
out=${OUT:-benchmarks/results}
for n in 1 "$procs"; do
  python3 -m gallery_lib.app.cli bench --profile full --data-root /tmp/data --output-dir "/tmp/bench_${name}_$n" \
    --out "$out/${name}_${n}gpu.json" --set nproc_per_node="$n" "$@" > "$out/${name}_${n}gpu.log" 2>&1
  grep "\[bench\] ===\|done:\|compilation in this run\|pre-compilation\|Error\|error:" "$out/${name}_${n}gpu.log" | tail -12
done
