# The your_model notebook's ladder in the full profile on the GPU machine (224 px, batch 128), one call:
#   device run: bash benchmarks/gpu_your_model.sh [TIMM_MODEL]   (default: the notebook's, vit_base_patch16_224;
#   carry .whl with the diffusers wheel; results under $OUT)
source "$(dirname "$0")/device_env.sh"
model=${1:+\"model_name\": \"$1\", }
start=$(date +%s)
cd notebooks && timeout ${TIMEOUT:-300} python3 ../benchmarks/run_notebook_code.py your_model.ipynb \
  "{$model\"profile\": \"full\", \"output_dir\": \"/tmp/your_model_out\", \"steps\": 60, \"warmup_steps\": 25}" > $OUT/your_model_full.log 2>&1
rc=$?; cp /tmp/your_model_out/your_model/ladder.* $OUT/  # the ladder alone: the device returns at most 8 files
echo "notebook rc=$rc in $(( $(date +%s) - start )) s"; grep -v "Why:" $OUT/your_model_full.log | tail -14
