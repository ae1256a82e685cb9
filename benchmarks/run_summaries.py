"""A GPU script's result file: the record's own fields (command, cap, exit code...) with each run's summary under a
folder (``metrics.jsonl``'s summary line and step losses, ``failure.json``), keyed by the run's folder name (a run
deeper than ``<model>/<recipe>/``: by the folders above its model and its own, ``model_step/accelerated``).

    python3 benchmarks/run_summaries.py OUT.json RUNS_DIR key=value ...   (a value that reads as JSON is read so)
"""
import glob
import json
import os
import sys
from dataclasses import asdict

import torch

from gallery_lib.reports.comparison import METRICS_FILE
from gallery_lib.reports.provenance import result_header
from gallery_lib.run.failure import FAILURE_FILE, read_failure
from gallery_lib.run.metrics import read_metrics

STEP_LADDER = "your_model/ladder.json"
SUMMARY = ("samples_per_s", "median_step_time_ms", "p20_step_time_ms", "p80_step_time_ms", "peak_mem_mb",
           "peak_reserved_mb", "global_batch_size", "memory_plan", "final_loss", "warmup_time_s", "precompile_time_s",
           "steps")


def _value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run_entry(run_dir):
    """What a run folder says, read as the reports read it (a line cut short by a killed run is skipped)."""
    entry = {}
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.exists(metrics):
        steps, summary = read_metrics(metrics)
        if summary:
            entry = {key: summary.get(key) for key in SUMMARY}
        entry["losses"] = [step.get("loss") for step in steps]
    failure = read_failure(run_dir)
    if failure is not None:
        entry["failure"] = asdict(failure)
    return entry


def run_dirs(runs):
    """Every run's folder under ``runs``: ``<model>/<recipe>/``, and deeper (the Swin-T notebook's runs of the training
    step alone: ``model_step/<model>/<recipe>/``); a folder with neither metrics nor a failure is not a run."""
    found = {os.path.dirname(path) for name in (METRICS_FILE, FAILURE_FILE)
             for path in glob.glob(f"{runs}/**/{name}", recursive=True)}
    return sorted(found, key=lambda run_dir: (run_dir.count(os.sep), run_dir))


def run_name(runs, run_dir):
    """``<recipe>`` for ``<model>/<recipe>/``; deeper, the folders above the model's kept: ``model_step/<recipe>``."""
    parts = os.path.relpath(run_dir, runs).split(os.sep)
    return "/".join(parts[:-2] + parts[-1:])


def step_ladder_entries(runs):
    """The ``your_model`` notebook's rungs (trained in its own process, without run folders), from the ladder it saved:
    ``your_model/<rung>`` with its speed, or the one line of a rung that ran out of memory."""
    path = os.path.join(runs, STEP_LADDER)
    if not os.path.exists(path):
        return {}
    ladder = json.load(open(path))
    entries = {f"your_model/{row['rung']}": {
        "samples_per_s": row["img_per_s"], "global_batch_size": ladder["batch_size"],
        **{key: row[key] for key in ("median_step_time_ms", "p20_step_time_ms", "p80_step_time_ms")},
        **({"peak_reserved_mb": row["peak_reserved_gib"] * 1024} if row.get("peak_reserved_gib") else {})}
        for row in ladder["rows"]}
    entries.update({f"your_model/{rung}": {"failure": {"kind": "out_of_memory", "reason": line}}
                    for rung, line in ladder.get("stopped", {}).items()})
    return entries


def main(path, runs, *fields):
    # the script's own fields after the header: its ``command`` is the device script's, not this helper's
    record = {**result_header(), **{key: _value(value) for key, value in (field.split("=", 1) for field in fields)},
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    record["runs"] = {run_name(runs, run_dir): run_entry(run_dir) for run_dir in run_dirs(runs)}
    record["runs"].update(step_ladder_entries(runs))
    json.dump(record, open(path, "w"), indent=1)
    for name, entry in record["runs"].items():
        plan = (entry.get("memory_plan") or {}).get("note", "")
        print(name, entry.get("samples_per_s"), (entry.get("peak_reserved_mb") or 0) / 1024, plan, entry.get("failure"))


if __name__ == "__main__":
    main(*sys.argv[1:])
