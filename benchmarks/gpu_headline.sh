#!/usr/bin/env bash
# README's headline rows on the GPU machine: Swin-T (batch 128), ResNet-50 (256), SD-1.5's UNet (32) and DreamBooth
# (1), `peer` against `accelerated`, in one `gallery bench` per call (its JSON, table, figure and log in $OUT). Carry
# .whl (diffusers, importlib_metadata) and .whl/cudnn (the cuDNN frontend: ResNet-50's conv-bn fusion).
#
#   GALLERY_COMMIT=<sha> bash benchmarks/gpu_headline.sh warm    # first, on a fresh machine: fills /tmp's compile cache
#   GALLERY_COMMIT=<sha> bash benchmarks/gpu_headline.sh NAME    # then each timed call, while the machine is warm
#
# `warm` compiles every run's graphs into Inductor's cache in /tmp with four runs side by side (16 cores compile
# four graphs about as fast as one), untimed: their step times share the GPU, so nothing of them is a result. It then
# deletes the kernels' autotuned launch settings (*.best_config), chosen while the GPU was shared: each timed run
# picks its own again, alone. A timed call runs the eight runs one after another, warm: `compile_s` and
# `to_steady_s` are warm starts, not the cold start.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
name=${1:?warm, or a name for the timed call}

bench() {  # bench LOG JSON DATA_ROOT [gallery bench flags...]
  local log=$1 json=$2 data=$3
  shift 3
  python3 -m gallery_lib.app.cli bench --profile full --data-root "$data" \
    --output-dir "/tmp/out_$(basename "$json" .json)" --out "$json" "$@" >> "$log" 2>&1
}

if [ "$name" = warm ]; then
  # at most about 120 GiB at once: two SD-1.5 runs at batch 32 (41 GiB each) beside two DreamBooth runs (19 GiB each)
  chain() {  # chain N MODEL:RECIPE:BATCH ...: one after another, each in its own data root (no two prepare one)
    local n=$1 spec model recipe batch
    shift
    for spec in "$@"; do
      IFS=: read -r model recipe batch <<< "$spec"
      bench "/tmp/warm_$n.log" "/tmp/warm_${n}_${model}_${recipe}.json" "/tmp/warm_data_$n" --models "$model" \
        --batch-size "$batch" --recipes "$recipe"
      echo "chain $n: $spec done at $((SECONDS)) s" >> "$out/warm.txt"
    done
  }
  timeout "${WARM_TIMEOUT_S:-540}" bash -c "$(declare -f bench chain); out=$out
    chain 1 sd:peer:32 resnet:peer:256 &
    chain 2 sd:accelerated:32 resnet:accelerated:256 swin:accelerated:128 &
    chain 3 dreambooth:peer:1 swin:peer:128 &
    chain 4 dreambooth:accelerated:1 &
    wait"
  echo "warm rc=$? after $SECONDS s" >> "$out/warm.txt"
  find /tmp -path '*torchinductor*' -name '*.best_config' -delete
  grep -h "done:\|Error\|error:" /tmp/warm_*.log >> "$out/warm.txt"
  cat "$out/warm.txt"
  exit 0
fi

bench "$out/bench_$name.log" "$out/bench_$name.json" /tmp/data --models swin,resnet,sd,dreambooth \
  --batch-size swin=128 --batch-size resnet=256 --batch-size sd=32 --batch-size dreambooth=1 --recipes peer,accelerated
grep "\[bench\] ===\|done:\|Error\|error:\|goal\|\[met\]\|\[not met\]\|\[not measured\]" \
  "$out/bench_$name.log" | tail -40
