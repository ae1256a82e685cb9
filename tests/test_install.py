"""Install that fits the machine: the torch build chosen from the driver, a GPU torch cannot use is a loud error (never
a quiet CPU run), and on a CPU machine the CPU build is tried first with a quick fallback."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gallery_lib import gpu_check
from gallery_lib.config import ConfigError, RunConfig, validate_for_machine
from gallery_lib.profiles import resolve_profile

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("driver, tag", [("590.10", "cu130"), ("580.65.06", "cu130"), ("575.57.08", "cu128"),
                                         ("565.1", "cu126"), ("535.104.05", None)])
def test_cuda_tag_follows_the_driver(driver, tag):
    assert gpu_check.cuda_tag_for_driver(driver) == tag


@pytest.fixture
def gpu_torch_cannot_use(monkeypatch):
    def machine(driver: str, torch_cuda: str | None = "13.0"):
        monkeypatch.setattr(gpu_check, "nvidia_gpus", lambda: (("NVIDIA A10G", driver),))
        monkeypatch.setattr("torch.cuda.is_available", lambda: False)
        monkeypatch.setattr("torch.version.cuda", torch_cuda)
    return machine


def test_a_gpu_torch_cannot_use_stops_auto_instead_of_a_quiet_cpu_run(gpu_torch_cannot_use):
    gpu_torch_cannot_use("550.54.15")
    with pytest.raises(ConfigError, match=r"lists a GPU \(NVIDIA A10G, driver 550.54.15\).*built for CUDA 13.0.*"
                                          r"update the NVIDIA driver to 560 or newer"):
        resolve_profile("auto")
    gpu_torch_cannot_use("575.57.08")
    with pytest.raises(ConfigError, match="GALLERY_TORCH_INDEX=cu128 bash ci/setup_env.sh"):
        validate_for_machine(RunConfig(model="swin_micro", batch_size=8, steps=4, warmup_steps=1))
    gpu_torch_cannot_use("575.57.08", torch_cuda=None)
    with pytest.raises(ConfigError, match="is a CPU-only build"):
        resolve_profile("auto")
    assert resolve_profile("smoke") == "smoke"  # asking for the CPU explicitly still works
    assert validate_for_machine(RunConfig(model="swin_micro", batch_size=8, steps=4, warmup_steps=1,
                                          device="cpu")) == "cpu"


def test_no_gpu_is_no_error_and_asks_for_the_cpu_build(monkeypatch):
    monkeypatch.setattr(gpu_check, "nvidia_gpus", lambda: ())
    gpu_check.check_gpu_usable()
    assert gpu_check.wheel_index() == "cpu"
    monkeypatch.setattr(gpu_check, "nvidia_gpus", lambda: (("Tesla T4", "470.1"),))
    with pytest.raises(ConfigError, match="driver 470.1 .* too old"):
        gpu_check.wheel_index()


def test_pyproject_pins_the_tested_range_that_setup_installs():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "torch>=2.11,<2.15" in deps["dependencies"] and "torchvision>=0.26,<0.30" in deps["dependencies"]
    assert 'tested_range="torch>=2.11,<2.15 torchvision>=0.26,<0.30"' in (REPO / "ci" / "setup_env.sh").read_text()
    assert any(dep.startswith("jupyterlab") for dep in deps["optional-dependencies"]["lab"])
    assert all("," in dep for dep in deps["optional-dependencies"]["sd"] if dep.startswith(("diffusers", "transf")))


def _fake_machine(tmp_path: Path, *, driver: str | None, cpu_index_answers: bool) -> tuple[dict, Path]:
    """A venv whose python has no torch and logs pip calls, and an nvidia-smi that reports ``driver``."""
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    fail_cpu = "true" if cpu_index_answers else 'case "$*" in *whl/cpu*) exit 1;; esac'
    _script(venv / "bin" / "python", f"""#!/bin/bash
if [ "$1" = -c ]; then exit 1; fi          # no torch in this venv yet, and after 'installing' still no GPU
if [ "$1 $2 $3" = "-m pip install" ]; then echo "$*" >> {log}; {fail_cpu}; exit 0; fi
exit 0
""")
    if driver:
        _script(bin_dir / "nvidia-smi", f"#!/bin/bash\necho 'NVIDIA L4, {driver}'\n")
    env = dict(os.environ, GALLERY_VENV=str(venv), PYTHON=sys.executable,
               PATH=f"{bin_dir}:{os.environ['PATH']}" if driver else "/usr/bin:/bin")
    env.pop("GALLERY_TORCH_SPEC", None)
    env.pop("GALLERY_TORCH_INDEX", None)
    return env, log


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_setup_installs_the_cpu_build_first_and_falls_back_quickly(tmp_path):
    env, log = _fake_machine(tmp_path, driver=None, cpu_index_answers=False)
    done = subprocess.run(["bash", str(REPO / "ci" / "setup_env.sh"), "notebooks"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert "--retries 0 --index-url https://download.pytorch.org/whl/cpu torch==2.14.1" in calls[0]
    assert calls[1].endswith("install --quiet torch==2.14.1 torchvision==0.29.1")  # PyPI's build, same pin
    assert "CPU index did not answer" in done.stdout and "-e" in calls[2]


def test_setup_picks_the_drivers_cuda_and_fails_loudly_when_torch_cannot_see_the_gpu(tmp_path):
    env, log = _fake_machine(tmp_path, driver="575.57.08", cpu_index_answers=True)
    done = subprocess.run(["bash", str(REPO / "ci" / "setup_env.sh"), "notebooks"], env=env, capture_output=True,
                          text=True, timeout=120)
    calls = log.read_text().splitlines()
    assert "--index-url https://download.pytorch.org/whl/cu128 torch>=2.11,<2.15 torchvision>=0.26,<0.30" in calls[0]
    assert done.returncode == 1 and "cannot use the GPU that nvidia-smi lists" in done.stderr
    assert len(calls) == 1  # nothing else installed on top of a torch that cannot use the GPU
