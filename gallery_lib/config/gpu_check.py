"""A GPU that this torch cannot use is an error, never a quiet CPU run.

``profile='auto'`` and ``device='auto'`` pick the CPU when ``torch.cuda.is_available()`` is False. On a cloud GPU
machine that happens when pip installed a torch built for a newer CUDA than the driver supports, or a CPU-only
torch: the gallery would then run its CPU smoke profile on an H100 and say nothing. ``check_gpu_usable`` asks
``nvidia-smi`` whether a GPU is there and, if torch cannot see it, fails with the driver, the torch build and the fix.
``CUDA_VISIBLE_DEVICES=`` (empty, or ``-1``) hides every GPU on purpose: then the CPU is what was asked for.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

from gallery_lib.config.settings import ConfigError

# The newest CUDA each driver runs (NVIDIA's compatibility table), newest first: (minimum driver, cuda tag).
DRIVER_CUDA = ((580, "cu130"), (570, "cu128"), (560, "cu126"))


@functools.lru_cache(maxsize=1)
def nvidia_gpus() -> tuple[tuple[str, str], ...]:
    """``(name, driver version)`` of each GPU ``nvidia-smi`` lists; empty without it or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(tuple(part.strip() for part in line.split(",", 1)) for line in out.splitlines() if "," in line)


def cuda_tag_for_driver(driver: str) -> str | None:
    """The PyTorch wheel index tag (``cu128``) for a driver version (``575.57.08``); ``None`` when too old."""
    major = int(driver.split(".")[0])
    return next((tag for minimum, tag in DRIVER_CUDA if major >= minimum), None)


def check_gpu_usable() -> None:
    """Raises ``ConfigError`` when ``nvidia-smi`` lists a GPU that torch cannot use."""
    import torch

    if torch.cuda.is_available():
        return
    gpus = nvidia_gpus()
    if not gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return  # every GPU hidden on purpose (the CPU tests on a GPU machine do)
    name, driver = gpus[0]
    built = torch.version.cuda
    tag = cuda_tag_for_driver(driver)
    if visible is not None:
        what = f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU that torch sees"
        fix = "unset CUDA_VISIBLE_DEVICES, or set it to an index nvidia-smi lists (0 for the first GPU)"
    elif built is not None and tag is not None and _cuda_number(built) <= int(tag[2:]):
        what = (f"this torch ({torch.__version__}) is built for CUDA {built}, which driver {driver} runs, yet "
                "torch.cuda.is_available() is False")
        fix = "read CUDA's own error: python -c 'import torch; torch.cuda.init()'"
    else:
        what = (f"this torch ({torch.__version__}) is a CPU-only build" if built is None else
                f"this torch ({torch.__version__}) is built for CUDA {built}, which driver {driver} does not run")
        fix = (f"reinstall torch for CUDA that this driver runs: GALLERY_TORCH_INDEX={tag} bash ci/setup_env.sh "
               f"(after removing .venv), or pip install 'torch>=2.11,<2.15' --index-url "
               f"https://download.pytorch.org/whl/{tag}" if tag else
               f"update the NVIDIA driver to {DRIVER_CUDA[-1][0]} or newer (torch 2.11+ needs CUDA 12.6 or newer)")
    raise ConfigError(f"nvidia-smi lists a GPU ({name}, driver {driver}) but torch cannot use it: {what}. "
                      f"The gallery will not fall back to a CPU run on a GPU machine. Fix: {fix}. To run on the "
                      "CPU anyway, pass profile='smoke' and device='cpu'.")


def _cuda_number(version: str) -> int:
    """``13.0`` as the wheel tags count it: 130."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major) * 10 + int(minor)


def wheel_index() -> str:
    """The PyTorch wheel index tag this machine wants: ``cpu`` without a GPU, else the driver's CUDA tag."""
    gpus = nvidia_gpus()
    if not gpus:
        return "cpu"
    tag = cuda_tag_for_driver(gpus[0][1])
    if tag is None:
        raise ConfigError(f"the NVIDIA driver {gpus[0][1]} ({gpus[0][0]}) is too old for torch 2.11+: update it to "
                          f"{DRIVER_CUDA[-1][0]} or newer, or set GALLERY_TORCH_SPEC to a torch build it runs.")
    return tag


def main() -> int:
    """``ci/setup_env.sh``: prints which torch build to install (before torch is installed); 2 on a driver too old.

    Set-up calls it through ``python -c`` rather than ``-m``: the package imports this module first, and ``-m`` would
    then print runpy's warning about a module found in ``sys.modules`` on every fresh set-up."""
    try:
        print(wheel_index())
    except ConfigError as exc:
        print(f"[setup] {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
