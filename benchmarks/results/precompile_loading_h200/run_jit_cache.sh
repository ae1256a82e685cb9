# Is a machine's first cold run slow because of the CUDA driver's JIT cache (CUDA_CACHE_PATH, ~/.nv/ComputeCache by
# default), which cuDNN's runtime-compiled kernels fill on first use? Three cold-cache runs of SD-1.5 `accelerated` at
# batch 32 on one fresh machine, each with a fresh Inductor cache (benchmarks/RESULTS.md#precompile-loading):
#   A: cuDNN autotuning off in the training process, a fresh JIT cache (the machine's first run)
#   B: as committed (autotuning on), a fresh JIT cache
#   C: as committed, B's JIT cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/notes.txt
echo "default JIT cache before: $(du -sh ~/.nv 2>/dev/null)" >> $OUT/notes.txt
python3 -c "import torch, triton, diffusers.models.unets.unet_2d_blocks, torch._inductor.compile_fx; torch.zeros(1, device='cuda')"
run() {  # name, JIT cache dir, cuDNN autotuning off (1) or on (0)
  s=$(date +%s)
  CUDA_CACHE_PATH=/tmp/jit_$2 EXP_NO_CUDNN_BENCH=$3 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 \
    python3 benchmarks/results/compile_phases_h200/cli_exp.py bench --profile full --data-root /tmp/data \
    --output-dir /tmp/bench_$1 --out $OUT/sd_$1.json --models sd --recipes accelerated --batch-size 32 \
    --timed-steps 30 > $OUT/sd_$1.log 2>&1 || echo "$1 failed" >> $OUT/notes.txt
  rm -f $OUT/sd_$1.png
  echo "$1 (JIT cache $2, cuDNN autotuning off: $3) wall $(( $(date +%s) - s )) s; JIT cache now $(du -sh /tmp/jit_$2 | cut -f1)" >> $OUT/notes.txt
  python3 benchmarks/compile_times.py /tmp/bench_$1 >> $OUT/notes.txt
}
run A a 1
run B b 0
run C b 0
cat $OUT/notes.txt
