"""Checks committed result files against the code they name: each file whose header holds ``source_sha256`` is
verified against its ``commit`` (``gallery_lib.reports.provenance.verify_source``). Exit 1 on a mismatch.

    python benchmarks/verify_sources.py [RESULT.json ...]     (default: every JSON under benchmarks/results/)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gallery_lib.reports.provenance import verify_source  # noqa: E402


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or sorted((ROOT / "benchmarks" / "results").rglob("*.json"))
    counts: Counter = Counter()
    for path in files:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or "commit" not in record:
            continue
        status = verify_source(record, ROOT)
        counts[status] += 1
        if status in ("verified", "mismatch"):
            print(f"{status}: {path.relative_to(ROOT) if path.is_absolute() else path} ({record['commit'][:8]})")
    print(", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no result files with a commit")
    return 1 if counts["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
