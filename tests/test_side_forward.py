"""side_forward(): a look at the model that leaves RNG, compile stance and cuDNN settings as they were."""

import torch

from gallery_lib.accel.side_forward import side_forward


def test_side_forward_runs_eager_without_autotuning_and_restores_everything():
    compiled = torch.compile(lambda x: x * 2, backend=lambda gm, _: (_ for _ in ()).throw(AssertionError("compiled")))
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        torch.manual_seed(3)
        rng = torch.get_rng_state()
        with side_forward():
            assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.enabled
            torch.rand(5)
            assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))  # eager: the backend never runs
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = old
