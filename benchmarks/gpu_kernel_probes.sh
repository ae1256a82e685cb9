# The kernel probes in one GPU call (about 5 minutes on an H200), results and logs in $OUT:
# the one-pass AdamW + EMA against the recipe's two passes, then the GroupNorm loops' pipelining at SD's batch 32
# and DreamBooth's batch 1.   GALLERY_COMMIT=<commit> bash benchmarks/gpu_kernel_probes.sh
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 benchmarks/probe_adamw_ema.py --out "$out/probe_adamw_ema.json" > "$out/probe_adamw_ema.log" 2>&1
echo "adamw+ema rc=$?"; grep -E "two passes|best" "$out/probe_adamw_ema.log"
for batch in 32 1; do
  timeout 150 python3 benchmarks/probe_group_norm.py --batch $batch --out "$out/probe_group_norm_b$batch.json" \
    > "$out/probe_group_norm_b$batch.log" 2>&1
  echo "group norm b$batch rc=$?"; tail -13 "$out/probe_group_norm_b$batch.log"
done
