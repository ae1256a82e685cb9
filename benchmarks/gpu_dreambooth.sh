# DreamBooth on one GPU: SD-1.5 at 512 px, batch 1, the three recipes (full fine-tuning, or LoRA with $1=lora).
#   bash benchmarks/gpu_dreambooth.sh [full|lora] [RECIPES]   (on the GPU machine; diffusers/peft wheels in .whl/)
set -x
mode=${1:-full}
recipes=${2:-accelerated,compiled,baseline}
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version --format=csv
extra=""
[ "$mode" = lora ] && extra="--set lora_rank=4 --set lr=1e-4"
# shellcheck disable=SC2086
python3 benchmarks/bench_recipes.py --profile full --model dreambooth_sd15 --recipes "$recipes" \
  --steps 80 --set warmup_steps=30 --set num_workers=4 --set export_model=false $extra --output-dir /tmp/bench \
  --data-root /tmp/data --out "$out/dreambooth_${mode}_b1.json" > "$out/dreambooth_${mode}_b1.log" 2>&1
grep "\[bench\]\|done:\|Error\|compilation\|precompil" "$out/dreambooth_${mode}_b1.log" | tail -40
