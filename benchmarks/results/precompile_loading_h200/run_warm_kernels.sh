# Cold-cache runs of SD-1.5 `accelerated` at batch 32, each with a fresh Inductor cache and a fresh CUDA JIT cache (as
# on a machine's first run), alternating with and without `precompile_first_use` (the blocks run uncompiled while the
# workers compile), then a warm run on the last one's caches (benchmarks/RESULTS.md#precompile-loading).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/notes.txt
python3 -c "import torch, triton, diffusers.models.unets.unet_2d_blocks, torch._inductor.compile_fx; torch.zeros(1, device='cuda')"
run() {  # name, caches' suffix, recipe
  s=$(date +%s)
  CUDA_CACHE_PATH=/tmp/jit_$2 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$2 python3 -m gallery_lib.cli bench --profile full \
    --data-root /tmp/data --output-dir /tmp/bench_$1 --out $OUT/sd_$1.json --models sd --recipes $3 --batch-size 32 \
    --timed-steps 30 > $OUT/sd_$1.log 2>&1 || echo "$1 failed" >> $OUT/notes.txt
  rm -f $OUT/sd_$1.png
  echo "$1 (caches $2, $3) wall $(( $(date +%s) - s )) s" >> $OUT/notes.txt
  python3 benchmarks/compile_times.py /tmp/bench_$1 | grep -v "^    worker" >> $OUT/notes.txt
}
for pair in ${PAIRS:-1 2}; do
  run off$pair off$pair accelerated+precompile_first_use=false
  run on$pair on$pair accelerated
done
[ -n "$WARM" ] && run warm on$pair accelerated
cat $OUT/notes.txt
