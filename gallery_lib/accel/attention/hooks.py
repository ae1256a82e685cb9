"""Hooks that send a model's attention through the backend registry: ``GalleryAttnProcessor`` for diffusers
(``unet.set_attn_processor(...)``, or the reversible ``hook_diffusers_attention``) and ``hook_swin_attention`` for
timm's ``WindowAttention``, whose relative position bias and shift mask become an additive bias, so only backends
that accept one apply."""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch import nn

from gallery_lib.accel.attention.backends import (BACKENDS, BackendSelector, _remember_devices, attention,
                                                  default_selector)
from gallery_lib.accel.kernels.modules import compiling_for_cpu

class GalleryAttnProcessor:
    """diffusers attention processor that sends the attention product through this registry.

    It follows ``AttnProcessor2_0`` step by step (spatial norm, group norm, 4-D inputs, residual,
    rescale); like it, it uses the default ``1/sqrt(head_dim)`` scale.
    """

    def __init__(self, backend: str = "auto", selector: BackendSelector | None = None):
        self.backend, self.selector = backend, selector

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None, *args, **kwargs
                 ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        batch, seq_len, _ = (hidden_states if encoder_hidden_states is None else encoder_hidden_states).shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, seq_len, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        out = attention(query, key, value, bias=attention_mask, backend=self.backend, selector=self.selector)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
        if input_ndim == 4:
            out = out.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


class AttentionHook:
    """A reversible attention patch; ``remove()`` (or leaving the ``with`` block) restores the model.

    ``selector.chosen`` records what the hooked modules ran per attention shape, and how ``auto`` decided.
    """

    def __init__(self, modules: list[str], undo: Callable[[], None], selector: BackendSelector):
        self.modules, self._undo, self.selector = modules, undo, selector

    def remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def __enter__(self) -> AttentionHook:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"AttentionHook({len(self.modules)} modules)"


def hook_diffusers_attention(model: nn.Module, backend: str = "auto",
                             selector: BackendSelector | None = None) -> AttentionHook:
    """Sets ``GalleryAttnProcessor`` on every attention layer of a diffusers model; ``remove()`` restores them."""
    if not hasattr(model, "attn_processors") or not hasattr(model, "set_attn_processor"):
        raise TypeError(f"hook_diffusers_attention: {type(model).__name__} has no attn_processors; pass a diffusers "
                        "model such as UNet2DConditionModel")
    _remember_devices(model)
    selector = selector or default_selector().sharing_measurements()
    saved = dict(model.attn_processors)
    model.set_attn_processor(GalleryAttnProcessor(backend, selector))
    return AttentionHook(sorted(saved), lambda: model.set_attn_processor(dict(saved)), selector)


# --------------------------------------------------------------------- timm Swin hook
def _uses_window_attention(backend: str, qkv: torch.Tensor) -> bool:
    """``window`` (whose function falls back to its PyTorch math where the kernel cannot run), or ``auto`` where the
    window-attention kernel runs: a GPU, and window and head sizes it takes."""
    from gallery_lib.accel.kernels import use_triton
    from gallery_lib.accel.kernels.window_attention import supports

    if backend == "window":
        return True
    return backend == "auto" and qkv.is_cuda and use_triton(qkv) and supports(qkv.shape[1], qkv.shape[-1])


def _swin_window_forward(self: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if self._gallery_backend == "auto" and compiling_for_cpu(x):  # x: timm's forward touches it first
        # auto has no kernel to choose on a CPU (its rule there is math): the compiler gets timm's own attention, so
        # that the graph is the plain model's, as the fused layers do
        return type(self).forward(self, x, mask)
    b_, n, _ = x.shape
    qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1)
    bias = self._get_rel_pos_bias()  # (1, heads, N, N)
    if _uses_window_attention(self._gallery_backend, qkv):  # (benchmarks/RESULTS.md#bench-h100)
        from gallery_lib.accel.kernels.window_attention import window_attention

        x = window_attention(qkv, bias[0], mask, self.scale)
        return self.proj_drop(self.proj(x.reshape(b_, n, -1)))
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    if mask is not None:  # shift mask (windows, N, N): one bias per window, repeated over the batch
        num_win = mask.shape[0]
        bias = (bias + mask.unsqueeze(1)).unsqueeze(0).expand(b_ // num_win, -1, -1, -1, -1)
        bias = bias.reshape(b_, self.num_heads, n, n)
    x = attention(q, k, v, bias=bias, backend=self._gallery_backend, scale=self.scale,
                  selector=self._gallery_selector)
    return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b_, n, -1)))


def hook_swin_attention(model: nn.Module, backend: str = "auto",
                        selector: BackendSelector | None = None) -> AttentionHook:
    """Routes every timm Swin ``WindowAttention`` through the registry (instance-level, reversible).

    The relative position bias and the shift mask are one additive bias, so an explicit ``backend`` must accept
    a bias (``math`` or ``efficient``), or be ``window``: the window-attention kernel, which adds them itself
    (``kernels/window_attention.py``, the PyTorch math where Triton cannot run). ``auto`` runs that kernel on a GPU
    and picks among the bias-taking backends elsewhere (or where the kernel cannot take the window size); compiled on
    a CPU, where that pick is math, it leaves timm's own attention in the graph. ``state_dict`` is unchanged.
    """
    if backend not in ("auto", "window") and (backend not in BACKENDS or not BACKENDS[backend].supports_bias):
        ok = [n for n, b in BACKENDS.items() if b.supports_bias] + ["window"]
        raise ValueError(f"hook_swin_attention: backend {backend!r} cannot take Swin's additive relative-position "
                         f"bias; use 'auto' or one of {ok}")
    found = [(name, m) for name, m in model.named_modules()
             if type(m).__name__ == "WindowAttention" and hasattr(m, "_get_rel_pos_bias")]
    if not found:
        raise ValueError(f"hook_swin_attention: no timm WindowAttention in {type(model).__name__}")
    for name, m in found:
        if m.attn_drop.p > 0:
            raise ValueError(f"hook_swin_attention: {name} has attention dropout {m.attn_drop.p}; the hooked "
                             "kernels run without it, so build the model with attn_drop_rate=0")
    _remember_devices(model)
    selector = selector or default_selector().sharing_measurements()
    previous = {}
    for name, m in found:
        previous[name] = m.__dict__.get("forward")
        m._gallery_backend, m._gallery_selector = backend, selector
        m.forward = types.MethodType(_swin_window_forward, m)

    def undo():
        for name, m in found:
            del m.forward
            if previous[name] is not None:
                m.forward = previous[name]
            del m._gallery_backend, m._gallery_selector

    return AttentionHook([n for n, _ in found], undo, selector)
