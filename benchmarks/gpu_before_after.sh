#!/usr/bin/env bash
# GPU spot check of a refactor: the accelerated SD-1.5 recipe at batch 8, run alternately from two checkouts of the
# gallery on one machine (the same data, the same compile caches), so their step times compare.
#
#   bash benchmarks/gpu_before_after.sh BEFORE_TREE AFTER_TREE OUT_DIR [ROUNDS]
#
# Each tree runs its own benchmarks/bench_recipes.py (--recipes accelerated, 30 steps, model export off); the JSON
# files land in OUT_DIR as <before|after>_<round>.json.
set -euo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); out=$3; rounds=${4:-2}
mkdir -p "$out"; out=$(cd "$out" && pwd)
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    tree=$before; [ "$side" = after ] && tree=$after
    echo "=== round $round: $side ($tree) ==="
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/bench_recipes.py --profile full \
      --model sd15 --recipes accelerated --steps 30 --set export_model=false --data-root /tmp/gallery_data \
      --output-dir "/tmp/gallery_out_$side" --out "$out/${side}_$round.json" 2>&1 | grep -E "^\[bench\]|Error|error" || true)
  done
done
