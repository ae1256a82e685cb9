"""CI's check of the skipped tests: every skip of a CPU run must be one that ``tests/expected_skips.json`` lists (by
test file and reason, with how many), so that a test that starts skipping on the CPU (a missing package, a wrong
marker) fails CI until it is listed with its reason. Fewer skips than listed pass, and are said, so that the list is
trimmed. Registered by ``conftest.py`` in CI (``CI=true``) on a machine without a GPU; the skips and their reasons
are printed by pytest's ``-ra`` in every run.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

EXPECTED_SKIPS = Path(__file__).with_name("expected_skips.json")


def skip_key(report) -> str | None:
    """``test_file.py: reason`` of a skipped test's report, ``None`` for any other report."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    if isinstance(report.longrepr, tuple):
        path, _, reason = report.longrepr
    else:
        path, reason = report.nodeid.split("::")[0], str(report.longrepr)
    return f"{Path(path).name}: {reason.removeprefix('Skipped: ')}"


def unexpected(seen: Counter, expected: dict[str, int]) -> dict[str, int]:
    """The skips beyond those listed: key -> how many more than listed."""
    return {key: count - expected.get(key, 0) for key, count in sorted(seen.items()) if count > expected.get(key, 0)}


class SkipCheck:
    """Counts the run's skips; at the end fails the run on skips the list does not hold."""

    def __init__(self, expected_path: Path = EXPECTED_SKIPS) -> None:
        self.expected = json.loads(expected_path.read_text())
        self.seen: Counter = Counter()

    def pytest_runtest_logreport(self, report) -> None:
        key = skip_key(report)
        if key is not None:
            self.seen[key] += 1

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if unexpected(self.seen, self.expected) and exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        extra = unexpected(self.seen, self.expected)
        for key, count in extra.items():
            terminalreporter.write_line(f"[skips] unexpected: {count} more than {EXPECTED_SKIPS.name} lists of "
                                        f"{key!r}: make the test run here, or list it with its reason", red=True)
        if extra or not self.seen:  # a run without skips (a child run of one test, say) says nothing
            return
        fewer = sum(max(0, n - self.seen.get(key, 0)) for key, n in self.expected.items())
        terminalreporter.write_line(f"[skips] all {sum(self.seen.values())} skips are listed in {EXPECTED_SKIPS.name}"
                                    + (f"; {fewer} listed did not happen (a narrower selection, or a test that runs "
                                       "now)" if fewer else ""))
