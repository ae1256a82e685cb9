"""``benchmarks/results.jsonl``: one row per measured run, read from the result files
(``benchmarks/results_index.py``)."""

from __future__ import annotations

import json

from script_testing import load_script


def _index():
    return load_script("benchmarks/results_index.py")


def test_the_committed_index_is_what_the_result_files_give(capsys):
    assert _index().main(["--check"]) == 0, capsys.readouterr().err


def test_bench_rows_and_cap_runs_become_rows_and_the_rest_is_left_out(tmp_path):
    index = _index()
    bench = {"command": "gallery bench --models sd", "commit": "d8ff2a9c6a80194720e785e5cb9bc018f4c616ed",
             "source_sha256": "ab12", "date": "2026-11-29 23:27:44", "gpu": "NVIDIA H200", "torch": "2.11.0",
             "rows": [{"model": "sd15", "recipe": "peer", "batch_size": 32, "samples_per_s": 132.1,
                       "p20_step_ms": 241.0, "median_step_ms": 242.2, "p80_step_ms": 243.0, "peak_reserved_gib": 40.85},
                      {"model": "sd15", "recipe": "accelerated", "batch_size": 32, "error": "out of memory"}]}
    timm = {"device": "NVIDIA H200", "rows": [{"model": "vit_small_patch16_224", "variant": "accelerated",
                                              "batch_size": 128, "samples_per_s": 7998.7, "median_step_ms": 16.0}]}
    caps = {"command": "bash benchmarks/gpu_memory_caps.sh x 22 --model sd15 --steps 36", "commit": "8713c5a",
            "runs": {"peer": {"samples_per_s": 52.8, "median_step_time_ms": 151.4, "p20_step_time_ms": 133.1,
                              "p80_step_time_ms": 174.0, "peak_reserved_mb": 20774.0, "global_batch_size": 8},
                     "accelerated": {"losses": []}}}  # cut by the call's time: no speed
    (tmp_path / "a").mkdir()
    for name, record in (("a/bench.json", bench), ("b_timm.json", timm), ("c_caps.json", caps), ("d_list.json", [1])):
        (tmp_path / name).write_text(json.dumps(record))
    (tmp_path / "e_cut.json").write_text('{"rows": [')  # a truncated copy
    rows = index.index_rows(tmp_path)
    assert [(r["file"], r["model"], r["recipe"]) for r in rows] == [
        ("a/bench.json", "sd15", "peer"), ("b_timm.json", "vit_small_patch16_224", "accelerated"),
        ("c_caps.json", "sd15", "peer")]
    assert all(list(r) == list(index.FIELDS) for r in rows)
    assert rows[0] == {"file": "a/bench.json", "commit": "d8ff2a9", "source_sha256": "ab12",
                       "date": "2026-11-29 23:27:44", "gpu": "NVIDIA H200", "torch": "2.11.0", "model": "sd15",
                       "recipe": "peer", "batch_size": 32, "samples_per_s": 132.1, "step_ms_p20": 241.0,
                       "step_ms_p50": 242.2, "step_ms_p80": 243.0, "peak_reserved_gib": 40.85}
    assert rows[1]["gpu"] == "NVIDIA H200" and rows[1]["commit"] is None and rows[1]["step_ms_p20"] is None
    assert (rows[2]["batch_size"], rows[2]["step_ms_p50"], round(rows[2]["peak_reserved_gib"], 2)) == (8, 151.4, 20.29)
    assert index.render(rows).count("\n") == 3
