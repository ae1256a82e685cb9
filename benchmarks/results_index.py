"""The results as data: one row per measured run of a recipe (or a bench variant) in ``benchmarks/results.jsonl``.

Every result file under ``benchmarks/results/`` that records runs is read: ``gallery bench`` records (``rows``, one per
model and recipe; ``gallery bench --timm-model``'s name the ``variant``), ``benchmarks/bench_recipes.py`` records
(``results``, one per recipe), the ladders' merged records (``rows``, one per rung: ``benchmarks/bench_ladder.py
--merge`` and the ``your_model`` notebook's) and the memory plan's cap runs (``runs``, one per recipe,
``benchmarks/gpu_memory_caps.sh``). A row says where it came from (the file, its commit and source hash, the
command's machine and stack) and what was measured: model, recipe (a ladder's rung), batch per process and the
processes, samples per second, the step time's p20 / median / p80, the peak reserved and allocated GPU memory, and,
where recorded, the seconds to steady speed with the compile caches' state. Rows that record no speed (a failed run,
a CPU run of the memory bench) are left out; the files that record something else (kernel sweeps, loss curves, logs)
stay the evidence that ``RESULTS.md`` cites.

    python benchmarks/results_index.py           # writes benchmarks/results.jsonl
    python benchmarks/results_index.py --check   # exit status 1 when the committed index differs from the files
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
INDEX = BENCHMARKS / "results.jsonl"
FIELDS = ("file", "commit", "source_sha256", "date", "gpu", "torch", "model", "recipe", "batch_size", "processes",
          "samples_per_s", "step_ms_p20", "step_ms_p50", "step_ms_p80", "peak_reserved_gib", "peak_allocated_gib",
          "to_steady_s", "compile_caches")


def index_rows(results: Path = RESULTS) -> list[dict[str, Any]]:
    """The index's rows for every result file under ``results``, in file order then the file's own order."""
    rows = []
    for path in sorted(results.rglob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # not a record (a truncated copy): the index reads records only
        if isinstance(record, dict):
            rows += [{field: row.get(field) for field in FIELDS}
                     for row in _measured(record, path.relative_to(results).as_posix())]
    return rows


def _measured(record: dict[str, Any], file: str) -> Iterator[dict[str, Any]]:
    source = {"file": file, "commit": _short(record.get("commit")), "source_sha256": record.get("source_sha256"),
              "date": record.get("date"), "gpu": record.get("gpu") or record.get("device"),
              "torch": record.get("torch") or _first_part(record).get("torch")}
    for row in _dicts(record.get("rows")):
        if row.get("samples_per_s") and (row.get("recipe") or row.get("variant")):
            yield {**source, **_bench_row(row), "gpu": source["gpu"] or row.get("device")}
        elif row.get("rung") and row.get("img_per_s"):
            yield {**source, **_rung(row, record), "gpu": source["gpu"] or row.get("device")}
    for run in _dicts(record.get("results")):
        if run.get("samples_per_s") and run.get("recipe") and run.get("median_step_time_ms"):
            yield {**source, **_recipe_run(run["recipe"], run, record.get("model"))}
    runs = record.get("runs")
    for recipe, run in (runs.items() if isinstance(runs, dict) else ()):
        if isinstance(run, dict) and run.get("samples_per_s"):
            yield {**source, **_recipe_run(recipe, run, _flag(record.get("command", ""), "--model"))}


def _bench_row(row: dict[str, Any]) -> dict[str, Any]:
    """A ``gallery bench`` row (``gallery_lib.reports.bench``): its peak memory is the allocated one."""
    allocated = row.get("peak_mem_gib") if row.get("peak_mem_kind") == "cuda_max_allocated" else None
    return {"model": row.get("model"), "recipe": row.get("recipe") or row.get("variant"),
            "batch_size": row.get("batch_size"), "processes": row.get("processes"),
            "samples_per_s": row["samples_per_s"], "step_ms_p20": row.get("p20_step_ms"),
            "step_ms_p50": row.get("median_step_ms"), "step_ms_p80": row.get("p80_step_ms"),
            "peak_reserved_gib": row.get("peak_reserved_gib"), "peak_allocated_gib": allocated,
            "to_steady_s": row.get("to_steady_s"), "compile_caches": row.get("compile_caches")}


def _rung(row: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """A ladder's rung: the recipe is the rung's name (``benchmarks/bench_ladder.py``) or its label (the
    ``your_model`` notebook's ladder, which records one batch size for all its rungs)."""
    return {"model": record.get("model"), "recipe": row.get("name") or row["rung"],
            "batch_size": row.get("batch_size") or record.get("batch_size"), "processes": 1,
            "samples_per_s": row["img_per_s"], "step_ms_p20": row.get("p20_step_ms", row.get("p20_step_time_ms")),
            "step_ms_p50": row.get("median_step_ms", row.get("median_step_time_ms")),
            "step_ms_p80": row.get("p80_step_ms", row.get("p80_step_time_ms")),
            "peak_reserved_gib": row.get("peak_reserved_gib"), "peak_allocated_gib": row.get("peak_mem_gib"),
            "to_steady_s": None, "compile_caches": row.get("compile_caches")}


def _recipe_run(recipe: str, run: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A run of ``benchmarks/bench_recipes.py`` or of the memory plan under a cap (``benchmarks/gpu_memory_caps.sh``,
    one process): memory in MB, the batch per process the global one over the processes."""
    processes = run.get("world_size") or 1
    batch = run.get("global_batch_size")
    return {"model": model, "recipe": recipe, "batch_size": batch // processes if batch else None,
            "processes": processes, "samples_per_s": run["samples_per_s"],
            "step_ms_p20": run.get("p20_step_time_ms"), "step_ms_p50": run.get("median_step_time_ms"),
            "step_ms_p80": run.get("p80_step_time_ms"), "peak_reserved_gib": _gib(run.get("peak_reserved_mb")),
            "peak_allocated_gib": _gib(run.get("peak_mem_mb")), "to_steady_s": None, "compile_caches": None}


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _first_part(record: dict[str, Any]) -> dict[str, Any]:
    """A merged ladder's first part (``parts``), which names the stack its rungs ran on."""
    parts = _dicts(record.get("parts"))
    return parts[0] if parts else {}


def _gib(mb: float | None) -> float | None:
    return None if mb is None else mb / 1024


def _short(commit: Any) -> str | None:
    return commit[:7] if isinstance(commit, str) and commit else None


def _flag(command: str, flag: str) -> str | None:
    """The value of ``flag`` in a recorded shell command (``--model sd15``), or ``None``."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return next((value for name, value in zip(words, words[1:]) if name == flag), None)


def render(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, sort_keys=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed index instead of writing it")
    args = parser.parse_args(argv)
    text = render(index_rows())
    if not args.check:
        INDEX.write_text(text, encoding="utf-8")
        print(f"wrote {INDEX} ({text.count(chr(10))} rows)")
        return 0
    if INDEX.exists() and INDEX.read_text(encoding="utf-8") == text:
        return 0
    print(f"{INDEX} is not what the result files give: run python benchmarks/results_index.py and commit it",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
