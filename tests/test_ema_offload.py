"""An offloaded EMA streamed through the GPU in chunks: the same lerp on the same values as the main-stream update,
whatever the chunking, with two chunks on the GPU instead of a copy."""

import pytest
import torch
from torch import nn

from gallery_lib.accel.ema import ModelEma, ema_mode_on
from gallery_lib.accel.ema_offload import ChunkedOffload, chunk_groups
from gallery_lib.accel.kernels.ema_lerp import foreach_lerp_

CUDA = torch.cuda.is_available()


def _tensors(device="cpu"):
    """Odd sizes, two dtypes, an empty tensor, a channels_last conv weight and one larger than the chunks below."""
    torch.manual_seed(0)
    return [torch.randn(37, device=device), torch.randn(5, 3, device=device, dtype=torch.bfloat16),
            torch.randn(0, device=device), torch.randn(6, 4, 3, 3, device=device).to(memory_format=torch.channels_last),
            torch.randn(1031, device=device), torch.randn(300, device=device, dtype=torch.bfloat16),
            torch.randn(11, 13, device=device)]


def test_chunks_hold_one_dtype_each_and_at_most_the_chunk_unless_one_tensor_is_larger():
    tensors = _tensors()
    chunk = 1024  # bytes: 256 fp32 elements
    groups = chunk_groups(tensors, chunk)
    assert sorted(i for group in groups for i in group) == list(range(len(tensors)))
    for group in groups:
        assert group == sorted(group) and len({tensors[i].dtype for i in group}) == 1
        size = sum(tensors[i].numel() * tensors[i].element_size() for i in group)
        assert size <= chunk or len(group) == 1, group
    assert [4] in groups  # 1031 fp32 elements: larger than a chunk, a group of its own
    assert len(chunk_groups(tensors, 1 << 30)) == 2  # one group per dtype when everything fits


@pytest.mark.parametrize("chunk_bytes", [64, 1024, 1 << 20])
def test_chunked_updates_equal_the_foreach_update_exactly(chunk_bytes):
    host, reference = _tensors(), _tensors()
    offload = ChunkedOffload(host, torch.device("cpu"), chunk_bytes=chunk_bytes)
    assert host[3].is_contiguous(memory_format=torch.channels_last)  # laid out as it was, not copied
    buffers, buffer_copies = [torch.zeros(3)], [torch.arange(3.0)]
    for step, weight in enumerate((1.0, 0.3, 0.07, 0.5)):
        torch.manual_seed(step + 10)
        model = [torch.randn_like(t) for t in host]
        offload.update(model, weight, (buffers, buffer_copies))
        foreach_lerp_(reference, model, weight)
        for got, want in zip(host, reference):
            assert torch.equal(got, want)
    assert torch.equal(buffers[0], buffer_copies[0])
    largest_group = max(sum(host[i].numel() * host[i].element_size() for i in g) for g in offload.groups)
    assert offload.staging_bytes <= 2 * 2 * max(chunk_bytes, largest_group)  # two slots per dtype, two dtypes


def test_a_tensor_with_gaps_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"tensor 1 of the EMA has gaps .* pass dense tensors"):
        ChunkedOffload([torch.randn(4), torch.randn(4, 6)[:, ::2]], torch.device("cpu"))


def test_offloaded_fused_and_stream_run_as_stream_on_a_gpu_and_foreach_elsewhere():
    for asked in ("fused", "stream"):
        assert ema_mode_on(asked, "cuda", offloaded=True) == ("stream", None)  # no Triton needed: foreach lerps
        assert ema_mode_on(asked, "cpu", offloaded=True) == ("foreach", "the EMA lives on cpu")
    assert ema_mode_on("foreach", "cuda", offloaded=True) == ("foreach", None)  # diffusers' way, the peer's


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_a_streamed_offloaded_ema_averages_as_the_main_stream_one_holding_two_chunks():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(48)], nn.Conv2d(3, 8, 3)).cuda()  # 805 MB
    model[-1].to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    main_stream = ModelEma(model, decay=0.9, ratio_warmup=True, mode="foreach", offload=True)
    allocated = torch.cuda.memory_allocated()
    streamed = ModelEma(model, decay=0.9, ratio_warmup=True, mode="fused", offload=True)
    assert streamed.effective_mode == "stream" and streamed._offload is not None
    staged = torch.cuda.memory_allocated() - allocated  # the staging buffers (rounded up by the allocator) ...
    assert streamed._offload.staging_bytes <= staged <= streamed._offload.staging_bytes + (1 << 20)  # ... no copy
    streamed.attach_optimizer(opt)
    ema_bytes = sum(p.numel() * 4 for p in model.parameters())
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        model[:-1](torch.randn(64, 2048, device="cuda")).square().mean().backward()
        opt.step()  # waits, on the GPU, for the streamed update of the step before
        main_stream.update(model)
        if step == 0:  # the memory it takes; later steps run without a host sync, as training does
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        streamed.update(model)
        if step == 0:
            torch.cuda.synchronize()
            assert torch.cuda.max_memory_allocated() - before < ema_bytes // 8  # the main-stream one copies it all
    # no torch.cuda.synchronize() before reading: the reader waits for the last copy out
    want, got = main_stream.state_dict()["module"], streamed.state_dict()["module"]
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_a_streamed_update_copies_the_buffers_before_the_next_forward_can_write_them():
    """BatchNorm's running statistics change in the next forward, which the side streams run beside: ``update`` copies
    them at once, on the current stream, and leaves the side streams the frozen weights, which nothing writes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[2].requires_grad_(False)
    ema = ModelEma(model, decay=0.5, mode="foreach", offload=True)
    handed = []

    class SideStreams:  # what ChunkedOffload is handed, recorded when it is called
        done = None

        def update(self, model_avg, weight, copies):
            ema_bn = dict(ema._module.named_buffers())
            handed.append(({name: ema_bn[f"1.{name}"].clone() for name, _ in model[1].named_buffers()}, copies))

    ema.effective_mode, ema._offload, ema._optimizer_attached = "stream", SideStreams(), True
    model(torch.randn(8, 4))  # the running statistics move
    ema.update(model)
    (buffers_then, (to_ema, from_model)), = handed
    for name, tensor in model[1].named_buffers():
        assert torch.equal(buffers_then[name], tensor), name  # copied before the side streams were called
    assert [id(t) for t in from_model] == [id(model[2].weight), id(model[2].bias)]  # the frozen weights only
    assert [id(t) for t in to_ema] == [id(ema._module[2].weight), id(ema._module[2].bias)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [True, False])
def test_gpu_a_streamed_ema_keeps_the_statistics_of_its_step_while_the_next_forward_moves_them(offload):
    """The next forward runs at once after a streamed update, as in training; the EMA's BatchNorm statistics are the
    ones of the update's step, as the main-stream EMA's, while 400 MB of weights stream beside that forward."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)], nn.BatchNorm1d(2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    main_stream = ModelEma(model, decay=0.9, mode="foreach", offload=offload)
    streamed = ModelEma(model, decay=0.9, mode="stream", offload=offload)
    assert streamed.effective_mode == "stream"
    streamed.attach_optimizer(opt)
    x = torch.randn(256, 2048, device="cuda")
    loss = model(x).square().mean()
    for _ in range(4):
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        main_stream.update(model)
        streamed.update(model)
        loss = model(x * 1.5).square().mean()  # moves the running statistics beside the streamed update
    want, got = main_stream.state_dict()["module"], streamed.state_dict()["module"]
    for name in ("24.running_mean", "24.running_var", "24.num_batches_tracked"):
        assert torch.equal(got[name], want[name]), name
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-6), name
