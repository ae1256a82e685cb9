"""The test run's own plumbing (tests/conftest.py, ci/test.sh): what keeps CI inside its time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.mark.slow  # over 20 s on 2 cores: left out of the fast tier
def test_an_xdist_group_runs_in_one_worker_longest_first_and_its_time_is_recorded(tmp_path):
    """Tests that share a compile must land in one worker, one after the other (``--dist loadgroup``; pytest 9.2 made
    pytest-xdist drop the groups silently), ordered by tests/durations.json, with their seconds recorded under
    their plain ids."""
    for helper in (CONFTEST, CONFTEST.with_name("compile_testing.py")):
        (tmp_path / helper.name).write_text(helper.read_text())
    (tmp_path / "durations.json").write_text(json.dumps({"test_g.py::test_short": 1.0, "test_g.py::test_long": 9.0}))
    (tmp_path / "test_g.py").write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.xdist_group('shared')\ndef test_short():\n    pass\n\n"
        "@pytest.mark.xdist_group('shared')\ndef test_long():\n    pass\n"
        + "".join(f"\ndef test_alone_{i}():\n    time.sleep(0.2)\n" for i in range(6)))
    record = tmp_path / "seconds.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
                           "-p", "no:cacheprovider", "-v", f"--record-durations={record}", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
    assert done.returncode == 0, done.stdout[-3000:]
    grouped = [line for line in done.stdout.splitlines()  # "[gw0] [ 12%] PASSED test_g.py::test_long@shared"
               if line.startswith("[gw") and "PASSED test_g.py::test_" in line and "@shared" in line]
    workers = {line.split("]")[0] for line in grouped}
    assert len(grouped) == 2 and len(workers) == 1, done.stdout[-3000:]  # both tagged, both in one worker
    order = [line.split("::")[1].split("@")[0] for line in grouped]
    assert order == ["test_long", "test_short"]  # the longest of the group first
    recorded = json.loads(record.read_text())
    assert {"test_g.py::test_long", "test_g.py::test_short"} <= set(recorded), recorded


def test_the_isa_pass_runs_longest_first_by_its_own_durations(tmp_path):
    """The AVX2 pass compiles its tests again, so they take other times than in the first pass: it orders them by
    tests/durations.isa.json, the first pass by tests/durations.json."""
    for helper in (CONFTEST, CONFTEST.with_name("compile_testing.py")):
        (tmp_path / helper.name).write_text(helper.read_text())
    (tmp_path / "durations.json").write_text(json.dumps({"test_i.py::test_a": 9.0, "test_i.py::test_b": 1.0}))
    (tmp_path / "durations.isa.json").write_text(json.dumps({"test_i.py::test_a": 1.0, "test_i.py::test_b": 9.0}))
    (tmp_path / "test_i.py").write_text("import pytest\n\n@pytest.mark.isa\ndef test_a():\n    pass\n\n"
                                        "@pytest.mark.isa\ndef test_b():\n    pass\n")

    def order(*flags):
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *flags, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
        assert done.returncode == 0, done.stdout[-3000:]
        return [line.split("::")[1] for line in done.stdout.splitlines() if line.startswith("test_i.py::")]
    assert order() == ["test_a", "test_b"]
    assert order("--isa-only") == ["test_b", "test_a"]
