"""side_forward(): a look at the model that leaves RNG, its buffers, compile stance and cuDNN settings as they were."""

import torch

from gallery_lib.accel.side_forward import side_forward


def test_side_forward_runs_eager_without_autotuning_and_restores_everything():
    compiled = torch.compile(lambda x: x * 2, backend=lambda gm, _: (_ for _ in ()).throw(AssertionError("compiled")))
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).train()
        stats = [buffer.clone() for buffer in model.buffers()]
        torch.manual_seed(3)
        rng = torch.get_rng_state()
        with side_forward(model):
            assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.enabled
            torch.rand(5)
            assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))  # eager: the backend never runs
            model(torch.randn(6, 3))
            assert not torch.equal(model[1].running_mean, stats[0])  # the forward moved them ...
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(buffer, saved) for buffer, saved in zip(model.buffers(), stats))  # ... and they are back
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = old
