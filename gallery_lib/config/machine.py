"""The checks that depend on this machine: which device a run gets, how many processes it may start, and the
options that need a GPU or a package. The config itself is checked where it is declared (``sections/``,
``run_config.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from gallery_lib.config.gpu_check import check_gpu_usable
from gallery_lib.config.run_config import RunConfig
from gallery_lib.config.settings import ConfigError


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str, cuda_devices: int) -> str:
    """``cuda`` or ``cpu`` for a ``RunConfig.device`` value: ``auto`` takes the GPU when one is visible (and fails
    when ``nvidia-smi`` lists one that torch cannot use: ``gpu_check``)."""
    if requested == "auto" and not cuda_devices:
        check_gpu_usable()
    return requested if requested != "auto" else ("cuda" if cuda_devices else "cpu")


def _check_cudnn_fusion(cfg: RunConfig) -> None:
    """``conv_bn_relu`` on a GPU: cuDNN offers the fusion in float16 only, through its Python frontend."""
    import importlib.util

    if cfg.amp_level != "O1" or cfg.amp_dtype not in ("float16", "auto"):  # auto: float16 on a GPU with O1
        raise ConfigError("kernel_ops with conv_bn_relu runs cuDNN's fused convolutions, which cuDNN offers in float16 "
                          f"only (got amp_level={cfg.amp_level!r}, amp_dtype={cfg.amp_dtype!r}): set amp_level='O1' "
                          "and amp_dtype='float16' (a GradScaler comes with it), or drop conv_bn_relu.")
    if importlib.util.find_spec("cudnn") is None:
        raise ConfigError("kernel_ops with conv_bn_relu needs cuDNN's Python frontend: pip install --no-deps "
                          "nvidia-cudnn-frontend (ci/setup_env.sh does so on a GPU machine), or drop conv_bn_relu.")


def _check_pretrained(pretrained: str) -> None:
    """Weights that are neither here nor named as on the Hugging Face Hub (``owner/name``): a path mistyped is an
    error before the run starts, not a download that fails inside it."""
    if Path(pretrained).expanduser().exists():
        return
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", pretrained) or ".." in pretrained:
        raise ConfigError(f"pretrained={pretrained!r} is not a file or folder on this machine, nor a Hugging Face Hub "
                          "id ('owner/name'): check the path.")


def validate_for_machine(cfg: RunConfig, *, cuda_devices: int | None = None, cpu_count: int | None = None) -> str:
    """Checks the options that depend on this machine and returns the resolved device (``cuda``/``cpu``).

    Raises ``ConfigError`` naming the fix when a GPU-only option is asked for on a CPU machine, or
    when more processes are asked for than the machine has devices for.
    """
    if cfg.report_to == "tensorboard":
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard (or "
                              "pip install -e '.[tracking]'), or set report_to='none'.")
    if cfg.pretrained is not None:
        _check_pretrained(cfg.pretrained)
    if cuda_devices is None:
        cuda_devices = visible_cuda_devices()
    cpu_count = cpu_count or os.cpu_count() or 1
    device = resolve_device(cfg.device, cuda_devices)
    if device == "cuda":
        if cuda_devices == 0:
            raise ConfigError("device='cuda' was asked for but no CUDA GPU is visible: use device='auto' or 'cpu' "
                              "(or the smoke profile) on this machine.")
        if cfg.nproc_per_node > cuda_devices:
            raise ConfigError(f"nproc_per_node={cfg.nproc_per_node} but only {cuda_devices} GPU(s) are visible: "
                              f"use nproc_per_node <= {cuda_devices}.")
        if cfg.kernels and "conv_bn_relu" in cfg.kernel_op_names:
            _check_cudnn_fusion(cfg)
    else:
        if cfg.cuda_graphs:
            mode = repr(cfg.compile_mode) + ("" if cfg.compile_mode == cfg.resolved_compile_mode else
                                             f" ({cfg.resolved_compile_mode!r} at batch {cfg.batch_size})")
            raise ConfigError(f"compile_mode={mode} captures CUDA graphs and needs a GPU: use "
                              "compile_mode='default' on a CPU.")
        if cfg.nproc_per_node > cpu_count:
            raise ConfigError(f"nproc_per_node={cfg.nproc_per_node} but this machine has {cpu_count} CPU core(s): "
                              f"use nproc_per_node <= {cpu_count}.")
    return device
