# Cold starts of SD-1.5 b32 `accelerated`, Inductor's compile threads as they are (A: each precompile worker gets
# cores/workers, the training process its own pool) against TORCHINDUCTOR_COMPILE_THREADS=1 for every process (B: no
# compile pools), alternating on one machine, a fresh Inductor cache per run (benchmarks/RESULTS.md#sd15-compile-time).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/notes.txt
for n in A1 B1 A2 B2; do
  s=$(date +%s)
  ( export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$n
    case $n in B*) export TORCHINDUCTOR_COMPILE_THREADS=1 ;; esac
    python3 -m gallery_lib.cli bench --profile full --data-root /tmp/data --output-dir /tmp/bench_$n --out $OUT/sd_$n.json \
      --models sd --recipes accelerated --batch-size 32 --timed-steps 30 > $OUT/sd_$n.log 2>&1 ) || echo "$n failed" >> $OUT/notes.txt
  rm -f $OUT/sd_$n.png
  echo "$n wall $(( $(date +%s) - s )) s" >> $OUT/notes.txt
  python3 benchmarks/compile_times.py /tmp/bench_$n >> $OUT/notes.txt
done
cat $OUT/notes.txt
