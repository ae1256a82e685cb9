"""CI's skip check (``skip_check.py``): a skip the list does not hold fails the run, a listed one passes."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

from skip_check import EXPECTED_SKIPS, SkipCheck, skip_key, unexpected


def report(reason: str, path: str = "tests/test_a.py", skipped: bool = True):
    return SimpleNamespace(skipped=skipped, longrepr=(path, 12, f"Skipped: {reason}"), nodeid=f"{path}::t")


def test_a_skip_is_keyed_by_its_file_and_reason():
    assert skip_key(report("needs a CUDA GPU")) == "test_a.py: needs a CUDA GPU"
    assert skip_key(report("x", skipped=False)) is None
    xfail = report("x")
    xfail.wasxfail = "known"
    assert skip_key(xfail) is None


def test_a_new_skip_fails_the_run_and_a_listed_one_passes(tmp_path):
    listed = tmp_path / "expected.json"
    listed.write_text(json.dumps({"test_a.py: needs a CUDA GPU": 2}))
    check = SkipCheck(listed)
    for _ in range(2):
        check.pytest_runtest_logreport(report("needs a CUDA GPU"))
    session = SimpleNamespace(exitstatus=0)
    check.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 0
    check.pytest_runtest_logreport(report("no module named tensorboard", "tests/test_b.py"))
    check.pytest_runtest_logreport(report("needs a CUDA GPU"))
    check.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 1
    assert unexpected(check.seen, check.expected) == {"test_a.py: needs a CUDA GPU": 1,
                                                       "test_b.py: no module named tensorboard": 1}
    assert unexpected(Counter({"test_a.py: needs a CUDA GPU": 1}), check.expected) == {}  # fewer: passes


def test_the_list_names_reasons():
    listed = json.loads(EXPECTED_SKIPS.read_text())
    assert listed and all(": " in key and count > 0 for key, count in listed.items())
