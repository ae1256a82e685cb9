"""The one training loop every model and recipe uses.

Started by ``launch.py`` under torchrun (``python -m gallery_lib.run.train --config run_dir/config.json``),
or called in-process with ``run(cfg)`` for single-process runs and tests. It writes the run's
``metrics.jsonl`` (one record per step, a summary at the end) and ``logs/rank<N>.log``.

Speed hygiene: losses and timings stay on the device and are read back every ``log_every`` steps,
step boundaries are CUDA events, and warm-up steps (compilation, autotuning) are reported apart
from the steady-state figures.

Reliability: ``checkpoint.py`` saves every ``checkpoint_every`` steps (on a logging boundary, and the
timer restarts after it, so no step time includes a save) and ``resume`` continues a run exactly.
A non-finite loss skips the optimizer step on every rank; ``max_nonfinite_steps`` in a row stop the run with a
checkpoint. Two ways to decide (``nonfinite_guard``):

- ``device``, with fused AdamW and no GradScaler (the compiled and accelerated recipes): the optimizer gets a device
  flag (``found_inf``, the mechanism GradScaler uses) and skips its own update; no host sync. The learning-rate
  schedule and the EMA still advance on a skipped step (the weights did not move, so the EMA only moves towards
  them), and a run of skips is noticed at the next logging step. Measured on an H200 (SD-1.5, batch 8): the
  per-step host sync of the other mode cost ~35% of the accelerated step.
- ``host`` otherwise: the loss is read on the host after backward (one sync per step, plus a one-element all-reduce
  when distributed) and the optimizer, scheduler and EMA are not stepped at all; fp16 runs sync there anyway in
  ``GradScaler.step``.

``max_nonfinite_steps=0`` turns the check off.

Out of memory: with ``find_batch_size`` the run first searches for the largest batch that fits, each trial a
short real run (``batch_size.search_run_batch_size``), then trains from scratch at the chosen size. Resume: the
metrics lines logged after the checkpoint by the stopped run move to ``metrics.superseded.jsonl``.

Bad data: unreadable images are skipped by the dataset; every ``log_every`` steps the run stops with an error if more
than ``max_bad_fraction`` of the loads failed (a shared counter read, no device sync). Restarts: when torchrun
restarts the workers (``max_restarts``) and the run has a checkpoint, the new workers resume from it on their own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import random
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from gallery_lib.accel.accelerate import apply_accelerations
from gallery_lib.run.batch_size import search_run_batch_size
from gallery_lib.run.checkpoint import LATEST, Checkpointer, check_fresh_start, checkpoint_dir
from gallery_lib.config import CUDA_GRAPH_COMPILE_MODES, RunConfig, validate_for_machine
from gallery_lib.accel.distributed import DistInfo, all_reduce_sum, exit_process, init_distributed, shutdown
from gallery_lib.run.metrics import MetricsWriter, superseded_path, supersede_steps
from gallery_lib.models.flops import measured_matmul_tflops
from gallery_lib.accel.precision import Precision
from gallery_lib.run.logs import rank_logging
from gallery_lib.tasks import build_task
from gallery_lib.run.timing import StepTimer, peak_memory_mb, reset_peak_memory, summarize_times


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def configure_backends(cfg: RunConfig) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls, as every GPU trainer enables


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, precision: Precision) -> torch.optim.Optimizer:
    """AdamW without weight decay on norms, biases and position tables (the Swin reference; diffusers decays every
    UNet parameter, but the UNet's 1-D tensors are a rounding error of its 860M parameters)."""
    from timm.optim import param_groups_weight_decay

    no_decay = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=no_decay)
    groups = precision.optimizer_params(groups)
    kwargs = {"fused": True} if cfg.fused_optimizer else {}
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.999), eps=1e-8, **kwargs)


def build_ema(model: torch.nn.Module, cfg: RunConfig, optimizer: torch.optim.Optimizer):
    """The EMA of ``model`` that ``cfg.ema`` asks for (``None`` when off), with diffusers' default decay ramp."""
    if cfg.ema == "off":
        return None
    from gallery_lib.accel.ema import ModelEma

    ema = ModelEma(model, decay=cfg.ema_decay, ratio_warmup=True, mode=cfg.ema)
    if ema.effective_mode == "stream":
        ema.attach_optimizer(optimizer)  # the next optimizer step waits for the side-stream update
    return ema


def lr_lambda(cfg: RunConfig):
    """Linear warm-up then cosine decay over the run, as a multiplier of the peak learning rate."""
    def factor(step: int) -> float:
        if step < cfg.lr_warmup_steps:
            return (step + 1) / (cfg.lr_warmup_steps + 1)
        progress = (step - cfg.lr_warmup_steps) / max(1, cfg.steps - cfg.lr_warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def nonfinite_guard(cfg: RunConfig, precision: Precision) -> str:
    """How non-finite losses are caught: ``off``; ``device`` (fused AdamW without a GradScaler skips its own update
    on a device flag, no host sync); ``host`` (one host sync per step decides, before the optimizer step)."""
    if cfg.max_nonfinite_steps == 0:
        return "off"
    return "device" if cfg.fused_optimizer and precision.scaler is None else "host"


def nonfinite_flag(loss: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """A 0-d float tensor on the loss's device, > 0 when the loss is not finite on some rank (no sync)."""
    flag = (~torch.isfinite(loss.detach())).float().reshape(())
    if dist.world_size > 1:
        # MAX, not SUM: fused AdamW skips only when found_inf == 1.0 exactly; a 2.0 (two bad ranks) would step.
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag


def all_ranks_finite(loss: torch.Tensor, dist: DistInfo) -> bool:
    """Whether the loss is finite on every rank (one host sync; one all-reduce when distributed)."""
    bad = 0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0
    return all_reduce_sum(bad, dist) == 0


def precompile(accelerated, task, batch, precision: Precision, workers, overlap: bool, log, meanwhile):
    """Compiles the model's distinct block graphs in the ``workers`` (``CompileWorkers``) from one recorded forward
    on ``batch`` (``gallery_lib.accel.precompile``) and returns its ``PrecompileReport``. With ``overlap`` this process
    loads each graph as it lands; otherwise the warm-up steps load them. ``meanwhile()`` runs while they compile."""
    from gallery_lib.accel.precompile import precompile_blocks

    # The plain model, not a DDP wrapper: a forward without its backward would leave DDP's reducer waiting.
    return precompile_blocks(accelerated.module, lambda: task.loss(accelerated.module, batch, precision),
                             accelerated.compiled_blocks, workers=workers,
                             compile_kwargs=accelerated.compile_kwargs, log=log, load=overlap, meanwhile=meanwhile)


def attention_choices(accelerated, task, batch, precision: Precision) -> dict[str, str]:
    """For a model without the attention registry's hook: what PyTorch's own SDPA dispatch runs per attention call
    (one eager forward without gradients; nothing in the run changes). With the hook: empty here, its selector says
    at the end what ``auto`` ran."""
    if accelerated.attention is not None:
        return {}
    from gallery_lib.accel.attention import record_sdpa_choices

    try:
        return record_sdpa_choices(accelerated.module, lambda: task.loss(accelerated.module, batch, precision))
    except Exception as exc:  # noqa: BLE001 - a report: a real problem (out of memory, say) shows in the first step
        return {"not recorded": f"the probe's forward failed: {type(exc).__name__}: {str(exc).strip()[:200]}"}


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 outside torchrun or on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def resumes_after_restart(cfg: RunConfig) -> bool:
    """A torchrun restart of a run that has a checkpoint continues from it, as ``resume=True`` would."""
    return restart_count() > 0 and (checkpoint_dir(cfg) / LATEST).is_file()


def run(cfg: RunConfig, dist: DistInfo | None = None) -> dict:
    """Trains ``cfg`` and returns the summary record (also the last line of ``metrics.jsonl``).

    With ``cfg.find_batch_size`` the batch size is searched first; the run's ``config.json`` is then (re)written with
    the chosen size and the summary gets ``batch_size_search: {"tried": [...], "chosen": N}``.
    """
    if dist is None:  # called in-process; under torchrun main() has validated and started the group
        dist = init_distributed(validate_for_machine(cfg))
    if not cfg.find_batch_size:
        return _train(cfg, dist)
    check_fresh_start(cfg)  # now, rather than after the search
    log = print if dist.is_main else (lambda *a, **k: None)
    search = search_run_batch_size(cfg, lambda trial: _train(trial, dist), log=log)
    cfg = cfg.replace(batch_size=search["chosen"], find_batch_size=False,
                      extra={**cfg.extra, "batch_size_search": search})
    if dist.is_main:
        cfg.save(cfg.run_dir / "config.json")  # says what trained; a torchrun restart reloads it without searching
    log(f"[gallery] batch-size search: training at {search['chosen']} (tried {search['tried']}), from step 0")
    return _train(cfg, dist, extra_summary={"batch_size_search": search})


def _train(cfg: RunConfig, dist: DistInfo, extra_summary: dict | None = None) -> dict:
    """One training run of ``cfg`` at its batch size; ``extra_summary`` is merged into the summary record."""
    setup_start = time.perf_counter()
    with _compile_workers(cfg, dist) as workers:  # they warm up while the model and the data are set up
        return _train_from(setup_start, cfg, dist, workers, extra_summary)


def _compile_workers(cfg: RunConfig, dist: DistInfo):
    """``precompile_workers`` processes for this rank (the machine's share), or nothing to precompile with."""
    if not cfg.precompile_workers:  # RunConfig allows it only with compile=True and compile_scope='blocks'
        return contextlib.nullcontext(None)
    from gallery_lib.accel.precompile import CompileWorkers

    # Every rank compiles the same graphs for its own device: the machine's workers are shared out.
    return CompileWorkers(max(1, cfg.precompile_workers // dist.world_size), dist.device,
                          imports=cfg.model_family.block_modules)


def _train_from(setup_start: float, cfg: RunConfig, dist: DistInfo, workers, extra_summary: dict | None) -> dict:
    """``_train`` after the compile workers (``None``: none) were started."""
    reset_peak_memory(dist.device)
    configure_backends(cfg)
    seed_everything(cfg.seed)  # identical init on every rank; the loader derives per-rank streams

    precision = Precision.from_config(cfg, dist.device.type)
    task = build_task(cfg, dist, precision)
    model, loader, dataset = task.model, task.loader, task.dataset
    flops_per_sample = task.train_flops_per_sample()
    accelerated = apply_accelerations(model, cfg, precision, dist)
    optimizer = build_optimizer(model, cfg, precision)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    ema = build_ema(model, cfg, optimizer)
    if ema is not None:
        accelerated.notes.append(f"EMA of the weights: {ema.effective_mode} update, decay {cfg.ema_decay} "
                                 "after diffusers' (1 + step) / (10 + step) warm-up")
    train_module = accelerated.train_module
    train_module.train()

    log = print if dist.is_main else (lambda *a, **k: None)
    log(f"[gallery] {cfg.model} | recipe {cfg.recipe} | {dist.world_size} x {dist.device.type} | "
        f"batch {cfg.batch_size}/process ({cfg.global_batch_size} global) | {cfg.steps} steps "
        f"({cfg.warmup_steps} warm-up) | {task.describe()}")
    for note in accelerated.notes:
        log(f"[gallery]   {note}")
    setup_time = time.perf_counter() - setup_start

    ckpt = Checkpointer(cfg, dist, model=accelerated.module, optimizer=optimizer, scheduler=scheduler,
                        precision=precision, loader=loader, ema=ema)
    resume = cfg.resume or resumes_after_restart(cfg)
    if resume:
        start, counters = ckpt.restore()  # before iter(loader): the loader starts at the saved position
        how = f" after torchrun restart {restart_count()}" if not cfg.resume else ""
        log(f"[gallery] resumed from step {start}{how} ({ckpt.directory})")
        if dist.is_main:  # steps >= start are trained again: their old records must not appear twice
            moved = supersede_steps(cfg.run_dir / "metrics.jsonl", start)
            if moved:
                log(f"[gallery] {moved} metrics line(s) of the stopped run from step {start} on are superseded: "
                    f"moved to {superseded_path(cfg.run_dir / 'metrics.jsonl')}")
    else:
        ckpt.check_fresh_start()
        start, counters = 0, {"nonfinite_in_a_row": 0, "nonfinite_steps": 0}
    # A restarted process compiles and warms up again: its first steps are its warm-up.
    warmup_steps = min(cfg.warmup_steps, cfg.steps - start - 1)
    writer = MetricsWriter(cfg.run_dir / "metrics.jsonl", mode="a" if resume else "w") if dist.is_main else None
    timer = StepTimer(dist.device)
    pending_losses: list[torch.Tensor] = []
    pending_lrs: list[float] = []
    pending_skips: list[bool] = []
    step_times: list[float] = []
    losses: list[float] = []
    # reuse_batch isolates the model step from the loader (benchmarks); normal runs stream the loader.
    batches = itertools.repeat(next(iter(loader))) if cfg.reuse_batch else iter(loader)
    first_batch = next(batches)
    batches = itertools.chain([first_batch], batches)
    attention, probe_time = {}, 0.0

    def probe_attention() -> None:
        nonlocal probe_time
        start = time.perf_counter()
        attention.update(attention_choices(accelerated, task, first_batch, precision))
        probe_time = time.perf_counter() - start

    precompile_time, precompile_record = 0.0, {}
    if workers is not None and accelerated.compiled_blocks:
        # The probe's forward waits for nothing there: the workers compile meanwhile (before, it delayed their queue).
        report = precompile(accelerated, task, first_batch, precision, workers, cfg.precompile_overlap, log,
                            meanwhile=probe_attention)
        precompile_time, precompile_record = report.seconds, {"precompile": dataclasses.asdict(report)}
    else:
        probe_attention()
    cuda_graphs = cfg.compile and cfg.compile_mode in CUDA_GRAPH_COMPILE_MODES
    timer.mark()
    guard = nonfinite_guard(cfg, precision)
    for step in range(start, cfg.steps):
        if cuda_graphs:  # CUDA-graph trees: outputs of the previous step's graphs may now be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        loss = task.loss(train_module, next(batches), precision)
        precision.backward(loss)
        pending_lrs.append(optimizer.param_groups[0]["lr"])
        if guard == "device":
            # No host sync: fused AdamW skips its own update when found_inf > 0 (the mechanism GradScaler uses);
            # the step is counted, and a run of them stops the run, when the flags are read at the next log.
            optimizer.found_inf = nonfinite_flag(loss, dist)
            pending_skips.append(optimizer.found_inf)
            precision.step(model, optimizer, cfg.clip_grad)
            del optimizer.found_inf
            scheduler.step()
            if ema is not None:
                ema.update(model)
        elif guard == "host" and not all_ranks_finite(loss, dist):
            counters["nonfinite_in_a_row"] += 1
            counters["nonfinite_steps"] += 1
            pending_skips.append(True)
        else:
            counters["nonfinite_in_a_row"] = 0
            pending_skips.append(False)
            scale_before = precision.scaler.get_scale() if ema is not None and precision.scaler else None
            precision.step(model, optimizer, cfg.clip_grad)
            scheduler.step()
            if ema is not None:
                if scale_before is None:
                    ema.update(model)
                else:  # a GradScaler that found inf/NaN skipped the optimizer step: the EMA must not move either
                    ema.update_from_scaler(model, precision.scaler, scale_before)
        optimizer.zero_grad(set_to_none=True)
        pending_losses.append(loss.detach())
        timer.mark()
        abort = guard == "host" and counters["nonfinite_in_a_row"] >= cfg.max_nonfinite_steps
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps or ckpt.due(step + 1) or abort
        if log_now:
            times = timer.collect()  # the host sync of this logging interval
            values = torch.stack(pending_losses).float().cpu().tolist()
            skips = [bool(flag) if isinstance(flag, bool) else bool(flag.item()) for flag in pending_skips]
            if guard == "device":
                for skipped in skips:
                    counters["nonfinite_in_a_row"] = counters["nonfinite_in_a_row"] + 1 if skipped else 0
                    counters["nonfinite_steps"] += int(skipped)
                abort = counters["nonfinite_in_a_row"] >= cfg.max_nonfinite_steps
        save_now = ckpt.due(step + 1) or abort
        if log_now:
            peak = peak_memory_mb(dist.device)
            first = step + 1 - len(values)
            for i, (loss_value, ms, lr, skipped) in enumerate(zip(values, times, pending_lrs, skips)):
                record = {"type": "step", "step": first + i, "loss": loss_value, "lr": lr, "step_time_ms": ms,
                          "samples_per_s": cfg.global_batch_size * 1e3 / ms, "peak_mem_mb": peak,
                          "warmup": first + i - start < warmup_steps, "skipped_samples": loader.skipped,
                          "skipped_step": skipped}
                if writer:
                    writer.write(record)
            step_times.extend(times)
            losses.extend(values)
            pending_losses.clear()
            pending_lrs.clear()
            pending_skips.clear()
            log(f"[gallery] step {step + 1}/{cfg.steps} | loss {values[-1]:.4f} | "
                f"{cfg.global_batch_size * 1e3 / times[-1]:.1f} img/s | {times[-1]:.1f} ms/step | "
                f"peak {peak / 1024:.2f} GiB")
            dataset.check_bad_fraction(cfg.max_bad_fraction)
        if save_now:
            path = ckpt.save(step + 1, counters)
            timer = StepTimer(dist.device)  # restart the clock: the save belongs to no step
            timer.mark()
        if abort:
            raise RuntimeError(
                f"the loss was not finite for {cfg.max_nonfinite_steps} steps in a row (steps "
                f"{step + 1 - counters['nonfinite_in_a_row']}-{step}); those optimizer steps were skipped and the state "
                f"was saved to {path or ckpt.directory}. Lower the learning rate (lr) or check the data and "
                "amp_level, then continue with resume=True.")

    steady = step_times[warmup_steps:]
    timing = summarize_times(steady)
    skipped = int(all_reduce_sum(float(loader.skipped), dist))
    summary = {
        "type": "summary", "model": cfg.model, "recipe": cfg.recipe, "profile": cfg.profile,
        "device_name": torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "CPU",
        "world_size": dist.world_size, "global_batch_size": cfg.global_batch_size, "image_size": cfg.image_size,
        "steps": cfg.steps, "warmup_steps": warmup_steps, "resumed_from_step": start, "setup_time_s": setup_time,
        "precompile_time_s": precompile_time, "warmup_time_s": sum(step_times[:warmup_steps]) / 1e3, **timing,
        "warmup_step_times_ms": step_times[:warmup_steps], **precompile_record,
        "attention_probe_time_s": probe_time,  # the side forward that reads PyTorch's SDPA choices
        "samples_per_s": cfg.global_batch_size * 1e3 / timing["median_step_time_ms"],
        "peak_mem_mb": peak_memory_mb(dist.device),
        "peak_mem_kind": "cuda_max_allocated" if dist.device.type == "cuda" else "cpu_max_rss",
        "final_loss": losses[-1], "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]),
        "skipped_samples": skipped, "nonfinite_steps": counters["nonfinite_steps"], "reuse_batch": cfg.reuse_batch,
        "notes": accelerated.notes, "ema": cfg.ema, "train_flops_per_sample": flops_per_sample,
        "matmul_tflops": measured_matmul_tflops(dist.device),
        "torch_version": torch.__version__, "output_dir": str(cfg.run_dir), **task.summary(),
        **(extra_summary or {}),
    }
    if cfg.compile:  # did the run load its graphs (precompiled, or from an earlier run) or compile them itself?
        from gallery_lib.accel.compile import compile_cache_stats, describe_compile_cache

        summary["compile_cache"] = compile_cache_stats()
        log(f"[gallery] compilation in this process: {describe_compile_cache(summary['compile_cache'])}")
    if accelerated.attention is not None:  # what the registry's auto ran, known once the steps have run
        attention = dict(accelerated.attention.selector.chosen)
    if attention:
        summary["attention"] = attention
        for key, choice in attention.items():
            log(f"[gallery] attention {key}: {choice}")
    else:  # timm's Swin by default, and ResNet-50: there is no attention kernel to choose
        log("[gallery] attention: no scaled_dot_product_attention call (the model has no attention, or computes it "
            "with its own matmul and softmax)")
    if cfg.export_model and dist.is_main:
        summary["exported_to"] = task.export(cfg.run_dir, ema)
        if summary["exported_to"]:  # classifiers export nothing: their checkpoints are the model
            log(f"[gallery] saved the trained model to {summary['exported_to']}")
    if writer:
        writer.write(summary)
        writer.close()
    after = f" after {precompile_time:.1f} s of precompilation" if precompile_time else ""
    log(f"[gallery] done: {summary['samples_per_s']:.1f} img/s (median of {len(steady)} steps after warm-up), "
        f"warm-up {summary['warmup_time_s']:.1f} s{after}, peak {summary['peak_mem_mb'] / 1024:.2f} GiB, "
        f"final loss {summary['final_loss']:.4f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one training job from a saved config (used by torchrun).")
    parser.add_argument("--config", required=True, help="path to a config.json written by the launcher")
    args = parser.parse_args(argv)
    cfg = RunConfig.load(args.config)
    device_type = validate_for_machine(cfg)
    dist = init_distributed(device_type)
    try:
        with rank_logging(Path(cfg.run_dir) / "logs", dist.rank):
            run(cfg, dist)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    exit_code = 1
    try:
        exit_code = main()
    except SystemExit as stop:  # argparse's usage errors (it printed the message)
        exit_code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        exit_process(exit_code)
