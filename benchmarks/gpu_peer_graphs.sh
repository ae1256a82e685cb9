#!/usr/bin/env bash
# `peer` without and with CUDA graphs beside `accelerated`, one `gallery bench` command per family, on one GPU.
#   bash benchmarks/gpu_peer_graphs.sh NAME:MODEL:BATCH...   e.g.  bash benchmarks/gpu_peer_graphs.sh swin:swin:128 db:dreambooth:1
# (on the GPU machine: diffusers in .whl/, nvidia-cudnn-frontend wheels in .whl/cudnn/ for ResNet-50's fused convs;
# gpu_bench.sh installs them)
set -u
for spec in "$@"; do
  IFS=: read -r name model batch <<< "$spec"
  bash "$(dirname "$0")/gpu_bench.sh" "peer_graphs_$name" --models "$model" --batch-size "$batch" \
    --recipes peer,peer+compile_mode=reduce-overhead,accelerated
done
