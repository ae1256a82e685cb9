# `gallery bench` on the GPU machine (the diffusers wheels in .whl/), its JSON, figure and log in $OUT.
#   bash benchmarks/gpu_bench.sh NAME [gallery bench flags...]   e.g.  bash benchmarks/gpu_bench.sh sd_b32 --models sd --batch-size 32
# Runs share one Inductor cache (/tmp), so a second run of a recipe in the same call shows the warm-cache start.
name=$1; shift
# the cuDNN frontend (.whl/cudnn/) too: ResNet-50's accelerated conv-bn fusion needs it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$(dirname "$0")"/../.whl/*.whl $(ls "$(dirname "$0")"/../.whl/cudnn/*.whl 2>/dev/null)
python3 benchmarks/device_site.py /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
python3 -m gallery_lib.app.cli bench --profile full --data-root /tmp/data --output-dir "/tmp/bench_$name" \
  --out "$out/bench_$name.json" "$@" > "$out/bench_$name.log" 2>&1
grep "\[bench\] ===\|done:\|Error\|error:\|goal" "$out/bench_$name.log" | tail -30
