# The plain peer with and without channels_last, beside accelerated, in one call (one Inductor cache): the default
# layout, channels_last images and weights (one line), and channels_last with Inductor forcing its layout through
# every graph (TORCHINDUCTOR_FORCE_LAYOUT_OPT=1, one more line). Results in $OUT/bench_NAME*.json.
#   bash benchmarks/gpu_peer_layout.sh NAME MODEL BATCH   e.g.  bash benchmarks/gpu_peer_layout.sh sd_b32 sd 32
name=$1; model=$2; batch=$3
here=$(dirname "$0")
timeout 400 bash "$here/gpu_bench.sh" "$name" --models "$model" --batch-size "$batch" \
  --recipes peer,peer+channels_last=true,accelerated
TORCHINDUCTOR_FORCE_LAYOUT_OPT=1 timeout 170 bash "$here/gpu_bench.sh" "${name}_forced" --models "$model" \
  --batch-size "$batch" --recipes peer+channels_last=true
