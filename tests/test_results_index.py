"""``benchmarks/results.jsonl``: one row per measured run, read from the result files
(``benchmarks/results_index.py``)."""

from __future__ import annotations

import json

from script_testing import load_script


def _index():
    return load_script("benchmarks/results_index.py")


def test_the_committed_index_is_what_the_result_files_give(capsys):
    assert _index().main(["--check"]) == 0, capsys.readouterr().err


def test_bench_rows_recipe_runs_rungs_and_cap_runs_become_rows_and_the_rest_is_left_out(tmp_path):
    index = _index()
    bench = {"command": "gallery bench --models sd", "commit": "d8ff2a9c6a80194720e785e5cb9bc018f4c616ed",
             "source_sha256": "ab12", "date": "2026-11-29 23:27:44", "gpu": "NVIDIA H200", "torch": "2.11.0",
             "rows": [{"model": "sd15", "recipe": "peer", "batch_size": 32, "processes": 1, "samples_per_s": 132.1,
                       "p20_step_ms": 241.0, "median_step_ms": 242.2, "p80_step_ms": 243.0, "peak_reserved_gib": 40.85,
                       "peak_mem_gib": 39.66, "peak_mem_kind": "cuda_max_allocated", "to_steady_s": 123.1,
                       "compile_caches": "cold"},
                      {"model": "sd15", "recipe": "accelerated", "batch_size": 32, "error": "out of memory"}]}
    timm = {"device": "NVIDIA H200", "rows": [{"model": "vit_small_patch16_224", "variant": "accelerated",
                                              "batch_size": 128, "samples_per_s": 7998.7, "median_step_ms": 16.0}]}
    caps = {"command": "bash benchmarks/gpu_memory_caps.sh x 22 --model sd15 --steps 36", "commit": "8713c5a",
            "runs": {"peer": {"samples_per_s": 52.8, "median_step_time_ms": 151.4, "p20_step_time_ms": 133.1,
                              "p80_step_time_ms": 174.0, "peak_reserved_mb": 20774.0, "global_batch_size": 8},
                     "accelerated": {"losses": []}}}  # cut by the call's time: no speed
    recipes = {"command": "python benchmarks/bench_recipes.py --model sd15", "gpu": "NVIDIA H200", "model": "sd15",
               "results": [{"recipe": "compiled", "samples_per_s": 116.0, "median_step_time_ms": 138.0,
                            "global_batch_size": 16, "world_size": 2, "peak_mem_mb": 21504.0}]}
    ladder = {"commit": "2c5160a4c3f32e2795ad35d78cf65ee328e3762f", "parts": [{"torch": "2.11.0"}],
              "rows": [{"rung": "ladder-00-tf32", "name": "tf32", "batch_size": 8, "img_per_s": 19.6,
                        "median_step_ms": 407.7, "peak_mem_gib": 77.3, "peak_reserved_gib": 83.3,
                        "device": "NVIDIA H200"},
                       {"rung": "ladder-01-amp", "name": "amp", "batch_size": 8, "img_per_s": None,
                        "failure": "out of memory"}]}
    kernels = {"results": [{"op": "geglu", "median_ms": 0.1}]}  # a kernel sweep: no run
    (tmp_path / "a").mkdir()
    for name, record in (("a/bench.json", bench), ("b_timm.json", timm), ("c_caps.json", caps), ("d_list.json", [1]),
                         ("f_recipes.json", recipes), ("g_ladder.json", ladder), ("h_kernels.json", kernels)):
        (tmp_path / name).write_text(json.dumps(record))
    (tmp_path / "e_cut.json").write_text('{"rows": [')  # a truncated copy
    rows = index.index_rows(tmp_path)
    assert [(r["file"], r["model"], r["recipe"]) for r in rows] == [
        ("a/bench.json", "sd15", "peer"), ("b_timm.json", "vit_small_patch16_224", "accelerated"),
        ("c_caps.json", "sd15", "peer"), ("f_recipes.json", "sd15", "compiled"), ("g_ladder.json", None, "tf32")]
    assert all(list(r) == list(index.FIELDS) for r in rows)
    assert rows[0] == {"file": "a/bench.json", "commit": "d8ff2a9", "source_sha256": "ab12",
                       "date": "2026-11-29 23:27:44", "gpu": "NVIDIA H200", "torch": "2.11.0", "model": "sd15",
                       "recipe": "peer", "batch_size": 32, "processes": 1, "samples_per_s": 132.1,
                       "step_ms_p20": 241.0, "step_ms_p50": 242.2, "step_ms_p80": 243.0, "peak_reserved_gib": 40.85,
                       "peak_allocated_gib": 39.66, "to_steady_s": 123.1, "compile_caches": "cold"}
    assert rows[1]["gpu"] == "NVIDIA H200" and rows[1]["commit"] is None and rows[1]["step_ms_p20"] is None
    assert (rows[2]["batch_size"], rows[2]["step_ms_p50"], round(rows[2]["peak_reserved_gib"], 2)) == (8, 151.4, 20.29)
    assert (rows[3]["batch_size"], rows[3]["processes"], rows[3]["peak_allocated_gib"]) == (8, 2, 21.0)
    assert (rows[4]["gpu"], rows[4]["torch"], rows[4]["step_ms_p50"], rows[4]["peak_reserved_gib"]) == (
        "NVIDIA H200", "2.11.0", 407.7, 83.3)
    assert index.render(rows).count("\n") == 5
