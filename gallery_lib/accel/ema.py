"""Exponential moving average (EMA) of model weights, with four update modes.

The API follows timm's ``ModelEmaV3``: a pure ``get_decay(step)`` (diffusers' warm-up ramp),
``@torch.no_grad() update(model)``, a swap-in context for evaluation and ``state_dict``. The modes
differ only in how the update ``ema = lerp(ema, param, 1 - decay)`` is launched:

- ``loop``: one ``lerp_`` per tensor, as the diffusers ``EMAModel`` default does (the baseline);
- ``foreach``: ``torch._foreach_lerp_`` (multi-tensor kernels, a few launches);
- ``fused``: one Triton kernel over every averaged tensor (``gallery_lib.accel.kernels.ema_lerp``), which reads
  and writes each byte once;
- ``stream``: the fused (or foreach) update on a side CUDA stream. The side stream waits on an event
  recorded on the main stream after the optimizer step; the next optimizer step (through
  ``attach_optimizer``), ``swap``, ``state_dict`` and ``module`` make the main stream wait on the EMA's
  event. The kernel runs as persistent programs on half the SMs (``stream_programs`` sets another count), so it
  sips bandwidth beside the next forward instead of taking every SM at once: a full-width update on a side stream
  competes with the forward for the same bandwidth, and measured slower (benchmarks/RESULTS.md#ema). The buffers
  are copied on the main stream when ``update`` is called: the next forward writes them (BatchNorm's statistics).

The update can also run inside the optimizer's pass: ``gallery_lib.accel.adamw_ema.AdamWWithEma`` (``attach_ema``)
applies AdamW and the EMA in one kernel, and ``update`` then counts the update and copies the buffers only.

What is averaged: floating-point parameters with ``requires_grad`` at construction, whether or not they
got a gradient this step (their EMA keeps moving towards the current value). Frozen parameters and all
buffers (float and integer) are copied from the model on each update: a frozen weight has nothing to
average, and BatchNorm statistics are already running averages. Call ``ModelEma`` again if you change
which parameters train.

On a CPU (or without Triton) ``fused`` and ``stream`` fall back to ``foreach`` with one warning;
``effective_mode`` tells which mode runs.

``offload=True`` keeps the EMA's weights in the CPU's pinned memory between updates, as diffusers' ``offload_ema``.
In ``loop`` and ``foreach`` mode, as diffusers does, each update copies them to the model's device, averages there and
copies them back, all on the current stream; the training loop frees the gradients before that update, so the GPU
holds the EMA only while the activations are gone. In ``fused`` and ``stream`` mode on a GPU, they stream through it in
chunks on side streams, beside the next forward (``stream``; ``gallery_lib.accel.ema_offload``). Either way a reader
of the weights (``module``, ``state_dict``, ``swap``) first waits for the copies back.

A ZeRO-2 model (FSDP2: its parameters are sharded DTensors) cannot be deep-copied; ``ModelEma(model, template=...)``
builds the EMA module from the model's plain template instead (``gallery_lib.accel.distributed.meta_template``) and
gives it clones of the sharded parameters. Each process then averages its own shards (the updates run on the DTensors'
local tensors, in every mode), ``state_dict`` holds sharded DTensors (saved by ``torch.distributed.checkpoint``) and
``gather_full_module`` gathers the full EMA weights for an export.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from gallery_lib.accel.ema_offload import ChunkedOffload
from gallery_lib.accel.kernels import sm_count
from gallery_lib.accel.kernels.ema_lerp import build_tables, foreach_copy_, foreach_lerp_, has_triton, launch_fused

MODES = ("loop", "foreach", "fused", "stream")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Returns the module under ``torch.compile`` (``_orig_mod``) and DDP/FSDP-style (``module``) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        else:
            return model


def _named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {name: p for name, p in model.named_parameters()}
    state.update({name: b for name, b in model.named_buffers()})
    return state


def _named_tensors(model_state: dict[str, torch.Tensor], names: list[str], caller: str) -> list[torch.Tensor]:
    """The local tensors of ``names`` in ``model_state``, or a clear error naming the first one missing."""
    try:
        return _local([model_state[n] for n in names])
    except KeyError as e:
        raise ValueError(f"ModelEma.{caller}: the model has no tensor {e}; pass the model the EMA was built from")


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's shards of sharded (DTensor) tensors, views that updates write through; others as they are."""
    if not torch.distributed.is_available():
        return tensors
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _copy_with_template(model: nn.Module, template: nn.Module) -> nn.Module:
    """``template`` (``model``'s structure, parameters on the meta device) holding clones of ``model``'s tensors."""
    copied = copy.deepcopy(template)
    for name, tensor in _named_state(model).items():
        owner, _, leaf = name.rpartition(".")
        module = copied.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor.detach().clone(), requires_grad=False)
        else:
            module._buffers[leaf] = tensor.detach().clone()
    return copied


def _keep_on_cpu(module: nn.Module) -> None:
    """``module``'s weights and buffers moved to the CPU, in pinned (page-locked) memory where CUDA is there, so that
    copies to and from the GPU run asynchronously at full speed."""
    module.to("cpu")
    if torch.cuda.is_available():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            tensor.data = tensor.data.pin_memory()


def ema_mode_on(mode: str, device_type: str, offloaded: bool = False) -> tuple[str, str | None]:
    """The mode an EMA asked to run in ``mode`` runs in on ``device_type``, and why it differs (``None`` if not):
    ``fused`` and ``stream`` need a CUDA device, and Triton where the EMA's weights live on the GPU; they fall back
    to ``foreach``. Offloaded, both run as ``stream``: the weights stream through the GPU in chunks on side streams."""
    if mode in ("loop", "foreach"):
        return mode, None
    if device_type != "cuda":
        return "foreach", f"the EMA lives on {device_type}"
    if offloaded:
        return "stream", None
    if not has_triton:
        return "foreach", "Triton is not installed"
    return mode, None


class ModelEma:
    """EMA of a model's weights.

    Args:
        model: the model being trained; it is deep-copied, so create the EMA after moving the model to its device.
        decay: the EMA decay (once warm-up is over). The first update copies the weights.
        ratio_warmup: ramp the decay as ``(1 + step) / (10 + step)`` (capped at ``decay``), what diffusers'
            ``EMAModel`` does by default (without ``use_ema_warmup``): 0.9 after 80 updates, 0.99 after 890.
        mode: one of ``loop``, ``foreach``, ``fused``, ``stream`` (module docstring).
        stream_programs: in ``stream`` mode, the number of persistent Triton programs of the update kernel
            (``None``: half the device's SMs).
        template: for a model that cannot be deep-copied (ZeRO-2's sharded one), a copy of its structure with the
            parameters on the meta device; the EMA is built from it (module docstring).
        offload: keep the EMA's weights in the CPU's pinned memory between updates (diffusers' ``offload_ema``;
            the module docstring says how each mode updates them). ``module`` is then on the CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        decay: float = 0.9999,
        ratio_warmup: bool = False,
        mode: str = "foreach",
        stream_programs: int | None = None,
        template: nn.Module | None = None,
        offload: bool = False,
    ):
        if offload and template is not None:
            raise ValueError("ModelEma: offload keeps a whole copy in the CPU's memory, and a template (ZeRO-2) "
                             "shards the EMA over the processes already; use one of them")
        if mode not in MODES:
            raise ValueError(f"ModelEma: unknown mode {mode!r}; use one of {MODES}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ModelEma: need 0 <= decay <= 1, got decay={decay}")
        model = unwrap_model(model)
        self.decay = decay
        self.ratio_warmup = ratio_warmup
        self.mode = mode
        self.stream_programs = stream_programs
        self.step = 0  # number of updates applied (skipped steps excluded)
        self.change: Any = None  # what ``add_ema`` says it set up (``gallery_lib.accel.on_any_model.Change``)

        ema_model = copy.deepcopy(model) if template is None else _copy_with_template(model, template)
        self._module = ema_model.eval().requires_grad_(False)
        trained = {name for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()}
        self._avg_names = [name for name in _named_state(model) if name in trained]
        self._copy_names = [name for name in _named_state(model) if name not in trained]
        # _named_state lists the parameters before the buffers: what is copied is the frozen weights, then the buffers
        self._frozen_count = len(self._copy_names) - len(dict(model.named_buffers()))
        ema_state = _named_state(self._module)
        self.device = next(iter(ema_state.values())).device if ema_state else torch.device("cpu")
        """Where the EMA averages: the model's device."""
        self.offloaded = offload
        self._copied = None  # with offload, the event after its copies back to the CPU, until a reader waits for it
        if offload:
            _keep_on_cpu(self._module)
            ema_state = _named_state(self._module)
        self._ema_avg = _local([ema_state[n] for n in self._avg_names])
        self._ema_copy = _local([ema_state[n] for n in self._copy_names])

        self.effective_mode = self._resolve_mode(mode)
        self._tables: dict[Any, Any] = {}
        self._stream = self._event = None
        self._pending = False
        self._optimizer_attached = False
        self._averaging_optimizer: Any = None
        self._offload = None  # offloaded, in stream mode: the chunks' streams and staging buffers
        if self.effective_mode == "stream" and offload:
            self._offload = ChunkedOffload(self._ema_avg, self.device)
        elif self.effective_mode == "stream":
            self._stream = torch.cuda.Stream(device=self.device)
            self._event = torch.cuda.Event()
            if stream_programs is None:
                self.stream_programs = max(1, sm_count(self.device) // 2)

    def _resolve_mode(self, mode: str) -> str:
        effective, why = ema_mode_on(mode, self.device.type, self.offloaded)
        if why is not None:
            warnings.warn(f"ModelEma: mode {mode!r} needs a CUDA device and Triton, but {why}; using 'foreach' "
                          "instead.", stacklevel=3)
        return effective

    # ----------------------------------------------------------------- decay and update
    def get_decay(self, step: int | None = None) -> float:
        """The decay used by the update at ``step`` (1-based count of updates); pure, no side effects."""
        if step is None:
            return self.decay
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        if self.ratio_warmup:
            return min((1.0 + step) / (10.0 + step), self.decay)
        return self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, skipped: bool = False) -> None:
        """Moves the EMA towards ``model`` (wrappers from ``torch.compile``/DDP are unwrapped); call after
        ``optimizer.step()``. ``skipped``: the optimizer step was skipped (GradScaler found inf/NaN), so nothing
        changes, not even the update count."""
        if skipped:
            return
        self.step += 1
        weight = 1.0 - self.get_decay(self.step)
        model_state = _named_state(unwrap_model(model))
        model_avg = _named_tensors(model_state, self._avg_names, "update")
        model_copy = _named_tensors(model_state, self._copy_names, "update")

        if self._averaging_optimizer is not None and self._averaging_optimizer.averaged_update == self.step:
            self._copy(self._ema_copy, model_copy)  # its step averaged; what is left is copying the rest
        elif self.effective_mode == "stream":
            # The buffers (BatchNorm's statistics) change in the next forward, which the side streams run beside: they
            # are copied now, on the current stream. The side streams copy the frozen weights, which nothing writes.
            frozen = self._frozen_count
            self._copy(self._ema_copy[frozen:], model_copy[frozen:])
            later = (self._ema_copy[:frozen], model_copy[:frozen])
            if self._offload is not None:
                self._offload.update(model_avg, weight, later)
                self._copied = self._offload.done  # a reader on the host waits for the last copy out
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    self._apply(model_avg, later, weight, self.stream_programs)
                self._event.record(self._stream)
            self._pending = True
            if not self._optimizer_attached:
                self._optimizer_attached = True  # warn once
                warnings.warn("ModelEma(mode='stream'): call attach_optimizer(optimizer) (or wait() before each "
                              "optimizer.step()) so the optimizer does not write weights the EMA is still reading.",
                              stacklevel=2)
        else:
            self._apply(model_avg, (self._ema_copy, model_copy), weight, None)

    def update_from_scaler(self, model: nn.Module, scaler: torch.amp.GradScaler, scale_before: float) -> bool:
        """Updates unless the GradScaler skipped the optimizer step; returns whether it updated.

        Read ``scale_before = scaler.get_scale()`` before ``scaler.update()``: the scaler lowers its scale exactly
        when it found inf/NaN gradients and skipped ``optimizer.step()``. ``get_scale()`` syncs with the GPU; bf16
        autocast needs no scaler, so bf16 training pays nothing.
        """
        skipped = scaler.is_enabled() and scaler.get_scale() < scale_before
        self.update(model, skipped=skipped)
        return not skipped

    def _apply(self, model_avg: list[torch.Tensor], copies: tuple[list[torch.Tensor], list[torch.Tensor]],
               weight: float, programs: int | None) -> None:
        """Averages ``model_avg`` into the EMA and copies ``copies``' model tensors (its second list) into their EMA
        tensors (its first), on the current stream."""
        self._copy(*copies)
        # an offloaded EMA averages on the device, in copies of its CPU tensors (on a CPU model, the tensors themselves)
        ema_avg = [e.to(self.device, non_blocking=True) for e in self._ema_avg] if self.offloaded else self._ema_avg
        if self.effective_mode == "loop":
            for e, m in zip(ema_avg, model_avg):
                e.lerp_(m, weight)
        elif self.effective_mode == "foreach":
            foreach_lerp_(ema_avg, model_avg, weight)
        else:  # fused or stream, averaging the GPU's own copy (an offloaded stream EMA goes through _offload)
            key = tuple(t.data_ptr() for t in model_avg + self._ema_avg)
            if key not in self._tables:  # tensors were re-allocated (or first call): rebuild the pointer table
                self._tables = {key: build_tables(self._ema_avg, model_avg)}
            groups, rest_e, rest_m = self._tables[key]
            for group in groups:
                launch_fused(group, weight, programs)
            foreach_lerp_(rest_e, rest_m, weight)
        if self.offloaded:
            self._copy_back(ema_avg)

    def _copy(self, ema: list[torch.Tensor], model: list[torch.Tensor]) -> None:
        """``model``'s tensors into ``ema``'s, on the current stream (offloaded: into its pinned memory)."""
        if self.offloaded:
            for e, m in zip(ema, model):
                e.copy_(m, non_blocking=True)
        elif ema:
            foreach_copy_(ema, model)

    def _copy_back(self, averaged: list[torch.Tensor]) -> None:
        """An offloaded EMA's averages back into its pinned memory, ordered on the current stream; the event marks
        when a reader on the host may read them."""
        for e, d in zip(self._ema_avg, averaged):
            if e is not d:
                e.copy_(d, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    def _wait_for_copies(self) -> None:
        """The host waits for the last update's copies into the CPU's memory before it reads that memory."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    # ----------------------------------------------------------------- the optimizer's pass
    def averaged_pairs(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each averaged tensor of ``model`` with its average (this process's shards of sharded ones)."""
        model_state = _named_state(unwrap_model(model))
        return list(zip(_named_tensors(model_state, self._avg_names, "averaged_pairs"), self._ema_avg))

    def averaged_by(self, optimizer: Any) -> None:
        """Leaves the averaging of each update whose number ``optimizer.averaged_update`` names to the optimizer's
        step (``AdamWWithEma``); updates it did not average still average here."""
        self._averaging_optimizer = optimizer

    # ----------------------------------------------------------------- stream ordering
    def wait(self) -> None:
        """Makes the current stream wait for a pending side-stream update (no host sync); with ``offload``, the host
        waits for the last update's copies back to the CPU."""
        self._wait_for_copies()
        self._order_after_update()

    def _order_after_update(self) -> None:
        """The current stream waits, on the GPU, for a pending side-stream update."""
        if self._pending:
            done = self._offload.done if self._offload is not None else self._event
            torch.cuda.current_stream(self.device).wait_event(done)
            self._pending = False

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Makes ``optimizer.step()`` wait, on the GPU (the host runs on), for the EMA update first; returns the hook
        handle."""
        self._optimizer_attached = True
        return optimizer.register_step_pre_hook(lambda *_: self._order_after_update())

    # ----------------------------------------------------------------- evaluation and checkpoints
    @property
    def module(self) -> nn.Module:
        """The EMA model (waits for a pending stream update)."""
        self.wait()
        return self._module

    @contextmanager
    def swap(self, model: nn.Module) -> Iterator[nn.Module]:
        """Loads the EMA weights into ``model`` for the ``with`` block and restores the originals exactly after."""
        self.wait()
        model_state = _named_state(unwrap_model(model))
        ema_state = _named_state(self._module)
        names = [n for n in ema_state if n in model_state]
        model_t = _local([model_state[n] for n in names])
        with torch.no_grad():
            backup = [t.detach().clone() for t in model_t]
            foreach_copy_(model_t, _local([ema_state[n] for n in names]))
        try:
            yield model
        finally:
            with torch.no_grad():
                foreach_copy_(model_t, backup)

    def state_dict(self) -> dict[str, Any]:
        """EMA weights plus the update count (waits for a pending stream update)."""
        return {"module": self.module.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "module" not in state or "step" not in state:
            raise ValueError("ModelEma.load_state_dict: expected the dict from ModelEma.state_dict() "
                             f"(keys 'module' and 'step'), got keys {sorted(state)}")
        self.module.load_state_dict(state["module"])
        self.step = int(state["step"])

    def __repr__(self) -> str:
        return (f"ModelEma(mode={self.mode!r}, effective_mode={self.effective_mode!r}, decay={self.decay}, "
                f"averaged={len(self._avg_names)}, copied={len(self._copy_names)}, step={self.step})")
