# Cold starts of `gallery bench` on the GPU machine, alternating this checkout's library with another copy of it
# (BASE: a folder holding gallery_lib/ and data_prep/, e.g. from `git archive`), each run with fresh Inductor, Triton
# and CUDA JIT caches, as on a machine's first run. Each run is gpu_bench.sh's, named NAME_{base,new}_I.
#   bash benchmarks/gpu_cold_ab.sh NAME BASE ROUNDS [gallery bench flags...]
name=$1; base=$2; rounds=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
OUT=$(realpath "${OUT:-benchmarks/results}"); export OUT
for i in $(seq 1 "$rounds"); do
  for side in base new; do
    src=$PWD; [ "$side" = base ] && src=$(cd "$base" && pwd)
    caches=/tmp/cold_${name}_${side}_$i
    # From inside the copy: `python -m` (the bench's torchrun child too) puts the working directory first on sys.path.
    (cd "$src" && TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton CUDA_CACHE_PATH=$caches/nv \
      bash "$here/gpu_bench.sh" "${name}_${side}_$i" "$@")
  done
done
