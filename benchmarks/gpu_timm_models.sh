# `gallery bench --timm-model NAME` on held-out timm models (no family has them), one after another in one call:
#   device run: GALLERY_COMMIT=<sha> bash benchmarks/gpu_timm_models.sh MODEL[:BATCH] ...   (TIMEOUT=s per model)
# Each writes timm_<MODEL>.json/.md/.png and a log under $OUT; the defaults are the bench's (224 px, batch 128).
python3 benchmarks/device_site.py /tmp/site >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for spec in "$@"; do
  model=${spec%%:*}; batch=${spec#*:}; [ "$batch" = "$spec" ] && batch=
  start=$(date +%s)
  timeout ${TIMEOUT:-240} python3 -m gallery_lib.app.cli bench --timm-model "$model" ${batch:+--batch-size $batch} \
    --out "$OUT/timm_$model.json" > "$OUT/timm_$model.log" 2>&1
  echo "$model: rc=$? in $(( $(date +%s) - start )) s"
  grep -v "Why:" "$OUT/timm_$model.log" | tail -8
done
