"""``gallery bench --timm-model NAME`` or ``--diffusers-model CLASS``: a model the user brings, timed as ``gallery
bench`` times the families.

One freshly built model, deep-copied three times from the same initial weights, trains through one plain loop (the
``your_model`` notebook's: bf16 autocast, fused AdamW and cuDNN's autotuning on a GPU, as timm's ``train.py`` and the
families' runs set it; random batches made once; the model's loss:
cross-entropy for a timm classifier, the noise's mean squared error for a diffusers denoiser; ``bench_workloads``):

- ``eager``: the model as built;
- ``peer``: what a skilled PyTorch user writes: ``model.compile(mode="reduce-overhead")`` on a GPU (plain
  ``model.compile()`` on a CPU), plus channels_last on a GPU for a network with convolutions beyond its stem;
- ``accelerated``: ``accelerate(model, example=..., loss_fn=...)`` on the first batch, under the loop's
  autocast: each change kept only where it times faster on this model (the whole model compiled tried in place of
  its blocks), each ``Change`` it returns kept as text, and the seconds its timing took as ``setup_s``.

The result file (the machine, the command, one row per variant; with ``profile_steps``, each row's kernel time by kind
over that many steps after its timed ones), its markdown table (``.md``) and its figure (``.png``, ``StepLadder``'s)
are written together. On a CPU the rows check the code path: no ratio and no speed bar.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gallery_lib.app.bench_workloads import Batch, Workload
from gallery_lib.config import ConfigError

VARIANTS = ("eager", "peer", "accelerated")
BATCHES = 4
"""Random batches made once and cycled through, as the notebook does."""
TIMING = ("each variant's training steps in one process (the your_model notebook's loop: forward, the model's loss, "
          "backward, AdamW step; cuDNN's autotuning on a GPU) on random batches made once; CUDA events per step (wall "
          "clock on a CPU); median with p20/p80 over the steps after warm-up; warmup_s = the warm-up steps "
          "(compilation, CUDA-graph capture); "
          "setup_s = the variant's changes before its first step (accelerate's timed steps)")


@dataclass(frozen=True)
class ModelBench:
    """What one ``gallery bench --timm-model`` or ``--diffusers-model`` call trains, resolved for the device it runs
    on."""

    workload: Workload
    device: str
    batch_size: int
    image_size: int
    steps: int
    """Steps per variant, warm-up included."""
    warmup_steps: int
    profile_steps: int = 0
    """Steps after the timed ones run under ``torch.profiler``: each variant's kernel time per step by kind, in its
    row (``profile``), left out of its timing."""


PROFILED_TIMINGS = ("profiled: the variants after the first profiled one may time slower, since the profiler can leave "
                    "CUPTI running in the process (benchmarks/RESULTS.md#dreambooth); take speeds and ratios from a "
                    "run without --profile-steps")

DEFAULTS = {("timm", "cuda"): dict(batch_size=128, image_size=224, steps=60, warmup_steps=25),
            ("timm", "cpu"): dict(batch_size=4, image_size=32, steps=6, warmup_steps=3),
            ("diffusers", "cuda"): dict(batch_size=64, image_size=32, steps=60, warmup_steps=25),
            ("diffusers", "cpu"): dict(batch_size=2, image_size=8, steps=4, warmup_steps=2)}
"""On a GPU, a timm model at the sizes ``benchmarks/gpu_your_model.sh`` runs the notebook at, a denoiser on 32x32
samples (the latents of 256 px images: DiT's ImageNet size); on a CPU tiny ones (a denoiser without
``--model-config`` in its ``CPU_CONFIGS`` layout): there the timings check the code path, not speed."""


def resolve_bench(model: str | Workload, *, batch_size: int | None = None, image_size: int | None = None,
                  steps: int | None = None, warmup_steps: int | None = None, device: str | None = None,
                  profile_steps: int | None = None) -> ModelBench:
    """The bench of ``model`` (a timm name, or a ``Workload``) on ``device`` (default: the GPU if torch sees one),
    each size given or the device's default; ``ConfigError`` for an unknown name or sizes that time too few steps,
    before anything is built."""
    from gallery_lib.app.bench import GPU_TIMED_STEPS

    workload = Workload("timm", model) if isinstance(model, str) else model
    workload.check()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    workload = workload.on(device)
    given = dict(batch_size=batch_size, image_size=image_size, steps=steps, warmup_steps=warmup_steps)
    sizes = {key: DEFAULTS[workload.kind, device][key] if value is None else value for key, value in given.items()}
    if steps is not None and warmup_steps is None:  # as a run's profile: warm-up at most a third of fewer steps
        sizes["warmup_steps"] = min(sizes["warmup_steps"], steps // 3)
    for key in ("batch_size", "image_size", "steps"):
        if sizes[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')} {sizes[key]} is invalid: expected a positive integer.")
    if not 0 <= sizes["warmup_steps"] < sizes["steps"]:
        raise ConfigError(f"--steps {sizes['steps']} / --warmup-steps {sizes['warmup_steps']}: the steps count the "
                          "warm-up, so there must be more of them than of warm-up steps (and no negative warm-up).")
    if (profile_steps or 0) < 0:
        raise ConfigError(f"--profile-steps {profile_steps} is invalid: expected 0 or more steps to profile.")
    timed = sizes["steps"] - sizes["warmup_steps"]
    if device == "cuda" and timed < GPU_TIMED_STEPS:
        raise ConfigError(f"--steps {sizes['steps']} with --warmup-steps {sizes['warmup_steps']} times {timed} steps: "
                          f"too few on a GPU, where the bench times at least {GPU_TIMED_STEPS} after warm-up (median, "
                          "p20 and p80 need them).")
    return ModelBench(workload, device, **sizes, profile_steps=profile_steps or 0)


def parse_batch_size(values: Sequence[str]) -> int | None:
    """``--batch-size`` with ``--timm-model``: one positive number, or none given (``None``)."""
    if not values:
        return None
    if len(values) == 1 and values[0].strip().isdigit() and int(values[0]) > 0:
        return int(values[0])
    raise ConfigError(f"--batch-size {' '.join(values)!r} with --timm-model or --diffusers-model: expected one "
                      "positive integer, e.g. --batch-size 64.")


def build_model(bench: ModelBench) -> torch.nn.Module:
    """The model with random weights (seed 0), on the CPU: each variant deep-copies it onto the device."""
    return bench.workload.build(bench.image_size)


def make_batches(bench: ModelBench, model: torch.nn.Module) -> list[Batch]:
    """``BATCHES`` random batches for ``model`` on the device, made once for every variant."""
    return bench.workload.batches(model, BATCHES, bench.batch_size, bench.image_size, bench.device)


def apply_variant(variant: str, model: torch.nn.Module, device: str, batch: Batch | None = None,
                  workload: Workload | None = None, progress: Callable[[str], Any] | None = None) -> list[str]:
    """Changes ``model`` in place as ``variant`` does; what changed, as text. ``accelerated`` times its changes on
    ``batch`` with ``workload``'s loss where both are given, and says each timing to ``progress`` as it ends."""
    from gallery_lib.accel.on_any_model import accelerate, has_convolutions_beyond_a_stem, use_channels_last

    on_gpu = device == "cuda"
    if variant == "accelerated":
        if batch is None or workload is None:
            return [str(change) for change in accelerate(model, echo=None)]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=on_gpu):  # timed in the loop's precision
            changes = accelerate(model, example=workload.example(batch), echo=None, progress=progress,
                                 loss_fn=lambda output: workload.loss(output, batch.target))
        return [str(change) for change in changes]
    if variant != "peer":
        return []
    said = []
    if on_gpu and has_convolutions_beyond_a_stem(model):  # as accelerate lays them out
        said.append(use_channels_last(model, device_type=device).note)
    model.compile(mode="reduce-overhead" if on_gpu else None)
    said.append("torch.compile of the whole model" + (', mode="reduce-overhead" (CUDA graphs)' if on_gpu else ""))
    return said


def train(model: torch.nn.Module, workload: Workload, batches: Sequence[Batch], steps: int,
          device: str, profile_steps: int = 0) -> tuple[list[float], list[float], dict | None]:
    """The plain loop every variant trains through: ``steps`` optimizer steps; each step's loss and time in ms; then
    ``profile_steps`` more under ``torch.profiler``, untimed: their kernel table (``None`` without them)."""
    from gallery_lib.run.profiling import StepProfiler
    from gallery_lib.run.timing import StepTimer

    on_gpu = device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)
    timer, losses = StepTimer(torch.device(device)), []
    profiler = StepProfiler(profile_steps, steps, torch.device(device), run_dir=None)  # its table, no file
    torch.manual_seed(0)  # the same random draws in every variant's steps (DiT drops a tenth of its class labels)
    timer.mark()
    for step in range(steps + profile_steps):
        if step == steps:
            times_ms = timer.collect()  # the timed steps end here: the profiler slows the ones after
        profiler.before_step(step)
        batch = batches[step % len(batches)]
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=on_gpu):
            loss = workload.loss(workload.forward(model, batch), batch.target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        timer.mark()
        profiler.after_step(step)
    if not profile_steps:
        times_ms = timer.collect()
    return [loss.item() for loss in losses[:steps]], times_ms, profiler.table


def run_model_bench(bench: ModelBench, out: Path, *, command: str,
                    echo: Callable[[str], Any] | None = print) -> dict:
    """Trains the three variants in turn and writes ``out`` (the record), its ``.md`` table and ``.png`` figure. A
    variant that fails (out of memory, a model Dynamo cannot trace) becomes a row with an ``error``, and the bench
    goes on."""
    from gallery_lib.app.bench import machine_record, write_record
    from gallery_lib.reports.comparison import CPU_TIMINGS
    from gallery_lib.reports.step_ladder import StepLadder

    say = echo or (lambda line: None)
    initial = build_model(bench)
    batches = make_batches(bench, initial)
    parameters = sum(p.numel() for p in initial.parameters())
    say(f"[bench] {bench.workload.label} at {bench.image_size} px, {parameters / 1e6:.1f}M parameters, batch "
        f"{bench.batch_size} on {bench.device}, {bench.steps} steps per variant ({bench.warmup_steps} of warm-up)")
    ladder = StepLadder(batch_size=bench.batch_size, warmup=bench.warmup_steps, device=bench.device)
    peaks: dict[str, float | None] = {}
    profiles: dict[str, dict | None] = {}
    setups: dict[str, float] = {}
    errors: dict[str, str] = {}
    cudnn = torch.backends.cudnn
    for variant in VARIANTS:
        say(f"[bench] {variant}")
        try:  # cuDNN's autotuning for every variant, accelerate's timed steps included
            with cudnn.flags(enabled=cudnn.enabled, benchmark=bench.device == "cuda",
                             deterministic=cudnn.deterministic, allow_tf32=cudnn.allow_tf32):
                changes, losses, times_ms, peaks[variant], setups[variant], profiles[variant] = _train_variant(
                    variant, initial, batches, bench, say)
        except Exception as exc:  # the other variants still measure
            errors[variant] = failure_reason(exc)
            say(f"[bench]   failed: {errors[variant]}")
        else:
            row = ladder.add(variant, losses, times_ms, changes, peer=variant == "peer")
            say(f"[bench]   -> {row['median_step_time_ms']:.1f} ms/step")
        finally:
            _release(bench.device)
    ladder_rows = {row["rung"]: (row, rung) for row, rung in zip(ladder.rows(), ladder.rungs)}
    rows = [result_row(bench, *ladder_rows[variant], peaks[variant], setups[variant], profiles[variant])
            if variant in ladder_rows
            else {"model": bench.workload.label, "variant": variant, "batch_size": bench.batch_size,
                  "image_size": bench.image_size, "error": errors[variant]} for variant in VARIANTS]
    on_cpu = bench.device == "cpu"
    record = machine_record(command, profile=None, timing=TIMING)
    record.pop("goals")  # the families' speed goals: none for a model the gallery does not know
    named = {"timm_model": bench.workload.name} if bench.workload.kind == "timm" else {
        "diffusers_model": bench.workload.name, "model_config": bench.workload.config}
    record.update(device=torch.cuda.get_device_name() if not on_cpu else "CPU", **named, parameters=parameters,
                  batch_size=bench.batch_size, image_size=bench.image_size, steps=bench.steps,
                  warmup_steps=bench.warmup_steps, rows=rows,
                  accelerated_over_peer=next(r.get("over_peer") for r in rows if r["variant"] == "accelerated"),
                  note=f"{CPU_TIMINGS}." if on_cpu else f"{PROFILED_TIMINGS}." if bench.profile_steps else None)
    write_record(record, out)
    out.with_suffix(".md").write_text(model_table(record) + "\n", encoding="utf-8")
    if ladder.rungs:
        ladder.figure().savefig(out.with_suffix(".png"), dpi=110)
    return record


def _train_variant(variant: str, initial: torch.nn.Module, batches: Sequence[Batch], bench: ModelBench,
                   say: Callable[[str], Any]) -> tuple[list[str], list[float], list[float], float | None, float,
                                                       dict | None]:
    """A fresh copy of ``initial`` changed as ``variant`` does and trained: what changed, the losses, the step times,
    the peak reserved memory (MiB; ``None`` on a CPU), the seconds the changes took and the profiled steps' kernel
    table (``None`` unless ``bench.profile_steps``)."""
    from gallery_lib.run.timing import peak_reserved_mb, reset_peak_memory

    device = torch.device(bench.device)
    model = copy.deepcopy(initial).to(device)
    start = time.perf_counter()
    changes = apply_variant(variant, model, bench.device, batches[0], bench.workload,
                            progress=lambda line: say(f"[bench]   timing {line}"))
    setup_s = time.perf_counter() - start
    for change in changes:
        say(f"[bench]   {change}")
    reset_peak_memory(device)
    losses, times_ms, profile = train(model, bench.workload, batches, bench.steps, bench.device, bench.profile_steps)
    if profile is not None:
        say(f"[bench]   profile of {bench.profile_steps} steps after the timed ones: "
            + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in profile["by_kind_ms"].items()))
    return changes, losses, times_ms, peak_reserved_mb(device), setup_s, profile


def failure_reason(exc: BaseException) -> str:
    """What stopped a variant, in a few words."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return "out of memory"
    return text.splitlines()[0][:200]


def result_row(bench: ModelBench, ladder_row: dict, rung: Any, peak_reserved_mb: float | None,
               setup_s: float, profile: dict | None = None) -> dict:
    """One variant's row, in the families' bench's names; no ratio on a CPU."""
    on_cpu = bench.device == "cpu"
    return {"model": bench.workload.label, "variant": ladder_row["rung"], "batch_size": bench.batch_size,
            "image_size": bench.image_size, "samples_per_s": ladder_row["img_per_s"],
            "median_step_ms": ladder_row["median_step_time_ms"], "p20_step_ms": ladder_row["p20_step_time_ms"],
            "p80_step_ms": ladder_row["p80_step_time_ms"], "setup_s": setup_s, "warmup_s": ladder_row["warmup_s"],
            "peak_reserved_gib": None if peak_reserved_mb is None else peak_reserved_mb / 1024,
            "final_loss": rung.losses[-1], "loss_difference": ladder_row["loss_difference"],
            "losses": [round(loss, 5) for loss in rung.losses],  # each step's: where variants part, not only how far
            "over_peer": None if on_cpu else ladder_row["over_peer"],
            "timed_steps": bench.steps - bench.warmup_steps, "warmup_steps": bench.warmup_steps,
            "changes": ladder_row["changes"],
            "warmup_step_ms": [round(ms, 1) for ms in rung.times_ms[:bench.warmup_steps]],
            **({"profile": profile} if profile is not None else {})}


def model_table(record: dict) -> str:
    """The record's rows as a markdown table; on a CPU the ratio column says it is none, and a line says why."""
    from gallery_lib.reports.comparison import speedup_text

    device = record["device"]
    name = record.get("timm_model") or f"diffusers.{record['diffusers_model']}"
    lines = [f"`{name}` at {record['image_size']} px, batch {record['batch_size']}, on {device}: "
             f"{record['steps'] - record['warmup_steps']} timed steps after {record['warmup_steps']} of warm-up.", "",
             "| variant | img/s | step ms: median (p20-p80) | vs peer | setup s | warm-up s | peak reserved GiB | "
             "final loss |", "|---" * 8 + "|"]
    for row in record["rows"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | error: {row['error']} | | | | | | |")
            continue
        memory = "" if row["peak_reserved_gib"] is None else f"{row['peak_reserved_gib']:.2f}"
        setup = "" if row.get("setup_s") is None else f"{row['setup_s']:.1f}"  # records from before it was kept
        lines.append(f"| {row['variant']} | {row['samples_per_s']:,.1f} | {row['median_step_ms']:.1f} "
                     f"({row['p20_step_ms']:.1f}-{row['p80_step_ms']:.1f}) | "
                     f"{speedup_text(row['over_peer'], device)} | {setup} | "
                     f"{row['warmup_s']:.1f} | {memory} | "
                     f"{row['final_loss']:.4f} |")
    if record.get("note"):  # a CPU's timings, or a profiled run's
        lines += ["", record["note"]]
    return "\n".join(lines)


def _release(device: str) -> None:
    """Frees what a variant left behind, so the next one's peak memory is its own: Dynamo's compiled code and the
    CUDA-graph memory pools it holds, then the allocator's cache."""
    gc.collect()
    torch.compiler.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
