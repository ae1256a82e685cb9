"""A GPU script's result file: the record's own fields (command, cap, exit code...) with each run's summary under a
folder (``metrics.jsonl``'s summary line and step losses, ``failure.json``), keyed by the run's folder name.

    python3 benchmarks/run_summaries.py OUT.json RUNS_DIR key=value ...   (a value that reads as JSON is read so)
"""
import glob
import json
import os
import sys

import torch

from gallery_lib.reports.provenance import result_header

SUMMARY = ("samples_per_s", "median_step_time_ms", "p20_step_time_ms", "p80_step_time_ms", "peak_mem_mb",
           "peak_reserved_mb", "global_batch_size", "memory_plan", "final_loss", "warmup_time_s", "precompile_time_s",
           "steps")


def _value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_entry(run_dir):
    entry = {}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        lines = [json.loads(line) for line in open(metrics) if line.strip()]
        summary = next((line for line in reversed(lines) if line.get("type") == "summary"), None)
        if summary:
            entry = {key: summary.get(key) for key in SUMMARY}
        entry["losses"] = [line.get("loss") for line in lines if line.get("type") == "step"]
    failure = os.path.join(run_dir, "failure.json")
    if os.path.exists(failure):
        entry["failure"] = json.load(open(failure))
    return entry


def main(path, runs, *fields):
    # the script's own fields after the header: its ``command`` is the device script's, not this helper's
    record = {**result_header(), **{key: _value(value) for key, value in (field.split("=", 1) for field in fields)},
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    record["runs"] = {os.path.basename(run_dir.rstrip("/")): run_entry(run_dir)
                      for run_dir in sorted(glob.glob(f"{runs}/*/*/"))}
    json.dump(record, open(path, "w"), indent=1)
    for name, entry in record["runs"].items():
        plan = (entry.get("memory_plan") or {}).get("note", "")
        print(name, entry.get("samples_per_s"), (entry.get("peak_reserved_mb") or 0) / 1024, plan, entry.get("failure"))


if __name__ == "__main__":
    main(*sys.argv[1:])
