# Cold-cache runs of SD-1.5 `accelerated` at batch 32, each with a fresh Inductor cache and a fresh CUDA JIT cache (as
# on a machine's first run), with and without the blocks run uncompiled while the workers compile (warm_kernels), then
# a warm run on the last one's caches (benchmarks/RESULTS.md#precompile-loading).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/notes.txt
python3 -c "import torch, triton, diffusers.models.unets.unet_2d_blocks, torch._inductor.compile_fx; torch.zeros(1, device='cuda')"
run() {  # name, caches' suffix, warm_kernels off (1) or on (0)
  s=$(date +%s)
  CUDA_CACHE_PATH=/tmp/jit_$2 EXP_NO_WARM_KERNELS=$3 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$2 \
    python3 benchmarks/results/compile_phases_h200/cli_exp.py bench --profile full --data-root /tmp/data \
    --output-dir /tmp/bench_$1 --out $OUT/sd_$1.json --models sd --recipes accelerated --batch-size 32 \
    --timed-steps 30 > $OUT/sd_$1.log 2>&1 || echo "$1 failed" >> $OUT/notes.txt
  rm -f $OUT/sd_$1.png
  echo "$1 (caches $2, warm_kernels off: $3) wall $(( $(date +%s) - s )) s" >> $OUT/notes.txt
  python3 benchmarks/compile_times.py /tmp/bench_$1 | grep -v "^    worker" >> $OUT/notes.txt
}
run on1 1 0
run off1 2 1
run on2 3 0
run warm3 3 0
cat $OUT/notes.txt
