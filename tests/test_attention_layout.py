"""Attention keeps its layout in graphs Inductor lays out channels_last (``accel/compile/attention_layout.py``):
the nodes the pass marks, its place in Inductor's cache key, and a compiled conv -> attention -> conv block that
trains as the eager one with the attention left out of the channels_last set."""

from __future__ import annotations

import operator
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from gallery_lib.accel.compile.attention_layout import MARK, KeepAttentionLayout, attention_layout_nodes

HEADS, CHANNELS, SIDE = 2, 8, 4


class ConvAttentionConv(nn.Module):
    """SD's Transformer2DModel in miniature: a 1x1 conv in, self-attention over the pixels, a 1x1 conv out."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in, self.proj_out = nn.Conv2d(CHANNELS, CHANNELS, 1), nn.Conv2d(CHANNELS, CHANNELS, 1)
        self.to_q, self.to_k, self.to_v = (nn.Linear(CHANNELS, CHANNELS, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = self.proj_in(x).permute(0, 2, 3, 1).reshape(b, SIDE * SIDE, CHANNELS)
        q, k, v = (proj(h).view(b, -1, HEADS, CHANNELS // HEADS).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, SIDE, SIDE, CHANNELS)
        return self.proj_out(h.permute(0, 3, 1, 2)) + x


def traced_graph() -> torch.fx.Graph:
    model = ConvAttentionConv()
    return make_fx(lambda x: model(x))(torch.randn(2, CHANNELS, SIDE, SIDE)).graph


def test_marks_the_attention_its_input_views_and_its_output_views_only():
    graph = traced_graph()
    marked = attention_layout_nodes(graph)
    attention = [n for n in graph.nodes if "scaled_dot_product" in str(n.target)]
    assert attention and set(attention) <= marked
    convs = [n for n in graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert len(convs) == 2 and not marked & set(convs)
    # q, k, v: the 4D transposes and views of the projections, not the projections' 2D/3D outputs.
    for q_k_v in attention[0].args[:3]:
        assert q_k_v in marked and q_k_v.meta["val"].dim() == 4
    assert all(n.meta["val"].dim() == 4 for n in marked if n.target is not operator.getitem
               and isinstance(n.meta.get("val"), torch.Tensor))
    # The output's way back: getitem, transpose (4D), then the 4D reshape to pixels, which proj_out's permute reads.
    first_out = next(u for u in attention[0].users if u.target is operator.getitem and u.args[1] == 0)
    assert first_out in marked and any(u in marked for u in first_out.users)
    conv_only = make_fx(nn.Conv2d(3, 3, 1))(torch.randn(1, 3, 4, 4)).graph
    assert attention_layout_nodes(conv_only) == set()  # a graph without attention: nothing to mark


def test_the_pass_keys_inductor_caches_and_survives_pickling():
    graph = traced_graph()
    KeepAttentionLayout()(graph)
    assert {n for n in graph.nodes if n.meta.get(MARK)} == attention_layout_nodes(graph)
    copy = pickle.loads(pickle.dumps(KeepAttentionLayout()))  # precompile workers get the options pickled
    assert copy == KeepAttentionLayout() and copy.uuid() == "gallery-keep-attention-layout-v1"
    assert repr(copy) == "KeepAttentionLayout(v1)"  # the precompile marker keys the options by repr


@pytest.mark.slow  # over 30 s on 2 cores: left out of the fast tier
def test_compiled_block_trains_as_eager_with_the_attention_out_of_the_channels_last_set(monkeypatch):
    from torch._inductor.graph import GraphLowering

    KeepAttentionLayout()(torch.fx.Graph())  # installs the lowering's filter, which the spy then wraps
    installed, preferred = GraphLowering.find_nodes_prefer_channels_last, []

    def spy(self):
        nodes = installed(self)
        preferred.append({str(n.target) for n in nodes})
        return nodes

    monkeypatch.setattr(GraphLowering, "find_nodes_prefer_channels_last", spy)

    def train(model):
        opt, gen, losses = torch.optim.SGD(model.parameters(), lr=0.05), torch.Generator().manual_seed(1), []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(2, CHANNELS, SIDE, SIDE, generator=gen).to(memory_format=torch.channels_last)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    def fresh():
        torch.manual_seed(0)
        return ConvAttentionConv().to(memory_format=torch.channels_last)

    eager = train(fresh())
    laid_out = {"force_layout_optimization": True}
    for options, attention_laid_out in ((laid_out, True),
                                        ({**laid_out, "post_grad_custom_post_pass": KeepAttentionLayout()}, False)):
        torch._dynamo.reset()
        preferred.clear()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            torch.testing.assert_close(train(torch.compile(fresh(), options=options)), eager, rtol=1e-4, atol=1e-5)
        forward = preferred[0]
        assert any("convolution" in t for t in forward)
        assert any("scaled_dot_product" in t for t in forward) is attention_laid_out
