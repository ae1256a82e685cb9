# A whole notebook in its full profile under a memory cap, as on a smaller card, timed from its first cell to its last:
# its code cells in one process (benchmarks/run_notebook_code.py; the GPU machine has no Jupyter), the GPU's memory
# sampled beside it. $OUT gets the log, notebook_<NAME>.json (command, commit, source hash, cap, wall time, each run's
# summary and failure), the notebook's report, its runs' logs (run_logs_<NAME>.tar.gz: where a stopped notebook's
# time went) and the machine's footprints after it (memory_footprints_after_<NAME>.json). Carry .whl (diffusers, the
# cuDNN frontend).
#   device run: GALLERY_COMMIT=<sha> bash benchmarks/gpu_notebook.sh NAME NOTEBOOK CAP ['{"steps": 40}']
#   e.g. bash benchmarks/gpu_notebook.sh sd_22 stable_diffusion 22
# FOOTPRINTS_FROM=<a committed memory_footprints_after_*.json of the same GPU model> adds what an earlier session's runs
# learned to this machine's footprints before the notebook starts (as on a user's card the second time: settings that
# ran out of memory are not tried again); the record names the file (footprints_from) and README's row says so.
# CAP "free:G" instead: no cap; a ballast process (gpu_ballast.py) holds all but G GiB of the GPU, which the notebook's
# kernel and its runs then share as on a card with G GiB free (README's card tables name each card's).
name=$1; notebook=$2; cap=$3; extra=${4:-"{}"}
source "$(dirname "$0")/device_env.sh"
out=${OUT:-benchmarks/results}
runs=/tmp/notebook_$name
ballast=""
if [[ $cap == free:* ]]; then
  python3 benchmarks/gpu_ballast.py "${cap#free:}" > "$out/ballast_$name.log" 2>&1 &
  ballast=$!
  until grep -q "gpu_ballast" "$out/ballast_$name.log" || ! kill -0 "$ballast" 2>/dev/null; do sleep 1; done
  cat "$out/ballast_$name.log"
fi
params=$(python3 -c "import json, sys; cap = sys.argv[1]
print(json.dumps({'profile': 'full', **({} if cap.startswith('free:') else {'gpu_memory_gib': float(cap)}),
  'output_dir': sys.argv[2], **json.loads(sys.argv[3])}))" "$cap" "$runs" "$extra")
footprints=""
if [[ -n ${FOOTPRINTS_FROM:-} ]]; then
  python3 - "$FOOTPRINTS_FROM" <<'PY' || exit 1
import json, sys
from gallery_lib.run.learned_footprints import cache_path
mine = cache_path()
here = json.loads(mine.read_text()) if mine.exists() else {}
earlier = json.loads(open(sys.argv[1]).read())
mine.parent.mkdir(parents=True, exist_ok=True)
mine.write_text(json.dumps({**earlier, **here}, indent=1))  # what this machine measured itself wins
print(f"footprints: {len(set(earlier) - set(here))} entries from {sys.argv[1]} added to {mine}")
PY
  footprints="footprints_from=$FOOTPRINTS_FROM"
fi
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$out/smi_$name.csv" 2>&1 &
sampler=$!
start=$SECONDS
(cd notebooks && timeout "${NOTEBOOK_TIMEOUT_S:-86400}" python3 ../benchmarks/run_notebook_code.py "$notebook.ipynb" \
  "$params") > "$out/notebook_$name.log" 2>&1
code=$?
kill "$sampler" $ballast 2>/dev/null; gzip -f "$out/smi_$name.csv"
python3 benchmarks/run_summaries.py "$out/notebook_$name.json" "$runs" \
  command="bash benchmarks/gpu_notebook.sh $name $notebook $cap '$extra'" notebook="$notebook" cap_gib="$cap" \
  params="$params" exit_code="$code" wall_s="$((SECONDS - start))" $footprints
cp "$runs"/*/report.md "$out/" 2>/dev/null
# what the runs learned of this GPU, for FOOTPRINTS_FROM in a later session
python3 -c "from gallery_lib.run.learned_footprints import cache_path; print(cache_path())" | xargs -I{} cp {} \
  "$out/memory_footprints_after_$name.json" 2>/dev/null
(cd "$runs" 2>/dev/null && find . \( -name '*.log' -o -name metrics.jsonl \) -print0 |
  tar czf "$out/run_logs_$name.tar.gz" --null -T -)
echo "notebook $notebook under $cap GiB: rc=$code in $((SECONDS - start)) s"; tail -5 "$out/notebook_$name.log"
