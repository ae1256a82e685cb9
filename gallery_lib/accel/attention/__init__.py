"""Attention through the fastest kernel that can run each call.

- ``backends.py``: the backend registry with each kernel's constraints, per-shape selection (``auto`` times the
  eligible backends once per shape, dtype and GPU) and ``attention(q, k, v, bias)``;
- ``hooks.py``: hooks that route a diffusers model's or timm Swin's attention through it;
- ``sdpa_probe.py``: what PyTorch's own SDPA dispatch picks, for the runs that keep it.
"""

from gallery_lib.accel.attention.backends import (BACKENDS, AttentionBackend, BackendSelector, attention,
                                                  benchmark_backend, call_key, default_selector, describe,
                                                  rule_choice, select_backend)
from gallery_lib.accel.attention.hooks import (AttentionHook, GalleryAttnProcessor, hook_diffusers_attention,
                                               hook_swin_attention)
from gallery_lib.accel.attention.sdpa_probe import record_sdpa_choices, sdpa_choice

__all__ = ["BACKENDS", "AttentionBackend", "AttentionHook", "BackendSelector", "GalleryAttnProcessor", "attention",
           "benchmark_backend", "call_key", "default_selector", "describe", "hook_diffusers_attention",
           "hook_swin_attention", "record_sdpa_choices", "rule_choice", "sdpa_choice", "select_backend"]
