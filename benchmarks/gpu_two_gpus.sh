#!/usr/bin/env bash
# DDP scaling on a 2-GPU machine in one call: how the GPUs are linked and what an all-reduce of SD's gradients takes
# alone, then `gallery bench` runs; their JSON in $OUT, every log in $OUT/logs.tgz (the device returns 8 files).
#   bash benchmarks/gpu_two_gpus.sh classifiers [SECONDS]   ResNet-50 b256 and Swin-T b128, accelerated, 1 and 2 GPUs
#                                                           (each ResNet run took about 150 s with its data: 580 s
#                                                           held ResNet's two runs and part of Swin's first)
#   bash benchmarks/gpu_two_gpus.sh sd [SECONDS]            SD-1.5 b32: accelerated on 1 and 2 GPUs, the DDP levers on
#                                                           2 GPUs, then the fastest lever once more, as time allows
# (on the GPU machine: diffusers in .whl/, nvidia-cudnn-frontend in .whl/cudnn/; GALLERY_COMMIT names the code)
set -u
mode=$1; budget=${2:-580}; t0=$SECONDS
out=${OUT:-/tmp/two_gpus_out}; raw=/tmp/two_gpus_raw; mkdir -p "$out" "$raw"
source "$(dirname "$0")/device_env.sh"
left() { echo $((budget - (SECONDS - t0))); }
finish() { tar czf "$out/logs_$mode.tgz" -C "$raw" . ; echo "[two_gpus] done in $((SECONDS - t0)) s"; }
bench() {  # NAME FLAGS...: one `gallery bench`, stopped where the call's time runs out (its JSON keeps each run)
  local name=$1; shift
  timeout "$(( $(left) - 15 ))" python3 -m gallery_lib.app.cli bench --profile full --data-root /tmp/data \
    --output-dir "/tmp/bench_$name" --out "$out/$name.json" "$@" > "$raw/$name.log" 2>&1
  rm -f "$out/$name.png"
  grep "\[bench\] ===\|done:\|Error\|error:" "$raw/$name.log" | tail -8
}
summary() {  # the rows of the JSON files: img/s, step ms, reserved GiB
  python3 - "$out"/*.json <<'EOF'
import json, sys
for path in sys.argv[1:]:
    rows = json.load(open(path)).get("rows")
    for r in rows if isinstance(rows, list) else []:  # bench files only (the probe's rows are a dict)
        if "error" in r:
            print(f"{path.split('/')[-1]} {r['recipe']} p{r['processes']}: {r['error']}"); continue
        print(f"{path.split('/')[-1]} {r['model']} {r['recipe']} b{r['batch_size']} p{r['processes']}: "
              f"{r['samples_per_s']:.1f} img/s, {r['median_step_ms']:.1f} ({r['p20_step_ms']:.1f}-{r['p80_step_ms']:.1f})"
              f" ms, {r['peak_reserved_gib']:.1f} GiB reserved, to steady {r['to_steady_s']:.1f} s")
EOF
}

nvidia-smi topo -m > "$raw/topo.txt" 2>&1; head -4 "$raw/topo.txt"
if [ "$mode" = classifiers ]; then
  bench classifiers_b256_b128 --models resnet,swin --batch-size resnet=256 --batch-size swin=128 \
    --recipes accelerated --processes 1,2
elif [ "$mode" = sd ]; then
  NCCL_DEBUG=INFO timeout 120 python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/allreduce_probe.py \
    --out "$out/allreduce_probe.json" > "$raw/allreduce_probe.log" 2>&1
  grep "\[allreduce\]" "$raw/allreduce_probe.log"; grep -m2 " via " "$raw/allreduce_probe.log"
  bench sd_b32_1_2gpu --models sd --batch-size 32 --recipes accelerated --processes 1,2
  levers=(accelerated+ddp_grad_compression=bf16 accelerated+ddp_bucket_cap_mb=100+ddp_static_graph=true)
  bench sd_b32_levers --models sd --batch-size 32 --processes 2 --recipes "$(IFS=,; echo "${levers[*]}")"
  # the fastest lever, if faster than the plain recipe's 2-GPU run, once more (then the plain recipe, if time allows)
  best=$(python3 - "$out/sd_b32_1_2gpu.json" "$out/sd_b32_levers.json" <<'EOF'
import json, sys
plain = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("processes") == 2 and "error" not in r]
levers = [(r.get("samples_per_s", 0), i) for i, r in enumerate(json.load(open(sys.argv[2]))["rows"])]
best = max(levers, default=(0, -1))
print(best[1] if plain and best[0] > plain[0]["samples_per_s"] else -1)
EOF
)
  if [ "${best:--1}" -ge 0 ] && [ "$(left)" -gt 110 ]; then
    again=${levers[$best]}; [ "$(left)" -gt 200 ] && again="$again,accelerated"
    bench sd_b32_again --models sd --batch-size 32 --processes 2 --recipes "$again"
  fi
fi
summary
finish
