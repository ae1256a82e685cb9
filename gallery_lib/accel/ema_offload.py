"""An offloaded EMA's update streamed through the GPU in chunks, beside the next step's forward and backward.

diffusers' ``offload_ema`` (and ``ModelEma(offload=True)`` in ``foreach`` mode) copies the whole EMA to the GPU,
averages it and copies it back, all on the main stream: the next forward waits for two transfers of every averaged
weight over PCIe (about 3.4 GB each way for SD-1.5's UNet), and the GPU holds a whole copy while it averages.

Here the averaged tensors go in groups of at most ``chunk_bytes`` through two staging buffers on the GPU, on two side
streams: one copies a group in and averages it, the other copies it back out, so the copies in both directions overlap
each other and the next step's forward and backward. The arithmetic is the same ``lerp`` on the same values as the
main-stream update; only the order of work on the GPU differs. The GPU holds two chunks, not a whole copy.

Ordering: the side streams start after the optimizer step that wrote the weights (an event on the main stream); the
next optimizer step waits, on the GPU, for the last copy out (``ModelEma.attach_optimizer``); a reader of the EMA's
weights on the host waits for that copy too.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from gallery_lib.accel.kernels import dense
from gallery_lib.accel.kernels.ema_lerp import foreach_lerp_

CHUNK_BYTES = 64 << 20
"""Two chunks of 64 MiB stay on the GPU: small beside any training step's activations, large enough for a copy to run
at PCIe speed."""


def chunk_groups(tensors: list[torch.Tensor], chunk_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` in order, grouped by dtype, each group at most ``chunk_bytes`` (a tensor larger than that
    is a group of its own)."""
    groups: list[list[int]] = []
    open_group: dict[torch.dtype, tuple[list[int], int]] = {}
    for index, tensor in enumerate(tensors):
        size = tensor.numel() * tensor.element_size()
        group, used = open_group.get(tensor.dtype, (None, 0))
        if group is None or used + size > chunk_bytes:
            group, used = [], 0
            groups.append(group)
        group.append(index)
        open_group[tensor.dtype] = (group, used + size)
    return groups


class ChunkedOffload:
    """Averages ``host`` (the EMA's tensors in the CPU's memory) towards the model's tensors on ``device``, a chunk at
    a time through two staging buffers per dtype; on a CUDA device on two side streams, elsewhere (a test's CPU) in
    order on the host."""

    def __init__(self, host: list[torch.Tensor], device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        sparse = [i for i, t in enumerate(host) if not dense(t)]
        if sparse:
            raise ValueError(f"ChunkedOffload: tensor {sparse[0]} of the EMA has gaps or overlaps in its memory "
                             f"(shape {tuple(host[sparse[0]].shape)}, stride {host[sparse[0]].stride()}); pass dense "
                             "tensors (e.g. .contiguous())")
        self.host = host
        self.groups = chunk_groups(host, chunk_bytes)
        self.device = device
        largest: dict[torch.dtype, int] = {}
        for group in self.groups:
            dtype = host[group[0]].dtype
            largest[dtype] = max(largest.get(dtype, 0), sum(host[i].numel() for i in group))
        # two slots per dtype: a group copies in to one while the group before copies out of the other
        self._staging = {dtype: [torch.empty(numel, dtype=dtype, device=device) for _ in range(2)]
                         for dtype, numel in largest.items()}
        self._slot_views = [self._views(group, number % 2) for number, group in enumerate(self.groups)]
        buffers = [buffer for pair in self._staging.values() for buffer in pair]
        self.staging_bytes = sum(buffer.numel() * buffer.element_size() for buffer in buffers)
        self._on_cuda = device.type == "cuda"
        self._in = self._out = self.done = None
        if self._on_cuda:
            self._in, self._out = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
            for buffer in buffers:  # freed with the EMA, returned to the allocator once both streams are done with it
                buffer.record_stream(self._in)
                buffer.record_stream(self._out)
            self._averaged = [torch.cuda.Event() for _ in range(2)]
            self._freed = [torch.cuda.Event() for _ in range(2)]
            self.done = torch.cuda.Event()
            """Recorded after the last copy out of an update: what the next optimizer step and a host reader wait
            for (``None`` off a GPU)."""

    def _views(self, group: list[int], slot: int) -> list[torch.Tensor]:
        """Views of a staging slot laid out as the group's host tensors (channels_last ones too), so each copy is one
        plain transfer."""
        buffer, offset, views = self._staging[self.host[group[0]].dtype][slot], 0, []
        for index in group:
            tensor = self.host[index]
            views.append(buffer[offset:offset + tensor.numel()].as_strided(tensor.shape, tensor.stride()))
            offset += tensor.numel()
        return views

    def update(self, model: list[torch.Tensor], weight: float, copies: tuple[list, list] = ([], [])) -> None:
        """``host[i].lerp_(model[i], weight)`` for every ``i``, and ``copies``' ``(host, model)`` pairs copied out as
        they are (the frozen weights: ``ModelEma`` copies the buffers itself, before the next forward moves them). On a
        GPU it returns once the work is queued."""
        cuda = self._on_cuda
        if cuda:
            main = torch.cuda.current_stream(self.device)
            self._in.wait_stream(main)  # the weights after the optimizer step
            self._out.wait_stream(main)
            # the last update's copies out have landed before this one reads the CPU's tensors again, whether or not
            # an optimizer step waited for them in between (a no-op before the first update)
            self._in.wait_event(self.done)
        for number, group in enumerate(self.groups):
            slot = number % 2
            staged = self._slot_views[number]
            with self._on(self._in):
                if cuda:  # the slot's last group has left it (a no-op before its first use)
                    self._in.wait_event(self._freed[slot])
                for view, index in zip(staged, group):
                    view.copy_(self.host[index], non_blocking=True)
                foreach_lerp_(staged, [model[i] for i in group], weight)
                if cuda:
                    self._averaged[slot].record(self._in)
            with self._on(self._out):
                if cuda:
                    self._out.wait_event(self._averaged[slot])
                for view, index in zip(staged, group):
                    self.host[index].copy_(view, non_blocking=True)
                if cuda:
                    self._freed[slot].record(self._out)
        with self._on(self._out):
            for host, tensor in zip(*copies):
                host.copy_(tensor, non_blocking=True)
            if cuda:
                self.done.record(self._out)

    @staticmethod
    def _on(stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()
