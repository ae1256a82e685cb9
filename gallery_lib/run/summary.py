"""The run summary: the last record of ``metrics.jsonl``, which the reports, tests and benchmarks read.

Speed figures are over the steady-state steps (after warm-up), warm-up and compile time are reported apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gallery_lib.accel.distributed import DistInfo, all_reduce_sum
from gallery_lib.config.sections import Data, Job
from gallery_lib.config.sections.training import EMA as EMASettings
from gallery_lib.models.flops import measured_matmul_tflops
from gallery_lib.run.memory_plan import Candidate
from gallery_lib.run.step_log import StepLog
from gallery_lib.run.timing import peak_memory_mb, peak_reserved_mb, seconds_to_steady, summarize_times


def build_summary(dist: DistInfo, step_log: StepLog, *, job: Job, data: Data, ema: EMASettings, steps: int,
                  global_batch_size: int, run_dir: Path, warmup_steps: int, setup_time: float,
                  precompile_seconds: float, probe_seconds: float, skipped_samples: int, nonfinite_steps: int,
                  notes: list[str], flops_per_sample: float | None, profiled_steps: int = 0,
                  **records: Any) -> dict[str, Any]:
    """The summary record of a run of ``steps`` steps at ``global_batch_size`` (its ``job``, ``data`` and ``ema``
    settings, its folder ``run_dir``); ``records`` (task figures, compile and attention reports, ...) are merged in
    last. Every rank calls it: the skipped samples are summed over ranks. The speed figures are over the steps after
    warm-up and before the last ``profiled_steps`` (run under the profiler)."""
    times, losses = step_log.step_times, step_log.losses
    timed = times[warmup_steps:len(times) - profiled_steps]
    timing = summarize_times(timed)
    return {
        "type": "summary", "model": job.model, "recipe": job.recipe, "profile": job.profile,
        "device_name": torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "CPU",
        "world_size": dist.world_size, "global_batch_size": global_batch_size, "image_size": data.image_size,
        "steps": steps, "warmup_steps": warmup_steps, "profiled_steps": profiled_steps,
        "resumed_from_step": step_log.start,
        "setup_time_s": setup_time, "precompile_time_s": precompile_seconds,
        "warmup_time_s": sum(times[:warmup_steps]) / 1e3, **timing, "warmup_step_times_ms": times[:warmup_steps],
        "timed_step_times_ms": timed,  # in order: where a median hides stretches of slow steps, they show here
        # what compilation costs before the run trains at speed: precompilation, then the slow warm-up steps
        "to_steady_speed_s": precompile_seconds + seconds_to_steady(times[:warmup_steps],
                                                                    timing["median_step_time_ms"]),
        "attention_probe_time_s": probe_seconds,  # the side forward that reads PyTorch's SDPA choices
        "samples_per_s": global_batch_size * 1e3 / timing["median_step_time_ms"],
        "peak_mem_mb": peak_memory_mb(dist.device),
        "peak_mem_kind": "cuda_max_allocated" if dist.device.type == "cuda" else "cpu_max_rss",
        "peak_reserved_mb": peak_reserved_mb(dist.device),
        "final_loss": losses[-1], "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]),
        "skipped_samples": int(all_reduce_sum(float(skipped_samples), dist)), "nonfinite_steps": nonfinite_steps,
        "reuse_batch": data.reuse_batch, "notes": notes, "ema": ema.ema, "train_flops_per_sample": flops_per_sample,
        "matmul_tflops": measured_matmul_tflops(dist.device), "torch_version": torch.__version__,
        "output_dir": str(run_dir), **records,
    }


DONE_PREFIX = "[gallery] done: "
"""How the run's last console line starts when it finished (``describe_summary``)."""


def planned_setting(summary: dict[str, Any] | None) -> Candidate | None:
    """The setting the memory plan changed the run to, to fit its GPU; ``None`` where it ran as configured."""
    plan = (summary or {}).get("memory_plan") or {}
    return Candidate(**plan["chosen"]) if plan.get("changed") and plan.get("chosen") else None


def describe_summary(summary: dict[str, Any]) -> str:
    """The run's last log line."""
    after = f" after {summary['precompile_time_s']:.1f} s of precompilation" if summary["precompile_time_s"] else ""
    steady = (summary["steps"] - summary["resumed_from_step"] - summary["warmup_steps"]
              - summary.get("profiled_steps", 0))
    setting = planned_setting(summary)
    planned = f", {setting.describe()} (memory plan)" if setting else ""
    # on a GPU both peaks: the plan and the report weigh the reserved one, which must fit the card
    reserved = (f" allocated, {summary['peak_reserved_mb'] / 1024:.2f} reserved"
                if summary.get("peak_reserved_mb") else "")
    return (f"{DONE_PREFIX}{summary['samples_per_s']:.1f} img/s (median of {steady} steps after warm-up), "
            f"warm-up {summary['warmup_time_s']:.1f} s{after}, peak {summary['peak_mem_mb'] / 1024:.2f} GiB"
            f"{reserved}, final loss {summary['final_loss']:.4f}{planned}")



def compile_caches(summary: dict) -> str | None:
    """``cold`` when the run compiled its graphs (itself: a cache miss or bypass; or in precompile workers, whose
    misses its counters do not see), ``warm`` when it loaded every one from an earlier run's caches; None for an eager
    run."""
    stats = summary.get("compile_cache")
    if not stats:
        return None
    compiled = (stats["aot_autograd_misses"] + stats["fx_graph_misses"] + stats.get("fx_graph_bypasses", 0)
                or summary.get("precompile"))
    return "cold" if compiled else "warm"
