# `gallery bench --timm-model NAME` on held-out timm models (no family has them), one after another in one call, and
# `--diffusers-model CLASS` for a spec `diffusers.CLASS` (its default config, e.g. DiT-XL/2):
#   device run: GALLERY_COMMIT=<sha> bash benchmarks/gpu_timm_models.sh MODEL[:BATCH] ...   (TIMEOUT=s per model;
#   PROFILE_STEPS=N: each variant's kernel time by kind over N steps after its timed ones, in its row)
#   e.g. bash benchmarks/gpu_timm_models.sh convnext_tiny resnet34:128 diffusers.DiTTransformer2DModel:64
# Each writes timm_<MODEL>.json/.md/.png and a log under $OUT; the defaults are the bench's (224 px, batch 128; a
# denoiser 32x32 samples, batch 64). Carry .whl (diffusers).
source "$(dirname "$0")/device_env.sh"
for spec in "$@"; do
  model=${spec%%:*}; batch=${spec#*:}; [ "$batch" = "$spec" ] && batch=
  if [[ $model == diffusers.* ]]; then which=(--diffusers-model "${model#diffusers.}"); else which=(--timm-model "$model"); fi
  start=$(date +%s)
  timeout ${TIMEOUT:-240} python3 -m gallery_lib.app.cli bench "${which[@]}" ${batch:+--batch-size $batch} \
    ${PROFILE_STEPS:+--profile-steps $PROFILE_STEPS} --out "$OUT/timm_$model.json" > "$OUT/timm_$model.log" 2>&1
  echo "$model: rc=$? in $(( $(date +%s) - start )) s"
  grep -v "Why:" "$OUT/timm_$model.log" | tail -8
done
