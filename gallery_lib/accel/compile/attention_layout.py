"""Attention keeps its own tensor layout in graphs Inductor lays out channels_last.

With ``force_layout_optimization`` (the ``channels_last_graphs`` setting), Inductor gives every dense 4D tensor
upstream or downstream of a convolution channels_last strides (``GraphLowering.find_nodes_prefer_channels_last``).
In SD's ``Transformer2DModel`` the attention's ``(batch, heads, tokens, head_dim)`` tensors sit between ``proj_in``
and ``proj_out``, so they get strides with the heads innermost; SDPA needs the head dim innermost, so Inductor copies
the inputs, and then the output and the gradients on their way back to the linear layers
(benchmarks/RESULTS.md#sd15-attention-layout). ``KeepAttentionLayout`` is an Inductor post-grad pass that marks the
attention ops and the 4D views that feed and leave them; the graph lowering then leaves the marked nodes in their
traced strides. As a custom pass it is part of Inductor's cache key, so graphs cached without it are not reused.
``channels_last_graph_options`` is the pair of Inductor options a compile with the layout forced takes.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

MARK = "gallery_keep_attention_layout"
"""``node.meta`` key of the nodes the lowering leaves in their traced strides."""


def _attention_ops() -> frozenset:
    names = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = set()
    for name in names:
        for variant in (name, f"{name}_backward"):
            packet = getattr(torch.ops.aten, variant, None)
            if packet is not None:
                ops.add(packet.default)
    return frozenset(ops)


def _view_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
                      aten.permute.default, aten.expand.default, aten.alias.default, aten.unsqueeze.default,
                      aten.squeeze.dim})


def _is_4d(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 4


def attention_layout_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The attention ops of ``graph``, their 4D inputs with the chains of views that make them, and their outputs
    with the chains of 4D views that take them back to the model's layout."""
    attention, views = _attention_ops(), _view_ops()
    marked: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.target not in attention:
            continue
        marked.add(node)
        upstream = [arg for arg in node.all_input_nodes if _is_4d(arg)]
        while upstream:
            arg = upstream.pop()
            if arg not in marked:
                marked.add(arg)
                if arg.target in views:
                    upstream.extend(a for a in arg.all_input_nodes if _is_4d(a))
        downstream = list(node.users)
        while downstream:
            user = downstream.pop()
            if user not in marked and (user.target is operator.getitem or (user.target in views and _is_4d(user))):
                marked.add(user)
                downstream.extend(user.users)
    return marked


class KeepAttentionLayout(CustomGraphPass):
    """Inductor post-grad pass: marks `attention_layout_nodes` so that the channels_last layout optimization leaves
    them alone (the lowering's side of it is installed on the first call)."""

    VERSION = 1

    def __call__(self, graph: torch.fx.Graph) -> None:
        _install_lowering_filter()
        for node in attention_layout_nodes(graph):
            node.meta[MARK] = True

    def uuid(self) -> str:
        return f"gallery-keep-attention-layout-v{self.VERSION}"

    def __repr__(self) -> str:  # stable: the precompile marker keys the compile options by their repr
        return f"KeepAttentionLayout(v{self.VERSION})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepAttentionLayout)

    def __hash__(self) -> int:
        return hash(self.uuid())


def _install_lowering_filter() -> None:
    """Wraps ``GraphLowering.find_nodes_prefer_channels_last`` (once) to drop the nodes the pass marked."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.find_nodes_prefer_channels_last
    if getattr(original, "_gallery_filter", False):
        return

    def find_nodes_prefer_channels_last(self):
        preferred = original(self)
        return type(preferred)(node for node in preferred if not node.meta.get(MARK))

    find_nodes_prefer_channels_last._gallery_filter = True
    GraphLowering.find_nodes_prefer_channels_last = find_nodes_prefer_channels_last


def channels_last_graph_options() -> dict:
    """The Inductor options that force channels_last through every graph and leave attention in its own layout, to
    add to a compile mode's own options (``torch.compile`` takes a mode or options, not both)."""
    return {"force_layout_optimization": True, "post_grad_custom_post_pass": KeepAttentionLayout()}
