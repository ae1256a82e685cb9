# Cold-cache runs of SD-1.5 `accelerated` at batch 32, one fresh Inductor cache each, in the order of $RECIPES
# (benchmarks/RESULTS.md#precompile-loading): RECIPES="accelerated+precompile_overlap=false accelerated" bash run_cold.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/notes.txt
# the machine's first imports read torch, Triton and diffusers from disk: done once here, outside the timed runs
python3 -c "import torch, triton, diffusers.models.unets.unet_2d_blocks, torch._inductor.compile_fx; torch.zeros(1, device='cuda')"
i=0
for recipe in $RECIPES; do
  i=$((i + 1)); name=cold$i
  s=$(date +%s)
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$name python3 -m gallery_lib.cli bench --profile full --data-root /tmp/data \
    --output-dir /tmp/bench_$name --out $OUT/sd_$name.json --models sd --recipes $recipe --batch-size 32 \
    --timed-steps 30 > $OUT/sd_$name.log 2>&1 || echo "$name failed" >> $OUT/notes.txt
  rm -f $OUT/sd_$name.png
  echo "$name ($recipe) wall $(( $(date +%s) - s )) s" >> $OUT/notes.txt
  python3 benchmarks/compile_times.py /tmp/bench_$name >> $OUT/notes.txt
done
cat $OUT/notes.txt
