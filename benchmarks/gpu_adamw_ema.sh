# The fused AdamW + EMA on the GPU machine: its GPU tests, the update alone (bench_adamw_ema.py), then the SD recipe
# with it against the separate EMA pass and no EMA (gallery bench, batch 32; not with SKIP_SD=1); all in $OUT.
#   [BLOCKS=2048:8,...] [SKIP_SD=1] bash benchmarks/gpu_adamw_ema.sh NAME
name=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adamw_ema.py tests/test_ema.py > "$out/gpu_tests_$name.txt" 2>&1
tail -3 "$out/gpu_tests_$name.txt"
timeout 200 python3 benchmarks/bench_adamw_ema.py --rounds 2 --steps 30 --blocks "${BLOCKS:-2048:8,1024:4,4096:8}" \
  --out "$out/adamw_ema_$name.json" > "$out/adamw_ema_$name.log" 2>&1
tail -12 "$out/adamw_ema_$name.log"
[ -n "$SKIP_SD" ] || bash benchmarks/gpu_bench.sh "sd_b32_$name" --models sd --batch-size 32 --timed-steps 40 \
  --recipes accelerated,accelerated+ema=fused,accelerated+ema=off
