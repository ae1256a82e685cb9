# Footprints for the memory plan (gallery_lib/run/memory_plan.py): `gallery bench` rows at the batch sizes a smaller
# GPU takes, with the GPU's memory sampled every half second by nvidia-smi beside them (the whole card, and each
# process: the CUDA contexts and the precompile workers that the allocator's peak leaves out).
#   bash benchmarks/gpu_memory.sh NAME "BENCH FLAGS" ["BENCH FLAGS" ...]   (on the GPU machine; diffusers in .whl/)
# Each quoted group is one `gallery bench` call (gpu_bench.sh NAME_<i>); $OUT gets their JSON and logs and the samples.
name=$1; shift
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=timestamp,memory.total,memory.used --format=csv,noheader,nounits -lms 500 \
  > "$out/smi_gpu_$name.csv" 2>&1 &
gpu_sampler=$!
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader,nounits -lms 500 \
  > "$out/smi_apps_$name.csv" 2>&1 &
apps_sampler=$!
i=0
for flags in "$@"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  bash "$(dirname "$0")/gpu_bench.sh" "${name}_$i" $flags
  rm -f "$out/bench_${name}_$i.png"
done
kill "$gpu_sampler" "$apps_sampler" 2>/dev/null
