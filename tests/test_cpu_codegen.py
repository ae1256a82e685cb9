"""Inductor's CPU code computes what eager does on this machine's vector ISA: the bf16 tile transposes that GCC
miscompiles for AVX-512, and the gradients of the tiny SD UNet's kinds of block compiled (transformer, resnet,
upsample).

Marked ``isa``: ``ci/test.sh`` runs these again under ``ATEN_CPU_CAPABILITY=avx2`` where the CPU's default is
AVX-512, so that both code paths are checked on such a machine.
"""

from __future__ import annotations

import pytest
import torch

from gallery_lib.accel.compile.cpu_codegen import avx512_codegen, tiles_transpose_right, use_safe_cpu_codegen

pytestmark = pytest.mark.isa


def _sum_of_tiles(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a and b in channels-last, c and the output contiguous: Inductor transposes a and b tile by tile in one kernel.
    return (c.float() + a.float() * 2 + b.float()).to(torch.bfloat16)


def _inputs() -> tuple[torch.Tensor, ...]:
    c = torch.randn(2, 64, 8, 8, dtype=torch.bfloat16)
    a, b = (torch.randn(2, 64, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
            for _ in range(2))
    return c, a, b


def _compiled_is_right(**inductor) -> bool:
    torch._dynamo.reset()
    inputs = _inputs()
    with torch._inductor.config.patch(inductor):
        out = torch.compile(_sum_of_tiles, fullgraph=True, dynamic=False)(*inputs)
    torch._dynamo.reset()  # the code compiled under the patch must not serve later calls
    return torch.equal(out, _sum_of_tiles(*inputs))


def test_the_transpose_check_agrees_with_what_inductor_compiles_and_the_workaround_computes_what_eager_does():
    """The four-line function behind the SD gradients' NaN: the check predicts whether Inductor's own AVX-512 code
    for it is right, and with ``use_safe_cpu_codegen`` applied it is right on every ISA."""
    with torch._inductor.config.patch({"cpp.simdlen": None}):  # as before any workaround of this session
        if avx512_codegen():
            assert tiles_transpose_right() == _compiled_is_right()
    named = torch._inductor.config.cpp.simdlen == 256  # by ci/test.sh's AVX2 pass (tests/conftest.py), or earlier
    note = use_safe_cpu_codegen()
    assert (note is not None or named) == (torch._inductor.config.cpp.simdlen == 256)
    assert _compiled_is_right()


@pytest.mark.slow  # over 20 s on 2 cores: left out of the fast tier
def test_a_compiled_transformer_block_trains_as_eager_in_bf16():
    """The 64-channel transformer block of the tiny SD UNet (group norm, 1x1 convolutions, self- and
    cross-attention, GEGLU) compiled in place under bf16 autocast: its output and every gradient match eager's."""
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    from gallery_lib.accel.compile.regional import regional_compile, undo_regional_compile

    torch.manual_seed(0)
    holder = torch.nn.Sequential(Transformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=64,
                                                    norm_num_groups=8, cross_attention_dim=32))
    block = holder[0]
    x = torch.randn(4, 64, 8, 8, dtype=torch.bfloat16)
    context = torch.randn(4, 77, 32, dtype=torch.bfloat16)

    def step(bf16: bool = True) -> list[torch.Tensor]:
        block.zero_grad(set_to_none=True)
        inp = (x if bf16 else x.float()).clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = block(inp, encoder_hidden_states=context if bf16 else context.float(), return_dict=False)[0]
        out.float().square().mean().backward()
        return [t.detach().float() for t in (out, inp.grad, *(p.grad for p in block.parameters()))]

    fp32, eager = step(bf16=False), step()
    names = regional_compile(holder, (Transformer2DModel,), dynamic=False)
    try:
        compiled = step()
    finally:
        undo_regional_compile(holder, names)
        torch._dynamo.reset()
    assert len(compiled) == len(eager) == 2 + len(list(block.parameters()))
    for i, (got, want, exact) in enumerate(zip(compiled, eager, fp32)):
        assert torch.isfinite(got).all(), i
        # The project's bf16 rule: the compiled block's error against fp32 at most twice eager bf16's.
        assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 1e-6, i


class _ResnetUp(torch.nn.Module):
    """The tiny SD UNet's other kinds of block in a row: a resnet block (group norm, SiLU, 3x3 convolutions, the time
    embedding added, a 1x1 shortcut) and a nearest-neighbour upsample with its convolution (a downsample is one more
    strided convolution)."""

    def __init__(self):
        super().__init__()
        from diffusers.models.resnet import ResnetBlock2D, Upsample2D

        self.resnet = ResnetBlock2D(in_channels=32, out_channels=64, temb_channels=64, groups=8)
        self.up = Upsample2D(64, use_conv=True)

    def forward(self, x, temb):
        return self.up(self.resnet(x, temb))


@pytest.mark.slow  # a compile per block kind and precision: left out of the fast tier
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_the_unets_resnet_and_upsample_blocks_compiled_train_as_eager(bf16):
    """The resnet and upsample blocks of the tiny SD UNet, each compiled in place: output and every
    gradient as eager's, in bf16 autocast (error against fp32 at most twice eager bf16's) and in fp32 (to reordered
    sums). With the transformer block above, the kinds of code SD's compiled UNet runs, on this machine's vector ISA."""
    pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D, Upsample2D

    from gallery_lib.accel.compile.regional import regional_compile, undo_regional_compile

    torch.manual_seed(0)
    model = _ResnetUp()
    x, temb = torch.randn(4, 32, 12, 12), torch.randn(4, 64)

    def step(autocast: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(inp, temb)
        out.float().square().mean().backward()
        return [t.detach().float() for t in (out, inp.grad, *(p.grad for p in model.parameters()))]

    exact, eager = step(autocast=False), step(autocast=bf16)
    names = regional_compile(model, (ResnetBlock2D, Upsample2D), dynamic=False)
    try:
        compiled = step(autocast=bf16)
    finally:
        undo_regional_compile(model, names)
        torch._dynamo.reset()
    assert len(names) == 2 and len(compiled) == 2 + len(list(model.parameters()))
    for i, (got, want, reference) in enumerate(zip(compiled, eager, exact)):
        assert torch.isfinite(got).all(), i
        if bf16:
            assert (got - reference).abs().max() <= 2 * (want - reference).abs().max() + 1e-6, i
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"tensor {i}: {m}")
