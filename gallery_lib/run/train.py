"""The one training loop every model and recipe uses.

Started by ``launch.py`` under torchrun (``python -m gallery_lib.run.train --config run_dir/config.json``),
or called in-process with ``run(cfg)`` for single-process runs and tests. It writes the run's
``metrics.jsonl`` (one record per step, a summary at the end) and ``logs/rank<N>.log``.

The loop is ``_train_from``; each of its parts is a unit of its own:

- speed hygiene (``step_log.py``): losses and timings stay on the device and are read back every ``log_every``
  steps, step boundaries are CUDA events, and warm-up steps (compilation, autotuning) are reported apart from the
  steady-state figures (``summary.py``);
- compilation (``accel/compile/plan.py``): precompile workers start before the model is built, the blocks are
  precompiled before the first step, the summary says what the compile caches did;
- a non-finite loss skips the optimizer step on every rank, and ``max_nonfinite_steps`` in a row stop the run with a
  checkpoint (``nonfinite.py``);
- ``checkpoint.py`` saves every ``checkpoint_every`` steps (on a logging boundary, and the clock restarts after it,
  so no step time includes a save) and ``resume`` continues a run exactly. After a resume, the metrics lines logged
  after the checkpoint by the stopped run move to ``metrics.superseded.jsonl``. When torchrun restarts the workers
  (``max_restarts``) and the run has a checkpoint, the new workers resume from it on their own.

Out of memory: with ``find_batch_size`` the run first searches for the largest batch that fits, each trial a
short real run (``batch_size.search_run_batch_size``), then trains from scratch at the chosen size.
Bad data: unreadable images are skipped by the dataset; every ``log_every`` steps the run stops with an error if more
than ``max_bad_fraction`` of the loads failed (a shared counter read, no device sync).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import os
import random
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gallery_lib.accel.accelerate import apply_accelerations
from gallery_lib.accel.adamw_ema import AdamWWithEma, ema_in_pass
from gallery_lib.accel.compile.plan import CompilePlan
from gallery_lib.accel.distributed import (DistInfo, exit_process, gather_full_module, gradient_sync,
                                           init_distributed, reshard, see_only_own_gpu, shutdown)
from gallery_lib.accel.precision import Precision
from gallery_lib.accel.torch_switches import (WORKER_CAP_ENV, cap_gpu_memory, set_deterministic_algorithms,
                                              set_float32_matmul_precision)
from gallery_lib.config import RunConfig, validate_for_machine
from gallery_lib.run.attention_probe import AttentionProbe
from gallery_lib.run.batch_size import is_out_of_memory, search_run_batch_size, train_first_that_fits
from gallery_lib.run.learned_footprints import ran_out_in_training, remember, setting_key
from gallery_lib.run.memory_plan import (ALLOCATOR_ENV, NAMED, PLAN, Candidate, MemoryPlan, OutOfMemory,
                                         memory_in_use_gib, out_of_memory, worker_share_gib)
from gallery_lib.run.checkpoint import Checkpointer, check_fresh_start, is_own_checkpoint, resume_source
from gallery_lib.run.collector import TimedStepsCollector
from gallery_lib.run.failure import RESTARTED_PREFIX, STOPPED_PREFIX, clear_failure, failure_from_exception
from gallery_lib.run.folder_lock import hold_while_training
from gallery_lib.run.interrupt import AgreedStop, Interrupted, StopRequest
from gallery_lib.run.logs import rank_logging
from gallery_lib.run.metrics import MetricsWriter, superseded_path, supersede_steps
from gallery_lib.run.nonfinite import NonfiniteGuard
from gallery_lib.run.profiling import StepProfiler
from gallery_lib.config.family import WorkerMemory
from gallery_lib.config.quiet import quiet_known_noise
from gallery_lib.config.sections.job import Checkpoint as CheckpointSettings
from gallery_lib.config.sections.training import EMA as EMASettings
from gallery_lib.config.sections.training import Optimizer as OptimizerSettings
from gallery_lib.config.sections.training import Training as TrainingSettings
from gallery_lib.run.step_log import StepLog
from gallery_lib.run.summary import build_summary, describe_summary
from gallery_lib.run.timing import reset_peak_memory
from gallery_lib.tasks import build_task


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def configure_backends(deterministic: bool, sdpa_math: bool) -> None:
    # Each switch is set both ways: an in-process run (the tests) must not inherit the last run's choice.
    set_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = not deterministic  # off: same step and start (RESULTS.md#sd15-start-2)
    # high: TF32 for fp32 matmuls, as every GPU trainer enables
    set_float32_matmul_precision("highest" if deterministic else "high")
    fused_sdpa = not sdpa_math  # set both ways: in-process runs (tests) must not inherit the last run's choice
    torch.backends.cuda.enable_flash_sdp(fused_sdpa)
    torch.backends.cuda.enable_mem_efficient_sdp(fused_sdpa)
    torch.backends.cuda.enable_cudnn_sdp(fused_sdpa)


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings, precision: Precision, *, lr: float,
                    averages_ema: bool = False) -> torch.optim.Optimizer:
    """AdamW or Nesterov SGD (``settings.optimizer``) at peak learning rate ``lr``, without weight decay on norms,
    biases and position tables (the Swin reference; diffusers decays every UNet parameter, but its 1-D tensors are a
    rounding error of its 860M). ``averages_ema``: an ``AdamWWithEma``, which takes the EMA's update into its pass
    (``ema_in_pass``)."""
    from timm.optim import param_groups_weight_decay

    no_decay = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_weight_decay(model, settings.weight_decay, no_weight_decay_list=no_decay)
    groups = precision.optimizer_params(groups)
    kwargs = {"fused": True} if settings.fused_optimizer else {} if settings.foreach_optimizer else {"foreach": False}
    if settings.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True, **kwargs)
    adamw = AdamWWithEma if averages_ema else torch.optim.AdamW
    return adamw(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, **kwargs)


def build_ema(model: torch.nn.Module, settings: EMASettings, optimizer: torch.optim.Optimizer,
              template: torch.nn.Module | None = None):
    """The EMA of ``model`` that the run's EMA ``settings`` ask for, with diffusers' default decay ramp, and the log
    line saying how it updates (and why, when it cannot run in the mode asked); ``(None, None)`` when off.
    ``template``: a sharded model's plain template (``AcceleratedModel.template``)."""
    if settings.ema == "off":
        return None, None
    from gallery_lib.accel.on_any_model import add_ema

    ema = add_ema(model, optimizer, decay=settings.ema_decay, mode=settings.ema, template=template,
                  stream_programs=settings.ema_stream_programs or None, offload=settings.ema_offload, echo=None)
    return ema, ema.change.note


def lr_lambda(warmup_steps: int, steps: int):
    """Linear warm-up then cosine decay over ``steps``, as a multiplier of the peak learning rate."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def run(cfg: RunConfig, dist: DistInfo | None = None) -> dict:
    """Trains ``cfg`` and returns the summary record (also the last line of ``metrics.jsonl``).

    With ``cfg.find_batch_size`` the batch size is searched first; the run's ``config.json`` is then (re)written with
    the chosen size and the summary gets ``batch_size_search: {"tried": [...], "chosen": N}``.
    """
    if dist is None:  # called in-process; under torchrun main() has validated and started the group
        owns_group = not torch.distributed.is_initialized()
        dist = init_distributed(validate_for_machine(cfg), zero2=cfg.data_parallel == "zero2")
        try:
            return run(cfg, dist)
        finally:
            if owns_group:
                shutdown()
    _cap_memory(cfg.gpu_memory_gib, cfg.precompile_workers, cfg.model_family.worker_memory, dist.device)
    log = print if dist.is_main else (lambda *a, **k: None)
    if (cfg.extra.get(PLAN) or {}).get("probe_fields"):  # no footprint measured: the first setting that runs
        return train_first_that_fits(cfg, lambda attempt: _train(attempt, dist), log=log)
    if not cfg.find_batch_size:
        return _train(cfg, dist)
    check_fresh_start(cfg.run_dir, cfg.sections.checkpoint)  # now, rather than after the search
    search = search_run_batch_size(cfg, lambda trial: _train(trial, dist), log=log)
    cfg = cfg.replace(batch_size=search["chosen"], find_batch_size=False,
                      extra={**cfg.extra, "batch_size_search": search})
    if dist.is_main:
        cfg.save(cfg.run_dir / "config.json")  # says what trained; a torchrun restart reloads it without searching
    log(f"[gallery] batch-size search: training at {search['chosen']} (tried {search['tried']}), from step 0")
    return _train(cfg, dist, extra_summary={"batch_size_search": search})


def _cap_memory(gpu_memory_gib: float | None, precompile_workers: int, measured: WorkerMemory | None,
                device: torch.device) -> None:
    """``gpu_memory_gib``: this process capped to it, and its ``precompile_workers`` to what it leaves them (from the
    family's ``measured`` worker memory)."""
    cap_gpu_memory(gpu_memory_gib, device)
    if gpu_memory_gib is not None and device.type == "cuda" and precompile_workers:
        share = worker_share_gib(gpu_memory_gib, precompile_workers, measured and measured.trainer_gib)
        os.environ[WORKER_CAP_ENV] = f"{share:.3f}"


def _out_of_memory(training: TrainingSettings, extra: dict, step: int | None) -> OutOfMemory:
    """The one-line out-of-memory error of a run with these ``training`` settings (and the memory plan and the
    names the user set, in its ``extra``) at ``step`` (``None``: before its first)."""
    plan = extra.get(PLAN)
    current = Candidate(training.batch_size, training.gradient_accumulation_steps, training.gradient_checkpointing)
    if plan and plan.get("chosen") and Candidate(**plan["chosen"]).fields() == current.fields():
        current = Candidate(**plan["chosen"])  # which also says whether the plan turned compilation off
    return out_of_memory(step, training.steps, memory_in_use_gib(),
                         plan["budget_gib"] if plan else training.gpu_memory_gib, current,
                         MemoryPlan.from_dict(plan) if plan else None, extra.get(NAMED, ()))


def explain_out_of_memory(exc: BaseException, training: TrainingSettings, extra: dict) -> BaseException:
    """``exc`` as ``OutOfMemory`` when the GPU ran out before the first step (one from a step is one already)."""
    if isinstance(exc, OutOfMemory) or not is_out_of_memory(exc):
        return exc
    return _out_of_memory(training, extra, None)


def _train(cfg: RunConfig, dist: DistInfo, extra_summary: dict | None = None) -> dict:
    """One training run of ``cfg`` at its batch size; ``extra_summary`` is merged into the summary record."""
    setup_start = time.perf_counter()
    memory_plan = cfg.extra.get(PLAN) or {}
    # what this step measures on this GPU, for the next plan on it (``learned_footprints``)
    step_key = setting_key(cfg.to_dict(), memory_plan["gpu"], memory_plan.get("allocator")) if memory_plan.get(
        "gpu") else None
    try:
        # its precompile workers warm up while the model and the data are set up
        with CompilePlan(dist, compile=cfg.sections.compile, family=cfg.model_family, job=cfg.sections.job,
                         batch_size=cfg.batch_size, image_size=cfg.image_size) as plan, \
                contextlib.ExitStack() as on_exit:
            summary = _train_from(setup_start, cfg, dist, plan, on_exit, extra_summary or {})
    except Exception as exc:
        if step_key and is_out_of_memory(exc) and ran_out_in_training(getattr(exc, "step", None), cfg.steps):
            remember(step_key, out_of_memory_under=memory_plan["budget_gib"])
        raise
    if step_key and summary.get("peak_reserved_mb"):
        remember(step_key, peak_gib=summary["peak_reserved_mb"] / 1024, ran_under=memory_plan["budget_gib"])
    return summary


def _train_from(setup_start: float, cfg: RunConfig, dist: DistInfo, plan: CompilePlan,
                on_exit: contextlib.ExitStack, extra_summary: dict) -> dict:
    """``_train`` once the compile plan is open: set up, resume or start, precompile, train, summarize. ``on_exit``
    closes what it opens, when it returns or fails."""
    reset_peak_memory(dist.device)
    quiet_known_noise(cfg.verbose)
    configure_backends(cfg.deterministic, cfg.sdpa_math)
    seed_everything(cfg.seed)  # identical init on every rank; the loader derives per-rank streams
    precision = Precision.from_settings(cfg.sections.precision, dist.device.type)
    task = build_task(cfg, dist, precision)
    model, loader = task.model, task.loader
    on_exit.callback(loader.close)  # its workers stop as the run ends, not at interpreter exit
    flops_per_sample = task.train_flops_per_sample()
    accelerated = apply_accelerations(model, cfg, precision, dist, plan)
    optimizer = build_optimizer(model, cfg.sections.optimizer, precision, lr=cfg.peak_lr,
                                averages_ema=ema_in_pass(cfg.sections.ema, cfg.sections.optimizer,
                                                         cfg.sections.precision, data_parallel=cfg.data_parallel,
                                                         amp_dtype=precision.dtype))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_warmup_steps, cfg.steps))
    ema, ema_note = build_ema(model, cfg.sections.ema, optimizer, accelerated.template)
    if ema_note:
        accelerated.notes.append(ema_note)
    train_module = accelerated.train_module
    train_module.train()
    log = print if dist.is_main else (lambda *a, **k: None)
    log(f"[gallery] {cfg.model} | recipe {cfg.recipe} | {dist.world_size} x {dist.device.type} | "
        f"batch {cfg.batch_size}/process{_accumulated(cfg.gradient_accumulation_steps)} ({cfg.global_batch_size} "
        f"global) | {cfg.steps} steps "
        f"({cfg.warmup_steps} warm-up) | {task.describe()}")
    if PLAN in cfg.extra:
        log(f"[gallery]   {MemoryPlan.from_dict(cfg.extra[PLAN]).note()}")
    if dist.device.type == "cuda":
        log(f"[gallery]   CUDA allocator: {os.environ.get(ALLOCATOR_ENV) or 'PyTorch defaults'}")
    for note in accelerated.notes:
        log(f"[gallery]   {note}")
    setup_time = time.perf_counter() - setup_start

    ckpt = Checkpointer(cfg, dist, model=accelerated.module, optimizer=optimizer, scheduler=scheduler,
                        precision=precision, loader=loader, ema=ema)
    start, counters, resumed = _resume_or_start(cfg.run_dir, cfg.sections.checkpoint, dist, ckpt, log)
    warmup_steps = min(cfg.warmup_steps, cfg.steps - start - 1)  # a restarted process compiles and warms up again
    guard = NonfiniteGuard(cfg.max_nonfinite_steps, cfg.fused_optimizer, precision, dist, counters)
    writer = _metrics_writer(cfg.run_dir, cfg.report_to, start, resumed) if dist.is_main else None
    batches = _batches(loader, cfg.reuse_batch)
    first_batch = next(batches)
    batches = itertools.chain([first_batch], batches)
    probe = AttentionProbe(accelerated, task, first_batch, precision)
    precompile_forward = functools.partial(task.loss, accelerated.module, first_batch, precision)
    if not plan.precompile(accelerated.module, precompile_forward, log, meanwhile=probe):
        probe()  # with precompile workers it runs while they compile
    if accelerated.template is not None:
        reshard(model)  # the probe's forward left the whole weights registered
    update = functools.partial(_update, model, optimizer, scheduler, ema, precision, cfg.clip_grad,
                               cfg.clip_in_optimizer)
    cuda_graphs = cfg.cuda_graphs
    step_log = StepLog(dist, writer, loader, steps=cfg.steps, log_every=cfg.log_every,
                       global_batch_size=cfg.global_batch_size, start=start, warmup_steps=warmup_steps, log=log)
    # the last steps, left out of the speed figures: the profiler can slow the steps after it too
    profiled = max(0, min(cfg.profile_steps, cfg.steps - start - warmup_steps - 1))
    profiler = StepProfiler(profiled if dist.is_main else 0, cfg.steps - profiled, dist.device, cfg.run_dir, log)
    step = None
    agreed_stop = AgreedStop(STOP, dist.world_size)
    collector = TimedStepsCollector()
    frozen_after = start + max(warmup_steps, 1)  # the graphs are compiled by then
    try:
        for step in range(start, cfg.steps):
            profiler.before_step(step)
            loss = _forward_backward(task, train_module, batches, precision, cfg.gradient_accumulation_steps,
                                     cuda_graphs)
            lr = optimizer.param_groups[0]["lr"]
            skipped = guard.update(loss, optimizer, update)
            if step == start:
                plan.first_step_done()  # its graphs are compiled: another run of them here may load them now
            optimizer.zero_grad(set_to_none=True)
            step_log.record(loss, lr, skipped)
            profiler.after_step(step)
            if step + 1 == frozen_after < cfg.steps:  # what compiling left, out of the collector's walks
                step_log.between_steps(collector.freeze)
            stop = guard.should_stop()  # known now for host checks; device flags are read at the next flush
            interrupted = agreed_stop.after_step() and step + 1 < cfg.steps
            if step_log.due(step + 1) or ckpt.due(step + 1) or stop or interrupted:
                guard.count(step_log.flush(step + 1))
                task.dataset.check_bad_fraction(cfg.max_bad_fraction)
                stop = guard.should_stop()
            if ckpt.due(step + 1) or stop or interrupted:
                saved_to = ckpt.save(step + 1, guard.counters())
                step_log.restart_clock()  # the save belongs to no step
                if stop:
                    raise guard.error(step, saved_to or ckpt.directory, start)
                if interrupted:
                    raise Interrupted(STOP.signal or "a signal to another process", step + 1, cfg.steps, saved_to)
        agreed_stop.close()
    except Exception as exc:
        if is_out_of_memory(exc):
            # one line: where, how much, what to try
            raise _out_of_memory(cfg.sections.training, cfg.extra, step) from exc
        raise
    finally:
        collector.close()

    summary = build_summary(dist, step_log, job=cfg.sections.job, data=cfg.sections.data, ema=cfg.sections.ema,
                            steps=cfg.steps, global_batch_size=cfg.global_batch_size, run_dir=cfg.run_dir,
                            warmup_steps=warmup_steps, profiled_steps=profiled, setup_time=setup_time,
                            precompile_seconds=plan.precompile_seconds, probe_seconds=probe.seconds,
                            skipped_samples=loader.skipped, nonfinite_steps=guard.total, notes=accelerated.notes,
                            flops_per_sample=flops_per_sample, **task.summary(), **extra_summary,
                            **({"memory_plan": cfg.extra[PLAN]} if PLAN in cfg.extra else {}),
                            **plan.summary(log), **probe.report(log), **collector.summary())
    if cfg.export_model:
        trained = _exported_module(model, ema, accelerated.template, dist)
        if dist.is_main:
            with _after_training(cfg.steps, "saving the trained model"):
                summary["exported_to"] = task.export(cfg.run_dir, trained)
            with _after_training(cfg.steps, "the validation pass", skip_with=log):
                summary.update(task.evaluate(trained))
        if summary.get("exported_to"):
            log(f"[gallery] saved the trained model to {summary['exported_to']}")
        if "val_top1" in summary:
            log(f"[gallery] validation: top-1 {summary['val_top1']:.1%} of {summary['val_images']} images, "
                f"loss {summary['val_loss']:.4f}")
    if writer:
        writer.write(summary)
        writer.close()
    log(describe_summary(summary))
    return summary


@contextlib.contextmanager
def _after_training(steps: int, what: str, skip_with: Callable[[str], None] | None = None):
    """Out of memory in ``what``, after the last step, said in one line: logged and skipped with ``skip_with``,
    raised otherwise with the last step as its ``step``, so the memory plan does not train again at a smaller
    setting (the training setting fitted)."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        in_use = memory_in_use_gib()
        message = f"all {steps} training steps ran, then {what} ran out of GPU memory" + (
            f" ({in_use:.1f} GiB in use)" if in_use is not None else "")
        if skip_with is None:
            raise OutOfMemory(f"{message}: free the GPU of other processes, or raise gpu_memory_gib if a cap set it "
                              "lower than the card", steps) from exc
        skip_with(f"[gallery] {message}; skipped it")


def _exported_module(model: torch.nn.Module, ema, template: torch.nn.Module | None,
                     dist: DistInfo) -> torch.nn.Module | None:
    """The weights a run exports: the EMA's when it keeps one. A sharded (ZeRO-2) one is gathered, on every rank, into
    a plain module on rank 0 (``None`` elsewhere)."""
    trained = ema.module if ema is not None else model
    return trained if template is None else gather_full_module(trained, template, dist)


def _resume_or_start(run_dir: Path, settings: CheckpointSettings, dist: DistInfo, ckpt: Checkpointer,
                     log) -> tuple[int, dict, bool]:
    """The first step, the non-finite counters and whether the run in ``run_dir`` continues itself (from its own
    checkpoint, after ``resume`` or a torchrun restart), so that it appends to its metrics."""
    source = resume_source(run_dir, settings, restarted=dist.restarts > 0)
    own = source is not None and is_own_checkpoint(run_dir, source)
    if not own:  # a fresh start, or one from another run's checkpoint: this run's folder must hold none of its own
        ckpt.check_fresh_start()
    if source is None:
        return 0, {}, False
    start, counters = ckpt.restore(source)  # before iter(loader): the loader starts at the saved position
    how = f" after torchrun restart {dist.restarts}" if dist.restarts and own else ""
    log(f"[gallery] resumed from step {start}{how} ({source})")
    if not own:
        return start, counters, False  # metrics.jsonl starts afresh
    if dist.is_main:  # steps >= start are trained again: their old records must not appear twice
        moved = supersede_steps(run_dir / "metrics.jsonl", start)
        if moved:
            log(f"[gallery] {moved} metrics line(s) of the stopped run from step {start} on are superseded: "
                f"moved to {superseded_path(run_dir / 'metrics.jsonl')}")
    return start, counters, True


def _metrics_writer(run_dir: Path, report_to: str, start: int, resumed: bool):
    """``metrics.jsonl`` (appended to by a resumed run), and TensorBoard beside it when ``report_to`` asks."""
    jsonl = MetricsWriter(run_dir / "metrics.jsonl", mode="a" if resumed else "w")
    if report_to != "tensorboard":
        return jsonl
    from gallery_lib.run.tensorboard import TeeWriter, TensorBoardWriter

    return TeeWriter(jsonl, TensorBoardWriter(run_dir / "tensorboard", start_step=start))


def _batches(loader, reuse_batch: bool):
    """The loader's batches; ``reuse_batch`` repeats its first (benchmarks of the model step alone)."""
    return itertools.repeat(next(iter(loader))) if reuse_batch else iter(loader)


def _accumulated(micro_batches: int) -> str:
    return f" x {micro_batches} accumulated" if micro_batches > 1 else ""


def _forward_backward(task, module, batches, precision: Precision, micro_batches: int,
                      cuda_graphs: bool) -> torch.Tensor:
    """The loss of the next batch and its backward; with ``micro_batches`` > 1, that many batches whose gradients
    add up to those of their mean loss, which it returns."""
    total = None
    for index in range(micro_batches):
        if cuda_graphs:  # CUDA-graph trees: outputs of the previous graphs' replay may now be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with gradient_sync(module, enabled=index == micro_batches - 1):  # reduce once, after the last batch
            loss = task.loss(module, next(batches), precision)
            if micro_batches == 1:
                precision.backward(loss)
                return loss
            precision.backward(loss / micro_batches)
        total = loss.detach() if total is None else total + loss.detach()
    return total / micro_batches


def _update(model, optimizer, scheduler, ema, precision: Precision, clip_grad: float | None,
            clip_in_optimizer: bool) -> None:
    """One step of the optimizer, the learning-rate schedule and the EMA."""
    scale_before = precision.scaler.get_scale() if ema is not None and precision.scaler else None
    precision.step(model, optimizer, clip_grad, fold_clipping=clip_in_optimizer)
    scheduler.step()
    if ema is None:
        return
    if ema.offloaded:  # its update needs room on the GPU (a whole copy, or two chunks streamed): the gradients give it
        optimizer.zero_grad(set_to_none=True)
    if scale_before is None:
        ema.update(model)
    else:  # a GradScaler that found inf/NaN skipped the optimizer step: the EMA must not move either
        ema.update_from_scaler(model, precision.scaler, scale_before)


def _every_node(nproc_per_node: int, world_size: int, extra: dict) -> dict:
    """With several nodes, the fields to replace so that ``nproc_per_node`` counts every node's processes inside the
    training processes: the global batch, the learning-rate rule, the summary and the checkpoints count the whole
    job. Nothing with one node."""
    if world_size <= nproc_per_node:
        return {}
    return dict(nproc_per_node=world_size, extra={**extra, "nnodes": world_size // nproc_per_node})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one training job from a saved config (used by torchrun).")
    parser.add_argument("--config", required=True, help="path to a config.json written by the launcher")
    args = parser.parse_args(argv)
    own_gpu = see_only_own_gpu()  # first: before anything asks CUDA for its devices
    cfg = RunConfig.load(args.config)
    hold_while_training(Path(cfg.run_dir))  # a launch into the folder stops while this process lives
    # The launcher checked this machine's GPUs; this process now sees its own alone.
    device_type = validate_for_machine(cfg, cuda_devices=cfg.nproc_per_node if own_gpu else None)
    dist = init_distributed(device_type, zero2=cfg.data_parallel == "zero2", own_gpu=own_gpu)
    cfg = cfg.replace(**_every_node(cfg.nproc_per_node, dist.world_size, cfg.extra))
    if dist.is_main:
        clear_failure(cfg.run_dir)  # a torchrun restart tries again
        if dist.restarts:
            print(f"{RESTARTED_PREFIX}{dist.restarts} of {cfg.max_restarts}: the workers start again", flush=True)
    STOP.install()
    try:
        with rank_logging(Path(cfg.run_dir) / "logs", dist.rank) as log_path:
            try:
                run(cfg, dist)
            except Exception as exc:  # the rank's log gets the traceback; the console one line
                failure = failure_from_exception(
                    explain_out_of_memory(exc, cfg.sections.training, cfg.extra), log_path)
                if dist.is_main:  # why the run stopped, for the launcher and the reports
                    failure.write(cfg.run_dir)
                raise StoppedRun(failure) from exc
    finally:
        shutdown()
    return 0


STOP = StopRequest()
"""Set by Ctrl-C or SIGTERM (``main`` installs it): the loop stops after the step under way (in a run of several
processes, the next: ``AgreedStop``), saving it."""


class StoppedRun(Exception):
    """The run stopped on an error that its log (traceback) and ``failure.json`` (one line) record."""

    def __init__(self, failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


if __name__ == "__main__":
    exit_code = 1
    try:
        exit_code = main()
    except SystemExit as stop:  # argparse's usage errors (it printed the message)
        exit_code = stop.code if isinstance(stop.code, int) else 1
    except StoppedRun as stop:
        where = f"; the traceback is in {stop.failure.log}" if stop.failure.log else ""  # none: a plan that ran out
        print(f"{STOPPED_PREFIX}{stop.failure.reason}{where}", flush=True)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_process(exit_code)
