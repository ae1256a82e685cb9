"""Install that fits the machine: the torch build chosen from the driver, a GPU torch cannot use is a loud error (never
a quiet CPU run), and on a CPU machine the CPU build is tried first with a quick fallback."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gallery_lib.config import gpu_check
from gallery_lib.config import ConfigError, RunConfig, validate_for_machine
from gallery_lib.recipes.profiles import resolve_profile

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("driver, tag", [("590.10", "cu130"), ("580.65.06", "cu130"), ("575.57.08", "cu128"),
                                         ("565.1", "cu126"), ("535.104.05", None)])
def test_cuda_tag_follows_the_driver(driver, tag):
    assert gpu_check.cuda_tag_for_driver(driver) == tag


@pytest.fixture
def gpu_torch_cannot_use(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

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


def test_a_driver_that_runs_this_torch_is_not_blamed_and_hidden_gpus_are_a_choice(gpu_torch_cannot_use, monkeypatch):
    """On an H100 host (driver 580, torch for CUDA 13.0) with ``CUDA_VISIBLE_DEVICES=`` the check said the driver does
    not run CUDA 13.0 and stopped the CPU tests."""
    gpu_torch_cannot_use("580.159.04")
    with pytest.raises(ConfigError, match=r"CUDA 13.0, which driver 580.159.04 runs, yet .*torch.cuda.init\(\)"):
        gpu_check.check_gpu_usable()
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        gpu_check.check_gpu_usable()
        assert resolve_profile("auto") == "smoke"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES='3' names no GPU that torch sees.*unset"):
        gpu_check.check_gpu_usable()


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


def _fake_machine(tmp_path: Path, *, driver: str | None, cpu_index_answers: bool,
                  installer: str = "uv") -> tuple[dict, Path]:
    """A venv whose python has no torch and logs its installs (``uv`` or ``pip`` as the installer, or
    ``uv-failing``: uv there, every install through it failing), and an nvidia-smi that reports ``driver``."""
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    fail_cpu = "true" if cpu_index_answers else 'case "$*" in *whl/cpu*) exit 1;; esac'
    fail_uv = 'case "$*" in "-m uv pip install"*) exit 1;; esac' if installer == "uv-failing" else "true"
    _script(venv / "bin" / "python", f"""#!/bin/bash
if [ "$1" = -c ]; then exit 1; fi          # no torch in this venv yet, and after 'installing' still no GPU
case "$*" in "-m pip install"*|"-m uv pip install"*)
  echo "UV_HTTP_TIMEOUT=${{UV_HTTP_TIMEOUT:-}} UV_COMPILE_BYTECODE=${{UV_COMPILE_BYTECODE:-}} $*" >> {log}
  {fail_cpu}; {fail_uv}; exit 0;; esac
exit 0
""")
    if driver:
        _script(bin_dir / "nvidia-smi", f"#!/bin/bash\necho 'NVIDIA L4, {driver}'\n")
    env = dict(os.environ, GALLERY_VENV=str(venv), PYTHON=sys.executable,
               PATH=f"{bin_dir}:{os.environ['PATH']}" if driver else "/usr/bin:/bin")
    for name in ("GALLERY_TORCH_SPEC", "GALLERY_TORCH_INDEX", "GALLERY_NO_UV", "UV_COMPILE_BYTECODE"):
        env.pop(name, None)
    if installer == "pip":
        env["GALLERY_NO_UV"] = "1"
    return env, log


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("installer", ["uv", "pip", "uv-failing"])
def test_setup_installs_the_cpu_build_first_and_falls_back_quickly(tmp_path, installer):
    env, log = _fake_machine(tmp_path, driver=None, cpu_index_answers=False, installer=installer)
    done = subprocess.run(["bash", str(REPO / "ci" / "setup_env.sh"), "notebooks"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    tool = "-m pip install --quiet" if installer == "pip" else "-m uv pip install --python"
    assert tool in calls[0] and "--index-url https://download.pytorch.org/whl/cpu torch==2.14.1" in calls[0]
    # a quick failure where the index does not answer: pip's flags, or uv's variables
    assert "--timeout 10 --retries 0" in calls[0] if installer == "pip" else calls[0].startswith("UV_HTTP_TIMEOUT=10 ")
    pypi = [call for call in calls[1:] if call.endswith(" torch==2.14.1 torchvision==0.29.1")]  # PyPI's build
    editable = [call for call in calls[1:] if " -e " in call]
    assert "CPU index did not answer" in done.stdout and "--index-url" not in " ".join(pypi + editable)
    # uv byte-compiles what it installs, as pip does: no process then compiles torch's sources again at its start
    assert all(" UV_COMPILE_BYTECODE=1 " in call for call in calls if tool in call), calls
    if installer == "uv-failing":  # each install tried with uv, then with pip
        assert [tool in call for call in pypi] == [True, False] and [tool in call for call in editable] == [True, False]
        assert "uv could not install" in done.stdout
    else:
        assert calls == calls[:1] + pypi + editable and all(tool in call for call in calls), calls


def test_setup_picks_the_drivers_cuda_and_fails_loudly_when_torch_cannot_see_the_gpu(tmp_path):
    env, log = _fake_machine(tmp_path, driver="575.57.08", cpu_index_answers=True)
    done = subprocess.run(["bash", str(REPO / "ci" / "setup_env.sh"), "notebooks"], env=env, capture_output=True,
                          text=True, timeout=120)
    calls = log.read_text().splitlines()
    # the torch every GPU number and GPU test ran on
    assert "--index-url https://download.pytorch.org/whl/cu128 torch==2.11.* torchvision==0.26.*" in calls[0]
    assert done.returncode == 1 and "cannot use the GPU that nvidia-smi lists" in done.stderr
    assert len(calls) == 1  # nothing else installed on top of a torch that cannot use the GPU
    log.write_text("")
    subprocess.run(["bash", str(REPO / "ci" / "setup_env.sh"), "notebooks"], env={**env, "GALLERY_TORCH_NEWEST": "1"},
                   capture_output=True, text=True, timeout=120)
    newest = log.read_text().splitlines()
    assert "--index-url https://download.pytorch.org/whl/cu128 torch>=2.11,<2.15 torchvision>=0.26,<0.30" in newest[0]


def test_setup_asks_for_the_torch_build_without_torch_and_without_warnings():
    """The exact command ``ci/setup_env.sh`` runs before torch is installed: one line naming the build, nothing on
    stderr (``python -m`` printed runpy's "found in sys.modules" warning on every fresh set-up)."""
    setup = (REPO / "ci" / "setup_env.sh").read_text()
    command = re.search(r'^wheel_index_cmd="(.+)"$', setup, re.M).group(1)
    no_torch = "import sys; sys.modules['torch'] = None; "  # an import of torch now fails, as before set-up
    done = subprocess.run([sys.executable, "-c", no_torch + command], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"(cpu|cu\d+)\n", done.stdout), done.stdout
    assert done.stderr == ""
