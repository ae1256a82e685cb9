"""The memory plan: before a run on a GPU, the fastest setting of its step that fits the memory the run may use, at
the global batch it was given.

The memory a run may use (``Budget``) is the GPU's free memory as ``nvidia-smi`` reads it, less a CUDA context, at
most ``gpu_memory_gib`` when set (the run's processes are then capped to it). The settings tried (``candidates``),
fastest first: the batch per step halved with gradient accumulation making up the rest, each size without and then
with gradient checkpointing. A setting the user named (``RunConfig.extra[NAMED]``) is not changed. Each candidate's
peak is read from the family's measured footprints (``ModelFamily.memory_footprints``: measured batch sizes, linear
between them and past the two nearest; measured without accumulation, so only such candidates read them), and the
first measured to fit is taken. Where none is, the training process starts at the first unmeasured one, and gives way
to the next when one runs out of memory before its timed steps (``run/batch_size.py``: nothing is lost where the
first fits). Below every setting lies the training state (``TrainingState``: weights, gradients, optimizer state and
EMA of the trained parameters, and where a model compiled whole accumulates, a second copy of the gradients): a
setting whose state fills the budget is left out, and a budget every setting's fills is refused before any is tried.
The plan also sizes the precompile workers, which hold GPU memory beside the training process while they compile
(``ModelFamily.worker_memory``). A run on the CPU weighs only its training state, against the machine's available
memory (``read_host_budget``).

The functions here are pure but ``read_budget``: tests pass memory sizes of their own.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Iterable, Sequence

from gallery_lib.config.settings import ConfigError

NAMED = "named"
"""The note in ``RunConfig.extra`` listing the fields the user named (``base_config``'s and ``recipe_config``'s
overrides): the plan leaves those alone."""
PLAN = "memory_plan"
"""The note in ``RunConfig.extra`` holding the plan (``MemoryPlan.as_dict``)."""
CAP_ENV = "GALLERY_GPU_MEMORY_GIB"
"""Sets ``gpu_memory_gib`` for every run that does not name it."""

CONTEXT_GIB = 1.3
"""GPU memory a training process holds outside its allocator (CUDA context, kernels, cuBLAS handles): nvidia-smi's
figure for the process less its peak reserved was 0.77-1.27 GiB for SD-1.5 (benchmarks/RESULTS.md#memory-plan)."""
HOST_PROCESS_GIB = 1.5
"""What a training process on the CPU holds beside its training state: torch (0.5 GiB) and SD-1.5's frozen VAE and
text encoder (0.8 GiB); one that built sd15's parts held 4.7 GiB, its UNet 3.2 (benchmarks/RESULTS.md#memory-plan)."""
HEADROOM = 0.04
"""Kept free above a measured peak: repeated runs of one setting reserved up to 3.6% apart (SD-1.5 accelerated at
batch 32: 40.8-42.3 GiB)."""
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATOR_SETTINGS = "expandable_segments:True"
"""The CUDA allocator's settings the launcher gives a run that does not fit as configured (``MemoryPlan.tight``) where
the user set none: segments that grow in place, so that memory a step frees serves later requests of other sizes.
Under a 22 GiB cap SD-1.5's ladder ran out of memory with up to 3.2 GiB reserved but unallocated, and trained at twice
the batch per step with them (benchmarks/RESULTS.md#ladder-22-gib). Runs that fit keep PyTorch's defaults, as they
were measured."""
PLANNED_FIELDS = ("batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "compile")


@dataclass(frozen=True)
class Budget:
    """The GPU memory a run may use."""

    gib: float
    source: str
    """``gpu_memory_gib`` (a cap the run enforces), ``free`` (read from the GPU) or ``host`` (a run on the CPU: the
    machine's available memory, against which only the training state is weighed)."""
    gpu: str | None = None
    """The GPU's name, where it was read: what this GPU measured before counts for it (``learned_footprints``)."""

    def describe(self) -> str:
        return f"{self.gib:.1f} GiB ({_SOURCES.get(self.source, 'free on the GPU')})"


_SOURCES = {"gpu_memory_gib": "gpu_memory_gib", "host": "available in the machine's memory",
            "free_below_cap": "free on the GPU, less than gpu_memory_gib"}


@dataclass(frozen=True)
class Candidate:
    """One setting of the step: the batch per step, the batches accumulated per optimizer step, checkpointing."""

    batch_size: int
    accumulation: int
    checkpointing: bool
    uncompiled: bool = False
    """The recipe's ``torch.compile`` turned off (``uncompiled``), for a compiled step that does not fit."""

    def slowness(self) -> tuple[int, bool, bool]:
        """Its place in ``candidates``' list at its global batch, fastest first: a larger value comes later."""
        return -self.batch_size, self.uncompiled, self.checkpointing

    def describe(self) -> str:
        text = f"batch {self.batch_size}"
        if self.accumulation > 1:
            text += f" x {self.accumulation} accumulation steps"
        return text + (", gradient checkpointing" if self.checkpointing else "") + (
            ", uncompiled" if self.uncompiled else "")

    def short(self) -> str:
        """For a table cell: ``8``, ``4 x 2, checkpointing``, ``8, checkpointing, uncompiled``."""
        text = f"{self.batch_size}" + (f" x {self.accumulation}" if self.accumulation > 1 else "")
        return text + (", checkpointing" if self.checkpointing else "") + (", uncompiled" if self.uncompiled else "")

    def fields(self) -> dict[str, Any]:
        """As ``RunConfig`` fields, but for ``uncompiled``, which ``uncompiled()`` applies to a resolved recipe."""
        return {"batch_size": self.batch_size, "gradient_accumulation_steps": self.accumulation,
                "gradient_checkpointing": self.checkpointing}


@dataclass(frozen=True)
class MemoryPlan:
    """What the plan picked, and why, in the run's first line, its summary, the report and the notebook."""

    budget_gib: float
    source: str
    chosen: Candidate | None
    """``None``: nothing measured fits (``estimate_gib`` then holds the smallest need measured)."""
    estimate_gib: float | None = None
    """The chosen setting's measured peak; ``None`` where it was not measured."""
    state: str = ""
    """Where the training state alone fills the budget (``estimate_gib`` then holds it): what that state is."""
    state_fix: str = ""
    """What else shrinks that state, where the run offers it (``, or train LoRA adapters (--set lora_rank=4)``)."""
    probe: tuple[Candidate, ...] = ()
    """Settings the training process tries in order where none is measured: each gives way to the next when it runs
    out of memory before its timed steps."""
    ran_out_here: int = 0
    """Where it tries settings: how many faster ones ran out of memory on this GPU under this budget or a larger one,
    or reserved more than it where they ran (its learned footprints), and are not tried again."""
    precompile_workers: int | None = None
    """The workers that fit beside the training process, where the plan changed their number."""
    changed: bool = False
    """Whether the plan changed the configured setting."""
    after: tuple[Candidate, ...] = field(default=())
    """The slower settings after the chosen one: what to try if the run still runs out of memory."""
    ema_offloaded: bool = False
    """The EMA waits in the CPU's memory between its updates (``ema_offload``): the training state fits the budget
    only without it."""
    per_tensor_update: bool = False
    """The unfused optimizer updates one tensor at a time (``foreach_optimizer=False``): the training state fits the
    budget only without the multi-tensor update's copy."""
    skipped_faster: int = 0
    """Unmeasured settings faster than the one the run it builds on ran at, not tried: they did not fit that run, and
    this run's switch frees no memory (the ladder's rungs: ``recipes/ladder.py``)."""
    started_past: bool = False
    """With ``skipped_faster``: the setting the run it builds on ran at ran out of memory in this run before, or does
    not fit this run's larger training state (``start_needs_gib``), so the tries start at the next one not
    measured."""
    builds_on_ran: bool = True
    """With ``skipped_faster``: the run it builds on ran at the start. Otherwise the start is the first setting that
    run has not tried yet, every faster one having run out of memory there (a ladder rung that stopped mid-run)."""
    left_out: str = ""
    """Settings whose training state alone fills the budget, left out before any was weighed, and why (said where
    none measured fits): ``18 settings left out, in which the weights, ... alone take 16.0 GiB``."""
    start_needs_gib: float = 0.0
    """With ``started_past``: what this run would need at the setting the run it builds on ran at, where that exceeds
    the budget: that run's peak there with this run's larger training state in place of its own (0: the start ran
    out of memory here before)."""

    @property
    def fits(self) -> bool:
        return self.chosen is not None or bool(self.probe)

    @property
    def tight(self) -> bool:
        """The run as configured does not fit: the plan changed its step, or moved state out of the GPU's way."""
        return self.changed or self.ema_offloaded or self.per_tensor_update

    def note(self) -> str:
        """``memory plan, 22.0 GiB (gpu_memory_gib): batch 4 x 2 accumulation steps (measured 20.1 GiB)``."""
        head = f"memory plan, {Budget(self.budget_gib, self.source).describe()}: " + (
            "the EMA kept in the CPU's memory between updates; " if self.ema_offloaded else "") + (
            "the optimizer's update one tensor at a time; " if self.per_tensor_update else "")
        left_out = f"; {self.left_out}" if self.left_out else ""
        if self.chosen is None and self.probe:
            return head + (f"not measured for this recipe: {self.probe[0].describe()}{self._started()}, giving way to "
                           f"the next setting if it runs out of memory before its timed steps{left_out}")
        if self.chosen is None and self.state:
            return head + f"does not fit ({self.state} alone take {self.estimate_gib:.1f} GiB)"
        if self.chosen is None:
            return head + f"does not fit (the smallest setting measured {self._needs()}){left_out}"
        kept = "" if self.changed else " as configured"
        workers = "" if self.precompile_workers is None else f", {self.precompile_workers} precompile workers"
        measured = f"measured {self.estimate_gib:.1f} GiB" if self.estimate_gib is not None else "not measured" + (
            self._started()) + (
            f"; {self.after[0].describe()} if it runs out of memory before its timed steps" if self.after else "")
        return head + f"{self.chosen.describe()}{kept}{workers} ({measured})"

    def _started(self) -> str:
        """Where the settings tried start past the fastest: ``, where the run it builds on ran, whose 12 faster
        settings did not fit`` (or ``, past where the run it builds on ran (out of memory here before), ...``)."""
        if not self.skipped_faster:
            return ""
        settings = "setting" if self.skipped_faster == 1 else "settings"
        where = "where the run it builds on ran" if self.builds_on_ran else (
            "at the first setting not yet tried by the run it builds on")
        if self.started_past:
            why = (f"{self.start_needs_gib:.1f} GiB there with this run's training state" if self.start_needs_gib
                   else "out of memory here before")
            where = f"past {where.removeprefix('at ')} ({why})"
        return f", {where}, whose {self.skipped_faster} faster {settings} did not fit"

    def cell(self, *, short: bool = False) -> str:
        """The plan in a table cell: ``batch 8 x 2 accumulation steps, the EMA in the CPU's memory as configured``,
        ``tries batch 8, gradient checkpointing, then the next setting where it runs out of memory`` or ``does not
        fit in 16.0 GiB``; ``short``: ``8 x 2, EMA on the CPU (20.1)`` (the measured GiB), ``8, checkpointing
        (tried)`` or ``does not fit``."""
        extra = self.moved_state(short=short)
        if self.chosen is not None and short:
            measured = "" if self.estimate_gib is None else f" ({self.estimate_gib:.1f})"
            return f"{self.chosen.short()}{extra}{measured}"
        if self.chosen is not None:
            return f"{self.chosen.describe()}{extra}" + ("" if self.changed else " as configured")
        if self.probe:
            return (f"{self.probe[0].short()}{extra} (tried)" if short else
                    f"tries {self.probe[0].describe()}{extra}, then the next setting where it runs out of memory")
        return "does not fit" if short else f"does not fit in {self.budget_gib:.1f} GiB"

    def moved_state(self, *, short: bool = False) -> str:
        """What the plan moved out of the GPU's way, after a setting: ``, the EMA in the CPU's memory``; ``short``:
        ``, EMA on the CPU, AdamW per tensor``; empty where nothing moved."""
        state = [(self.ema_offloaded, "EMA on the CPU", "the EMA in the CPU's memory"),
                 (self.per_tensor_update, "AdamW per tensor", "AdamW one tensor at a time")]
        return "".join(f", {words[0] if short else words[1]}" for on, *words in state if on)

    def does_not_fit(self) -> str:
        """One line for a run that cannot start: what it needs, what it has, and the way out."""
        if self.state:
            host = self.source == "host"
            return (f"does not fit in {self.budget_gib:.1f} GiB{' available in the machine' if host else ''}: "
                    f"{self.state} alone take {self.estimate_gib:.1f} GiB at any batch size; "
                    f"{'run it on a GPU or a machine with more memory' if host else 'use a GPU with more free memory'}"
                    f"{self.state_fix}")
        left_out = f", and {self.left_out}" if self.left_out else ""
        return (f"does not fit in {self.budget_gib:.1f} GiB: the smallest setting measured for it "
                f"{self._needs()}{left_out}; use a GPU with more free memory, or lower image_size or the model")

    def _needs(self) -> str:
        """What the smallest measured setting needs: its peak, or, where that is all of the budget (a peak reserved
        stops at a cap), that it ran out of memory there; a peak just under it leaves no headroom (``HEADROOM``)."""
        if abs(self.estimate_gib - self.budget_gib) < 0.05:
            return f"ran out of memory in {self.budget_gib:.1f} GiB or needs more"
        if self.estimate_gib < self.budget_gib:
            return (f"reserved {self.estimate_gib:.1f} GiB, too close to the {self.budget_gib:.1f} to run again "
                    f"({HEADROOM:.0%} is kept free above a measured peak)")
        return f"needs {self.estimate_gib:.1f} GiB"

    def fix_after_oom(self, current: Candidate) -> str:
        """The next slower setting to try when ``current`` ran out of memory after all."""
        later = [c for c in self.after if c != current]
        if later:
            return f"try {later[0].describe()} ({_as_flags(later[0])})"
        return "the plan has no smaller setting left: use a GPU with more free memory, or a smaller image_size"

    def as_dict(self) -> dict[str, Any]:
        return {"budget_gib": self.budget_gib, "source": self.source,
                "chosen": None if self.chosen is None else asdict(self.chosen), "estimate_gib": self.estimate_gib,
                "state": self.state, "state_fix": self.state_fix,
                "probe": [asdict(c) for c in self.probe], "ran_out_here": self.ran_out_here,
                "precompile_workers": self.precompile_workers,
                "changed": self.changed, "after": [asdict(c) for c in self.after],
                "ema_offloaded": self.ema_offloaded, "per_tensor_update": self.per_tensor_update,
                "skipped_faster": self.skipped_faster, "started_past": self.started_past,
                "builds_on_ran": self.builds_on_ran, "left_out": self.left_out,
                "start_needs_gib": self.start_needs_gib,
                "note": self.note()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MemoryPlan:
        chosen = values.get("chosen")
        return cls(values["budget_gib"], values["source"], None if chosen is None else Candidate(**chosen),
                   values.get("estimate_gib"), values.get("state", ""), values.get("state_fix", ""),
                   tuple(Candidate(**c) for c in values.get("probe", ())), values.get("ran_out_here", 0),
                   values.get("precompile_workers"), values.get("changed", False),
                   tuple(Candidate(**c) for c in values.get("after", ())), values.get("ema_offloaded", False),
                   values.get("per_tensor_update", False), values.get("skipped_faster", 0),
                   values.get("started_past", False), values.get("builds_on_ran", True), values.get("left_out", ""),
                   values.get("start_needs_gib", 0.0))


def _as_flags(candidate: Candidate) -> str:
    flags = f"--batch_size {candidate.batch_size} --gradient_accumulation_steps {candidate.accumulation}"
    return flags + (" --gradient_checkpointing" if candidate.checkpointing else "") + (
        " --set compile=false" if candidate.uncompiled else "")


def candidates(batch_size: int, accumulation: int, checkpointing: bool, named: Iterable[str],
               compiled: bool = False) -> list[Candidate]:
    """The settings at the same global batch (``batch_size * accumulation``), fastest first: the batch per step from
    the largest down, each without checkpointing (unless it is on) and then with it; for a ``compiled`` recipe, each
    batch's settings again uncompiled before the next smaller batch, down to batch 1. A named field stays as it is.
    A batch a recipe cannot run (an odd one where Mixup pairs its images) is the caller's to drop: its config check
    raises ``ConfigError``."""
    named = set(named)
    total = batch_size * accumulation
    if "batch_size" in named:
        sizes = [batch_size]
    elif "gradient_accumulation_steps" in named:
        sizes = [total // accumulation]
    else:
        sizes = [size for size in range(total, 0, -1) if total % size == 0]
    switches = [checkpointing] if "gradient_checkpointing" in named or checkpointing else [False, True]
    # Checkpointing's extra forward costs less than a smaller step, which also replays no CUDA graphs: SD-1.5's peer
    # in 22 GiB ran 56.5 img/s checkpointed at batch 8 and 18.7 at 2 x 4 (benchmarks/RESULTS.md#memory-plan); so did
    # eager code at the full batch (its baseline: 40.8). Compiled steps need more memory than eager ones: in 16 GiB
    # only SD-1.5's eager step fits (benchmarks/RESULTS.md#memory-plan).
    modes = [False, True] if compiled and "compile" not in named else [False]
    return [Candidate(size, total // size, on, eager) for size in sizes for eager in modes for on in switches]


def estimate_gib(points: dict[int, float], batch_size: int) -> float | None:
    """The peak at ``batch_size`` from peaks measured at other batch sizes: the measured value, linear between the
    two measured sizes around it, and past the ends along the line through the two nearest. With one size measured,
    nothing is known at another: its peak bounds the smaller batches, but a bound above the budget would rule out a
    setting that fits (the peer's 40.9 GiB at batch 32 ruled out its batch 8 on a 40 GB card)."""
    if not points:
        return None
    sizes = sorted(points)
    if batch_size in points:
        return points[batch_size]
    if len(sizes) == 1:
        return None
    if batch_size < sizes[0]:
        low, high = sizes[0], sizes[1]
    elif batch_size > sizes[-1]:
        low, high = sizes[-2], sizes[-1]
    else:
        high = next(size for size in sizes if size > batch_size)
        low = max(size for size in sizes if size < batch_size)
    slope = (points[high] - points[low]) / (high - low)
    return max(0.0, points[low] + slope * (batch_size - low))


def fits(estimate: float, budget_gib: float) -> bool:
    return estimate * (1 + HEADROOM) <= budget_gib


def choose(options: Sequence[Candidate], estimates: Sequence[float | None], budget: Budget,
           configured: Candidate, state: TrainingState | None = None,
           ran_within: Collection[Candidate] = ()) -> MemoryPlan:
    """The first option whose measured peak fits ``budget``; where none is measured to fit, the unmeasured ones are
    tried in the run, in order. A setting measured to fit wins over unmeasured ones before it: SD-1.5's recipes at
    batch 4 x 2, unmeasured, ran out of memory in 22 GiB where batch 8 checkpointed measured 18.4 GiB
    (benchmarks/RESULTS.md#memory-plan). A setting that ran to the end on this GPU under this budget or a smaller one
    (``ran_within``) fits whatever its peak. Nothing fits where the training ``state`` alone fills the budget."""
    if state is not None and not state.leaves_room_in(budget.gib):
        return MemoryPlan(budget.gib, budget.source, None, state.gib, state.describe(), state.fix)
    for index, (option, estimate) in enumerate(zip(options, estimates)):
        if option in ran_within or (estimate is not None and fits(estimate, budget.gib)):
            return MemoryPlan(budget.gib, budget.source, option, estimate, changed=option != configured,
                              after=tuple(options[index + 1:]))
    unmeasured = tuple(option for option, estimate in zip(options, estimates) if estimate is None)
    if unmeasured:
        return MemoryPlan(budget.gib, budget.source, None, probe=unmeasured, changed=True, after=unmeasured[1:])
    return MemoryPlan(budget.gib, budget.source, None, min(estimates))


@dataclass(frozen=True)
class TrainingState:
    """What training holds whatever the batch: fp32 weights and their gradients, the optimizer's state (AdamW's two
    moments, SGD's momentum) and the EMA's copy, for each trained parameter."""

    parameters: int
    optimizer: str
    ema: bool
    fix: str = ""
    """What else shrinks it, where the run offers it: ``, or train LoRA adapters (--set lora_rank=4)``."""
    foreach_copy: bool = False
    """The unfused AdamW's multi-tensor update, which holds one more fp32 copy at its peak (``torch._foreach_sqrt``
    of the second moments): SD-1.5's baseline ran out of memory in its first update at 16 GiB at every batch size
    (benchmarks/RESULTS.md#memory-plan)."""
    compiled_copy: bool = False
    """A whole model compiled, under gradient accumulation: its backward hands back every gradient at once, beside
    those accumulated so far, so from a step's second batch on one more fp32 copy is held (eager code and compiled
    blocks hold one layer's or one block's; benchmarks/RESULTS.md#memory-plan)."""

    @property
    def gib(self) -> float:
        copies = (1 if self.foreach_copy else 0) + (1 if self.compiled_copy else 0)
        buffers = 2 + (2 if self.optimizer == "adamw" else 1) + (1 if self.ema else 0) + copies
        return self.buffer_gib * buffers

    def leaves_room_in(self, budget_gib: float) -> bool:
        """Whether anything is left of ``budget_gib`` for a step's activations once this state is held."""
        return self.gib < budget_gib

    @property
    def buffer_gib(self) -> float:
        """One fp32 copy of the trained parameters: the weights, the gradients, each moment, or the EMA."""
        return self.parameters * 4 / 2**30

    def describe(self) -> str:
        optimizer = "AdamW's moments" if self.optimizer == "adamw" else "the momentum"
        copy = (", its multi-tensor update's copy" if self.foreach_copy else "") + (
            ", the compiled backward's second copy of the gradients" if self.compiled_copy else "")
        return (f"the weights, gradients, {optimizer}{copy}{' and the EMA' if self.ema else ''} of "
                f"{self.parameters / 1e6:,.0f}M trained parameters")


def workers_that_fit(requested: int, budget_gib: float, trainer_gib: float, per_worker_gib: float) -> int:
    """How many precompile workers fit beside the training process (at least 2 or none: one worker compiles no
    sooner than the training process itself)."""
    room = math.floor((budget_gib - trainer_gib) / per_worker_gib) if per_worker_gib > 0 else requested
    workers = max(0, min(requested, room))
    return workers if workers >= 2 else 0


def read_budget(cap_gib: float | None) -> Budget | None:
    """The free memory of the GPU the run would use, less its CUDA context, read with ``nvidia-smi`` once this process
    has given back what its allocator caches unused (``give_back_cached_gpu_memory``), at most ``cap_gib`` where
    given; ``None`` where it cannot be read and no cap is given. A cap above the free memory cannot be kept: another
    process (a notebook's own tensors) holds the rest."""
    give_back_cached_gpu_memory()
    gpu = _first_visible_gpu()
    free = _free_gib(gpu)
    free = None if free is None else max(0.0, free - CONTEXT_GIB)
    if cap_gib is not None and (free is None or cap_gib <= free):
        return Budget(float(cap_gib), "gpu_memory_gib", gpu_name(gpu))
    return None if free is None else Budget(free, "free" if cap_gib is None else "free_below_cap", gpu_name(gpu))


def give_back_cached_gpu_memory() -> None:
    """Gives the GPU memory this process's allocator caches unused back to the driver, where this process has used
    the GPU: a notebook that trained or measured on the GPU before launching its runs (each a process of its own)
    kept what it had reserved (a ResNet-50 step at batch 256 reserves about 13 GiB), and a run beside it would find
    only the rest; a failed batch-size trial's tensors likewise. Compiled CUDA graphs keep their memory pools until
    ``torch._dynamo.reset()``."""
    torch = sys.modules.get("torch")  # a launcher that never imported torch holds no GPU memory
    if torch is None or not torch.cuda.is_initialized():
        return
    gc.collect()  # tensors of cycles the collector has not reached yet
    torch.cuda.empty_cache()


def read_host_budget() -> Budget | None:
    """The memory the machine has available (``MemAvailable`` in ``/proc/meminfo``), for a run on its CPU; ``None``
    where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return Budget(kib / 2**20, "host")


def _first_visible_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def _free_gib(gpu: str) -> float | None:
    out = _query_gpu(gpu, "memory.free")
    try:
        return None if out is None else float(out) / 1024
    except ValueError:
        return None


def gpu_name(gpu: str) -> str | None:
    """The name of GPU ``gpu`` (an index or UUID, as ``CUDA_VISIBLE_DEVICES`` names it) from ``nvidia-smi``, without
    starting CUDA in this process; ``None`` where it cannot be read."""
    return _query_gpu(gpu, "name") or None


def _query_gpu(gpu: str, field: str) -> str | None:
    """``nvidia-smi``'s value of ``field`` for GPU ``gpu``, without units; ``None`` where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu}", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def worker_share_gib(cap_gib: float, workers: int, trainer_gib: float | None) -> float:
    """What each precompile worker may reserve under a cap: the room the training process leaves them while they
    compile (measured, ``WorkerMemory.trainer_gib``), else an equal share with it."""
    room = cap_gib - trainer_gib if trainer_gib is not None else cap_gib * workers / (workers + 1)
    return max(0.5, room / max(1, workers))


class DoesNotFit(ConfigError):
    """Every setting the plan left to probe ran out of memory before its timed steps: the run is too large for the
    GPU, as a run the plan refuses before it starts, not broken."""


class OutOfMemory(RuntimeError):
    """A run out of GPU memory, said in one line: where (the step, or before the first), the memory in use, and the
    setting to try."""

    def __init__(self, message: str, step: int | None) -> None:
        super().__init__(message)
        self.step = step


def out_of_memory(step: int | None, total_steps: int, in_use_gib: float | None, budget_gib: float | None,
                  current: Candidate, plan: MemoryPlan | None, named: Iterable[str]) -> OutOfMemory:
    """The ``OutOfMemory`` for a run at ``current`` that ran out at ``step`` (``None``: before its first step)."""
    where = f"at step {step + 1} of {total_steps}" if step is not None else \
        "before the first step (building the model, compiling or capturing its graphs)"
    memory = f" with {in_use_gib:.1f} GiB reserved" if in_use_gib is not None else ""
    if budget_gib is not None:
        memory += f" of {budget_gib:.1f} GiB"
    if plan is not None:
        fix = plan.fix_after_oom(current)
    else:
        later = [c for c in candidates(current.batch_size, current.accumulation, current.checkpointing, named)
                 if c != current]
        fix = (f"try {later[0].describe()} ({_as_flags(later[0])})" if later else
               "use a GPU with more free memory, or a smaller image_size")
    return OutOfMemory(f"out of memory {where}{memory} at {current.describe()}: {fix}", step)


def memory_in_use_gib() -> float | None:
    """What this process's allocator holds now (for the out-of-memory line)."""
    import torch

    return torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else None
