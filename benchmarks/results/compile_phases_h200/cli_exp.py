"""Experiment (benchmarks/RESULTS.md#sd15-compile-time): the `gallery` CLI, with cuDNN autotuning off when EXP_NO_CUDNN_BENCH=1.
It never took effect: `gallery bench` trains in a child process, which this patch does not reach (no "[exp]" line in
any log)."""
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
from gallery_lib.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
