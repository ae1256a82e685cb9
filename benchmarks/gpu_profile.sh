# `gallery bench` with each run's last 5 steps under torch.profiler (left out of its timing), on the GPU machine: the
# bench files as gpu_bench.sh writes them, and each run's kernel table copied to $OUT/profile_NAME_<model>_<recipe>.json.
#   bash benchmarks/gpu_profile.sh NAME [gallery bench flags...]  e.g.  ... sd_b32 --models sd --recipes accelerated
name=$1; shift
bash "$(dirname "$0")/gpu_bench.sh" "$name" --set profile_steps=5 "$@"
out=${OUT:-benchmarks/results}
find "/tmp/bench_$name" -name profile.json | while read -r table; do
  run=$(dirname "$table"); recipe=$(basename "$run" | tr '+=,' '___'); model=$(basename "$(dirname "$run")")
  cp "$table" "$out/profile_${name}_${model}_${recipe}.json"
done
grep -A14 "\] profile of steps" "$out/bench_$name.log"
