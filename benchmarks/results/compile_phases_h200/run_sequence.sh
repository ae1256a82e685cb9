# The cold -> warm -> warm2 sequence of benchmarks/RESULTS.md#sd15-compile-time on one device machine, with a listing of what
# each run wrote into the compile caches. Machine 2: CACHE=/tmp/ind_d RUNS="cold warm warm2" bash run_sequence.sh; machine 3 the
# same with a since-reverted change that preset TRITON_CACHE_DIR; machine 1 ran the runs cold, warm, nocudnnbench, warm2.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$CACHE
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/notes.txt
snap() { find $CACHE -type f -printf '%s %TY%Tm%Td%TH%TM%TS %p\n' | sort -k3 > /tmp/snap_$1.txt; }
for n in $RUNS; do
  s=$(date +%s)
  python3 benchmarks/results/compile_phases_h200/cli_exp.py bench --profile full --data-root /tmp/data --output-dir /tmp/bench_$n --out $OUT/sd_$n.json \
    --models sd --recipes accelerated --batch-size 32 --timed-steps 30 > $OUT/sd_$n.log 2>&1 || echo "$n failed" >> $OUT/notes.txt
  rm -f $OUT/sd_$n.png
  echo "$n wall $(( $(date +%s) - s )) s" >> $OUT/notes.txt
  python3 benchmarks/compile_times.py /tmp/bench_$n >> $OUT/notes.txt
  snap $n
  if [ -n "$prev" ]; then
    echo "--- files new or changed in size by run $n: $(diff /tmp/snap_$prev.txt /tmp/snap_$n.txt | grep -c '^>')" >> $OUT/notes.txt
    diff /tmp/snap_$prev.txt /tmp/snap_$n.txt | grep '^[<>]' | awk '{split($4,p,"/"); print $1, p[4], p[5]}' | sort | uniq -c | sort -rn | head -30 >> $OUT/notes.txt
    diff /tmp/snap_$prev.txt /tmp/snap_$n.txt | grep '^[<>]' | head -30 >> $OUT/notes.txt
  fi
  echo "files in ~/.triton: $(find ~/.triton -type f 2>/dev/null | wc -l), TRITON_CACHE_DIR env of the shell: ${TRITON_CACHE_DIR:-unset}" >> $OUT/notes.txt
  prev=$n
done
cat $OUT/notes.txt
