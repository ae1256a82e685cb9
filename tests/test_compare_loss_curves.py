"""benchmarks/compare_loss_curves.py: pairwise step-by-step comparison of runs' losses, read from metrics.jsonl."""

import json
import math
from pathlib import Path

import pytest

from gallery_lib.run.metrics import MetricsWriter
from script_testing import load_script

compare_loss_curves = load_script("benchmarks/compare_loss_curves.py")


def write_run(path: Path, losses: list[float]) -> Path:
    writer = MetricsWriter(path, mode="w")
    for step, loss in enumerate(losses):
        writer.write({"type": "step", "step": step, "loss": loss})
    writer.write({"type": "summary", "final_loss": losses[-1]})
    writer.close()
    return path


def test_compare_finds_where_curves_part():
    a = [1.0] * 12 + [0.5] * 10
    b = [1.0] * 5 + [1.005] + [1.0] * 6 + [0.6] * 10  # 0.5% at step 5, 20% from step 12
    result = compare_loss_curves.compare(a, b, early=10)
    assert result["steps"] == 22 and result["first_step_over_1pct"] == 12
    assert result["max_rel_diff_early"] == pytest.approx(0.005)
    assert result["mean_rel_diff_after"] == pytest.approx((2 * 0 + 10 * 0.2) / 12)
    assert result["mean_loss_last_10"] == pytest.approx([0.5, 0.6])


def test_a_non_finite_loss_never_passes():
    result = compare_loss_curves.compare([1.0] * 12, [1.0, math.nan] + [1.0] * 10, early=10)
    assert result["first_step_over_1pct"] == 1 and result["max_rel_diff_early"] == math.inf


def test_too_short_runs_are_an_error():
    with pytest.raises(ValueError, match="share 5 steps"):
        compare_loss_curves.compare([1.0] * 5, [1.0] * 8, early=10)


def test_cli_reads_metrics_files_and_writes_pairs(tmp_path, capsys):
    runs = [f"{name}={write_run(tmp_path / f'{name}.jsonl', [1.0 + i * d for i in range(15)])}"
            for name, d in (("a", 0.0), ("b", 0.0005), ("c", 0.1))]
    assert compare_loss_curves.main([*runs, "--out", str(tmp_path / "pairs.json")]) == 0
    pairs = json.loads((tmp_path / "pairs.json").read_text())["pairs"]
    assert [(p["a"], p["b"]) for p in pairs] == [("a", "b"), ("a", "c"), ("b", "c")]
    assert pairs[0]["first_step_over_1pct"] is None and pairs[1]["first_step_over_1pct"] == 1
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and "first >1% at step None" in printed[0] and "first >1% at step 1" in printed[1]
    with pytest.raises(SystemExit):
        compare_loss_curves.main(["only_one=x.jsonl"])
