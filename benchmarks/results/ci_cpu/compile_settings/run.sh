#!/usr/bin/env bash
# A/B of Inductor CPU compile settings, each variant pinned to 2 cores, all at once on disjoint cores.
set -u
export CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/diffusers*.whl && export PYTHONPATH=/tmp/site:$PWD
g++ --version | head -1; nproc; python3 -c "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())"
python3 -m gallery_lib.cli prepare --device cpu --model dreambooth_tiny --profile smoke --data-dir /tmp/d/db >/dev/null 2>&1
python3 -m gallery_lib.cli prepare --device cpu --model sd_tiny --profile smoke --data-dir /tmp/d/sd >/dev/null 2>&1
# the precompiled header, once, before the timed runs
TORCHINDUCTOR_CACHE_DIR=/tmp/warm python3 -c "
import torch; f=torch.compile(lambda x: (x*2).sin()); f(torch.randn(8))" 
core=0
run() { # name env... -- model recipe data
  local name=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local model=$1 recipe=$2 data=$3
  ( s=$SECONDS; env "${envs[@]}" TORCHINDUCTOR_CACHE_DIR=/tmp/c_$name taskset -c $core,$((core+1)) python3 -m gallery_lib.cli train --model $model --profile smoke --recipe $recipe --data-dir $data --output-dir /tmp/o_$name --device cpu > $OUT/$name.log 2>&1; echo "$name wall $((SECONDS-s)) s rc $?" >> $OUT/summary.txt ) &
  core=$((core+2))
}
for m in "db dreambooth_tiny accelerated /tmp/d/db" "sd sd_tiny compiled /tmp/d/sd"; do
  set -- $m
  run ${1}_default X=1 -- $2 $3 $4
  run ${1}_cppwrap TORCHINDUCTOR_CPP_WRAPPER=1 -- $2 $3 $4
  run ${1}_threads1 TORCHINDUCTOR_COMPILE_THREADS=1 -- $2 $3 $4
  run ${1}_cppwrap_t1 TORCHINDUCTOR_CPP_WRAPPER=1 TORCHINDUCTOR_COMPILE_THREADS=1 -- $2 $3 $4
done
wait
cat $OUT/summary.txt
for f in $OUT/*.log; do echo "== $f"; grep -h "compilation in\|longest phases\|done:\|rror" $f | cut -c1-300 | head -6; done
