"""Experiment (benchmarks/RESULTS.md#sd15-compile-time): the `gallery` CLI, with cuDNN autotuning off when EXP_NO_CUDNN_BENCH=1,
and without running the blocks uncompiled while the workers compile when EXP_NO_WARM_KERNELS=1."""
import functools
import os
import sys

import torch

import gallery_lib.run.train as train

_configure = train.configure_backends


def configure(cfg):
    _configure(cfg)
    if os.environ.get("EXP_NO_CUDNN_BENCH") == "1":
        torch.backends.cudnn.benchmark = False
        print("[exp] cudnn.benchmark off", flush=True)


train.configure_backends = configure
if os.environ.get("EXP_NO_WARM_KERNELS") == "1":
    import gallery_lib.accel.precompile as precompile

    precompile.precompile_blocks = functools.partial(precompile.precompile_blocks, warm_kernels=False)
    print("[exp] warm_kernels off", flush=True)
from gallery_lib.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
