"""The your_model notebook's ladder: rows from the rungs' own step times and losses, the CPU caveat, the JSON."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from gallery_lib.reports.step_ladder import StepLadder

ROOT = Path(__file__).resolve().parents[1]


def _ladder(device: str) -> StepLadder:
    ladder = StepLadder(batch_size=8, warmup=2, device=device)
    ladder.add("plain", [3.0, 2.0, 1.0, 0.5], [900.0, 50.0, 40.0, 40.0])
    ladder.add("compiled", [3.0, 2.0, 1.01, 0.5], [5000.0, 30.0, 20.0, 20.0], changes=["compiled: 2 blocks"])
    return ladder


def test_rows_time_the_steps_after_warm_up_and_compare_each_rung():
    rows = _ladder("cuda").rows()
    assert rows[0]["median_step_time_ms"] == 40.0 and rows[0]["img_per_s"] == pytest.approx(200.0)
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[1]["gain"] == pytest.approx(2.0)
    assert rows[0]["gain"] is None and rows[1]["warmup_s"] == pytest.approx(5.03)
    assert rows[1]["loss_difference"] == pytest.approx(0.01) and rows[0]["loss_difference"] == 0
    assert rows[1]["changes"] == ["compiled: 2 blocks"]
    row = "| compiled | 20.0 [20.0-20.0] | 400.0 | 2.00x | 2.00x (plain) | 0.01 | 5.0 |"
    assert row in _ladder("cuda").to_markdown()


def test_a_rung_records_the_gpu_memory_it_held_and_a_cpu_rung_none(tmp_path, monkeypatch):
    """The rung's own peak reserved memory (reset at its start) goes into its row, the table and the saved JSON, and
    from there into a device script's record (``run_summaries``); a CPU ladder's rows have none and no column."""
    import importlib.util

    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("gallery_lib.reports.step_ladder.reset_peak_memory", lambda d: resets.append(d.type))
    monkeypatch.setattr("gallery_lib.reports.step_ladder.peak_reserved_mb", lambda device: 3.5 * 1024)
    monkeypatch.setattr("gallery_lib.reports.step_ladder.give_back_cached_gpu_memory", lambda: None)
    ladder = StepLadder(batch_size=8, warmup=1, device="cuda")
    with ladder.rung("plain", echo=None) as record:
        record([2.0, 1.0, 0.5], [900.0, 40.0, 40.0])
    assert resets == ["cuda"] and ladder.rows()[0]["peak_reserved_gib"] == 3.5
    assert ladder.to_markdown().splitlines()[0].endswith("| peak GiB reserved |")
    assert ladder.to_markdown().splitlines()[2].endswith("| 3.50 |")
    (tmp_path / "your_model").mkdir()
    ladder.save(tmp_path / "your_model" / "ladder.json")
    spec = importlib.util.spec_from_file_location("run_summaries", ROOT / "benchmarks" / "run_summaries.py")
    summaries = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summaries)
    assert summaries.step_ladder_entries(str(tmp_path))["your_model/plain"]["peak_reserved_mb"] == 3.5 * 1024
    cpu = _ladder("cpu")
    assert cpu.rows()[0]["peak_reserved_gib"] is None and "peak GiB" not in cpu.to_markdown()


def test_a_side_branch_gains_over_the_rung_it_builds_on_and_every_rung_is_set_against_the_peer():
    ladder = _ladder("cuda")
    ladder.add("peer", [3.0, 2.0, 1.0, 0.5], [900.0, 25.0, 25.0, 25.0], peer=True)
    ladder.add("fused", [3.0, 2.0, 1.0, 0.5], [900.0, 32.0, 32.0, 32.0], builds_on="plain")
    rows = {row["rung"]: row for row in ladder.rows()}
    assert rows["fused"]["gain"] == pytest.approx(40 / 32) and rows["fused"]["builds_on"] == "plain"
    assert rows["compiled"]["over_peer"] == pytest.approx(25 / 20) and rows["peer"]["over_peer"] == 1.0
    assert "| fused | 32.0 [32.0-32.0] | 250.0 | 1.25x | 1.25x (plain) | 0.78x |" in ladder.to_markdown()
    with pytest.raises(ValueError, match="builds_on='nope' names no rung"):
        ladder.add("x", [1.0] * 4, [1.0] * 4, builds_on="nope")


def test_a_cpu_ladder_shows_no_speedup_and_saves_every_step(tmp_path):
    ladder = _ladder("cpu")
    assert "n/a on CPU (smoke)" in ladder.to_markdown() and "2.00x" not in ladder.to_markdown()
    assert "Timings on a CPU are not speedups: run on a GPU for the comparison." in ladder.to_markdown()
    step_axis = ladder.figure().axes[0]  # on a CPU: each rung's step times, no bars and no ratio
    assert "Timings on a CPU are not speedups" in step_axis.get_title() and not step_axis.patches[1:]
    assert not step_axis.texts and step_axis.get_yscale() == "log"
    assert [list(line.get_ydata()) for line in step_axis.get_lines()] == [[900.0, 50.0, 40.0, 40.0],
                                                                          [5000.0, 30.0, 20.0, 20.0]]
    assert "data:image/png;base64," in ladder._repr_markdown_()
    ladder.save(tmp_path / "ladder.json", model="toy")
    record = json.loads((tmp_path / "ladder.json").read_text())
    assert record["model"] == "toy" and record["steps"][1]["times_ms"][0] == 5000.0 and len(record["rows"]) == 2
    assert record["commit"] == subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                              cwd=Path(__file__).parent).stdout.strip() and "dirty" in record


def test_too_few_steps_to_time_is_a_clear_error():
    with pytest.raises(ValueError, match="first 2 are warm-up: run more steps"):
        StepLadder(batch_size=1, warmup=2).add("short", [1.0, 1.0], [1.0, 1.0])


def test_a_rung_out_of_gpu_memory_is_one_line_and_the_next_rung_runs(tmp_path):
    """On a smaller GPU a rung (the peer's CUDA graphs, say) can run out of memory: it is recorded as stopped with one
    line that says what to try, the rungs after it (one building on it included) still run, and the table and the
    JSON say so; any other error is raised as it is."""
    said: list[str] = []
    ladder = StepLadder(batch_size=128, warmup=1, device="cuda")
    with ladder.rung("plain", echo=said.append) as record:
        record([2.0, 1.0, 0.5], [900.0, 40.0, 40.0])
    with ladder.rung("peer", peer=True, echo=said.append) as record:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "22.00 GiB of which 1.50 GiB is free. If reserved but unallocated memory ...")
    with ladder.rung("+ blocks", builds_on="peer", echo=said.append) as record:
        record([2.0, 1.0, 0.5], [900.0, 20.0, 20.0])
    assert said[0] == "  -> 40.0 ms/step" and said[2] == "  -> 20.0 ms/step"
    assert re.fullmatch(r"  -> out of memory at batch 128( with \d+\.\d GiB reserved)? \(Tried to allocate 2\.00 GiB\. "
                        r"GPU 0 has a total capacity of 22\.00 GiB of which 1\.50 GiB is free\): try batch_size=64 in "
                        r"the parameters cell, or a GPU with more free memory", said[1]), said[1]
    rows = ladder.rows()
    assert [row["rung"] for row in rows] == ["plain", "+ blocks"] and rows[1]["gain"] is None
    assert rows[1]["over_peer"] is None
    assert f"Stopped: peer, {said[1][5:]}." in ladder.to_markdown()
    ladder.save(tmp_path / "ladder.json")
    assert json.loads((tmp_path / "ladder.json").read_text())["stopped"] == {"peer": said[1][5:]}
    with pytest.raises(ValueError, match="a bug"), ladder.rung("broken", echo=None):
        raise ValueError("a bug")
    assert "broken" not in ladder.stopped


@pytest.mark.gpu
def test_gpu_a_rung_out_of_memory_gives_its_memory_to_the_next():
    """A real CUDA out-of-memory error inside a rung (10 TB asked for, after 2 GiB held by the rung): one line with
    PyTorch's account and the batch to try, and the next rung starts with the 2 GiB given back."""
    said: list[str] = []
    ladder = StepLadder(batch_size=128, warmup=1, device="cuda")

    def train():  # as the notebook's loop: the tensors it holds live in its frame
        held = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        return torch.empty(10**13, dtype=torch.uint8, device="cuda") + held[0]

    with ladder.rung("too big", echo=said.append):
        train()
    assert re.fullmatch(r"  -> out of memory at batch 128 with \d+\.\d GiB reserved \(Tried to allocate .*\): try "
                        r"batch_size=64 in the parameters cell, or a GPU with more free memory", said[0]), said[0]
    with ladder.rung("next", echo=said.append) as record:
        assert torch.cuda.memory_reserved() < 2**30
        record([1.0, 1.0], [1.0, 1.0])
