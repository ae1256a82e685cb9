# Cold starts of `gallery bench` on the GPU machine, alternating this checkout's library with another copy of it
# (BASE: a folder holding gallery_lib/ and data_prep/, e.g. from `git archive`), each run with fresh Inductor, Triton and CUDA JIT caches, as on a machine's
# first run. Result files in $OUT as bench_NAME_{new,base}_I.{json,log}.
#   bash benchmarks/gpu_cold_ab.sh NAME BASE ROUNDS [gallery bench flags...]
name=$1; base=$2; rounds=$3; shift 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
out=$(realpath "${OUT:-benchmarks/results}")
for i in $(seq 1 "$rounds"); do
  for side in base new; do
    src=$PWD; [ "$side" = base ] && src=$(cd "$base" && pwd)
    caches=/tmp/cold_${name}_${side}_$i
    run=bench_${name}_${side}_$i
    # From inside the copy: `python -m` (the bench's torchrun child too) puts the working directory first on sys.path.
    (cd "$src" && TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton CUDA_CACHE_PATH=$caches/nv \
      PYTHONPATH=/tmp/site:$src PYTHONUNBUFFERED=1 python3 -m gallery_lib.cli bench --profile full \
      --data-root /tmp/data --output-dir "/tmp/$run" --out "$out/$run.json" "$@" > "$out/$run.log" 2>&1)
    echo "== $run"; grep "done:\|pre-compiled" "$out/$run.log" | cut -c1-420
  done
done
