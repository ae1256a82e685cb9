#!/usr/bin/env bash
# NOT RUN ON A GPU YET (its CPU run below passed every check). Two GPUs of one host, one call (a few minutes): the GPU
# version of tests/test_distributed.py's two-node and killed-worker tests, through `gallery train` (swin_micro, smoke
# data, fp32, deterministic kernels):
#   - a worker killed and restarted: DDP and ZeRO-2 on 2 GPUs with max_restarts=1, rank 1's process SIGKILLed from
#     outside once the first checkpoint is written; torchrun restarts both, they resume from it, and the losses are
#     compared with the same run uninterrupted;
#   - two nodes on one host, one GPU each (c10d rendezvous on 127.0.0.1), compared with one node of two GPUs; then the
#     same two-node job with a worker killed and restarted.
# Each check's losses, max |difference| and how the run resumed: $OUT/two_nodes_checks.json; the logs: $OUT/logs.tgz.
#   device run (nvidia-h200-x2): bash benchmarks/gpu_two_nodes.sh         (no wheels needed)
#   on a CPU, the script itself (100-180 s on 2 cores):
#     DEVICE=cpu STEPS=30 EVERY=10 OMP_NUM_THREADS=1 bash benchmarks/gpu_two_nodes.sh
set -u
device=${DEVICE:-cuda}; steps=${STEPS:-400}; every=${EVERY:-100}; budget=${BUDGET:-540}; t0=$SECONDS
out=${OUT:-/tmp/two_nodes_out}; w=/tmp/two_nodes_work; rm -rf "$w"; mkdir -p "$out" "$w/logs"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
left() { echo $((budget - (SECONDS - t0))); }
run_dir() { ls -d "$w/$1"/*/*/ 2>/dev/null | head -1; }  # NAME: the run's folder (named after its flags)
flags=(--profile smoke --model swin_micro --device "$device" --data-dir "$w/data")
python3 -m gallery_lib.app.cli prepare "${flags[@]}" > "$w/logs/prepare.log" 2>&1
train() {  # NAME FLAGS...: one `gallery train` into $w/NAME, its console in logs/$LOG.log (LOG: NAME if unset)
  local name=$1 log=${LOG:-$1} limit=$(( $(left) < 150 ? $(left) : 150 )); shift
  [ "$limit" -gt 20 ] || { echo "[two_nodes] $log: skipped, out of time"; return; }
  timeout "$limit" python3 -m gallery_lib.app.cli train "${flags[@]}" --output-dir "$w/$name" --steps "$steps" \
    --checkpoint_every "$every" --mixed_precision no --set deterministic=true --set log_every=10 "$@" \
    > "$w/logs/$log.log" 2>&1
  echo "[two_nodes] $log: exit $? at $((SECONDS - t0)) s"
}
# NAME PID: SIGKILL the worker of global rank 1 once the run's first checkpoint is written (PID: the run's `train` in
# the background; nothing if it stops before)
kill_rank_1() {
  local run
  until run=$(run_dir "$1"); [ -f "${run}checkpoints/latest" ]; do kill -0 "$2" 2>/dev/null || return; sleep 0.05; done
  for pid in $(pgrep -f gallery_lib.run.train); do  # its workers: torchrun's children (not their data loaders)
    tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null | grep -qxF "${run}config.json" || continue
    grep -q torch.distributed.run "/proc/$(ps -o ppid= -p "$pid" | tr -d ' ')/cmdline" 2>/dev/null || continue
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx RANK=1; then
      kill -9 "$pid" && echo "[two_nodes] $1: killed rank 1 (pid $pid) after $(cat "${run}checkpoints/latest")"
    fi
  done
}
two_nodes() {  # NAME FLAGS...: two `gallery train` nodes of one GPU each, sharing $w/NAME as nodes share a folder
  local port=$((29500 + RANDOM % 1000))
  for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node LOG=$1_node$node train "$1" --nproc_per_node 1 --nnodes 2 --rdzv-backend c10d \
      --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "$1" "${@:2}" &
  done
}

train ref_ddp --nproc_per_node 2
train ref_zero2 --nproc_per_node 2 --set data_parallel=zero2
train kill_ddp --nproc_per_node 2 --set max_restarts=1 & kill_rank_1 kill_ddp $!; wait
train kill_zero2 --nproc_per_node 2 --set data_parallel=zero2 --set max_restarts=1 & kill_rank_1 kill_zero2 $!; wait
two_nodes nodes; wait
two_nodes kill_nodes --set max_restarts=1; kill_rank_1 kill_nodes $!; wait

python3 - "$w" "$out/two_nodes_checks.json" <<'EOF'
import json, sys
from pathlib import Path
from gallery_lib.run.metrics import read_metrics
w = Path(sys.argv[1])
checks = {}
pairs = [("kill_ddp", "ref_ddp"), ("kill_zero2", "ref_zero2"), ("nodes", "ref_ddp"), ("kill_nodes", "ref_ddp")]
for name, ref in pairs:
    run, base = (next(w.glob(f"{n}/*/*/metrics.jsonl"), w / "missing") for n in (name, ref))
    if not run.is_file() or not base.is_file():
        checks[name] = {"error": "no metrics.jsonl"}
        continue
    (steps, summary), (ref_steps, _) = read_metrics(run), read_metrics(base)
    a, b = ({s["step"]: s["loss"] for s in s_} for s_ in (steps, ref_steps))
    logs = "".join(p.read_text() for p in (w / "logs").glob(f"{name}*.log"))
    both = a.keys() & b.keys()
    checks[name] = {"steps": sorted(a) == sorted(b), "max_abs_loss_diff": max(abs(a[k] - b[k]) for k in both),
                    "resumed_from_step": (summary or {}).get("resumed_from_step"),
                    "restarted": "torchrun restart 1 of 1" in logs, "finished": summary is not None,
                    "nodes_with_the_summary": logs.count("\nmetrics: "),
                    "nodes_without": logs.count("this node's part is done")}
    print(f"[two_nodes] {name} vs {ref}: {json.dumps(checks[name])}")
Path(sys.argv[2]).write_text(json.dumps(checks, indent=1) + "\n")
EOF
tar czf "$out/logs.tgz" -C "$w" logs
echo "[two_nodes] done in $((SECONDS - t0)) s"
