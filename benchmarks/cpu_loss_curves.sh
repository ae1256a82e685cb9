#!/usr/bin/env bash
# Per-step losses of the smoke-profile SD and Swin recipes on a CPU, through the `gallery` command only (whose
# flags outlive refactors), so two checkouts can be compared step by step:
#
#   bash benchmarks/cpu_loss_curves.sh OUT_DIR      then   python benchmarks/compare_loss_curves.py before=... after=...
#
# Each model's baseline and accelerated recipes train 16 smoke steps on the profile's mock data, one process, CPU.
set -euo pipefail
out=${1:?usage: cpu_loss_curves.sh OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
gallery=${GALLERY:-$repo/.venv/bin/gallery}
mkdir -p "$out"; out=$(cd "$out" && pwd); cd "$out"  # the mock data goes to ./data here
for model in swin_micro sd_tiny; do
  "$gallery" run --profile smoke --model "$model" --device cpu --recipes baseline,accelerated \
    --output_dir "$out/$model" --num_workers 0 > "$out/$model.log" 2>&1
done
echo "[cpu_loss_curves] metrics under $out"
