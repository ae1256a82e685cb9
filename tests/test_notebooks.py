"""Every gallery notebook: well-formed in git, and executed end to end with papermill in the smoke profile."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import nbformat
import pytest
from script_testing import load_script

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
LADDER = REPO / "notebooks" / "optimization_ladder.ipynb"
YOUR_MODEL = REPO / "notebooks" / "your_model.ipynb"
RECIPE_NOTEBOOKS = [path for path in NOTEBOOKS if path not in (LADDER, YOUR_MODEL)]  # one per family: its recipes


def _runner():
    return load_script("ci/run_notebooks.py")


AOT_EAGER_SITE = Path(__file__).parent / "aot_eager_site"


def compiled_without_codegen(monkeypatch) -> None:
    """The notebook's kernel and every process it starts run ``torch.compile`` as ``aot_eager``
    (``tests/aot_eager_site``): a notebook test checks what the notebook shows and wires, and Inductor's C++ kernels
    cost minutes of CI's 2 cores there (the tiny UNet's, 400-460 s in whichever notebook compiled them first:
    RESULTS.md#ci). Inductor's code on the same models is checked in-process (the Swin and UNet blocks, SD's and
    DreamBooth's recipes against the baseline, ResNet's conv-bn folding), and through processes by the precompile
    tests (SD's UNet compiled by workers, then loaded by a second run)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(AOT_EAGER_SITE), os.environ.get("PYTHONPATH")])))


INJECTED = _runner().INJECTED  # what ci/run_notebooks.py passes (those declared)


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


def test_the_lanes_order_names_every_notebook_and_the_sd_unets_come_after_the_ladder():
    """ci/run_notebooks.py's lanes take the ladder first and the SD and DreamBooth notebooks last, so that these load
    the UNet graphs the ladder's rungs compiled; a notebook missing from the order would only run last."""
    order = _runner().LANE_ORDER
    assert sorted(order) == [path.stem for path in NOTEBOOKS]
    assert order[0] == LADDER.stem and set(order[-2:]) == set(_SHARES_GRAPHS_WITH) - {LADDER.stem}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean_with_one_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs before committing"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    import papermill

    declared = papermill.inspect_notebook(str(path))  # what `papermill --help-notebook` lists
    assert len(declared) == len(params[0].source.splitlines()), "every line of the parameters cell is a parameter"
    assert set(INJECTED[:2]) <= set(declared)
    if path in RECIPE_NOTEBOOKS or path == LADDER:
        assert set(INJECTED) <= set(declared)
    untyped = [name for name, p in declared.items() if p["inferred_type_name"] in ("None", None)]
    assert not untyped, f"annotate the parameters (name: type = value  # help): {untyped}"
    assert nb.metadata.kernelspec.name == "python3"
    assert len(code) <= 12, "notebooks stay thin: the work belongs in gallery_lib"


# The SD UNet's notebooks (SD, DreamBooth and the ladder) compile the same block graphs: the gallery's lanes run the
# ladder first, so that the other two load them.
_SHARES_GRAPHS_WITH = {"dreambooth": "sd_unet", "stable_diffusion": "sd_unet", "optimization_ladder": "sd_unet"}


def graph_group(notebook: str) -> str:
    """The xdist group of a notebook's papermill and browser runs: with those of the notebooks that compile the same
    graphs, in one worker one after the other. The tests' runs compile as ``aot_eager``, whose compiler AOTAutograd's
    cache does not store, so they no longer share graphs across processes; the groups stay as the schedule CI's time
    was measured with (RESULTS.md#ci)."""
    return f"notebooks-{_SHARES_GRAPHS_WITH.get(notebook, notebook)}"


# Fewer steps (4 timed after the profile's 4 of warm-up) and denoising steps than the profiles': each run still
# compiles, trains, is timed, reported and sampled from, with the graphs' shapes unchanged (CI's time, RESULTS.md#ci).
HEADLESS_PARAMETERS = {"stable_diffusion": {"steps": 8, "sample_steps": 2},
                       "dreambooth": {"steps": 8, "sample_steps": 2}, "swin_transformer": {"steps": 8}}


def in_its_graph_group(path: Path):
    return pytest.param(path, id=path.stem, marks=pytest.mark.xdist_group(graph_group(path.stem)))


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.xdist_group(graph_group("your_model"))  # beside the browser's run of it
def test_your_model_notebook_climbs_its_ladder_in_smoke_profile(tmp_path, monkeypatch):
    """The your_model notebook with a CNN (timm's resnet10t; the CPU gallery and the browser test run its default
    ViT): every rung trained the same loop, said what its calls changed, and the ladder's table, figure and step
    times were written; on a CPU the speedups read n/a. Then the example family (a module outside the library)
    trained its baseline and accelerated recipes through the gallery."""
    out_dir = tmp_path / "output"
    compiled_without_codegen(monkeypatch)
    executed = _runner().run_notebook(YOUR_MODEL, out_dir / "notebooks",
                                      {"profile": "smoke", "output_dir": str(out_dir), "data_root": str(tmp_path),
                                       "model_name": "resnet10t"}, cell_timeout=900)
    nb = nbformat.read(executed, as_version=4)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    record = json.loads((out_dir / "your_model" / "ladder.json").read_text())
    rungs = [row["rung"] for row in record["rows"]]
    assert rungs == ["plain PyTorch", "peer: torch.compile", "+ fused kernels", "+ compiled blocks",
                     "accelerate(model)"]
    for row in record["rows"][1:]:
        assert row["loss_difference"] < 1e-3, row  # fp32 on a CPU: the same function, step by step
    text = _stream_text(nb)
    assert text.startswith("resnet10t at 32 px")
    assert "compiled blocks: 4 blocks compiled in place (4 BasicBlock)" in text
    assert "fused kernels: no layer the" in text  # a CNN has none of the layers the kernels replace
    assert "No CUDA runtime is found" not in _stream_text(nb, "stderr")
    assert "Why: " in text and "benchmarks/RESULTS.md#" in text
    assert (out_dir / "your_model" / "ladder.png").stat().st_size > 10_000
    shown = [o["data"]["text/markdown"] for c in nb.cells for o in c.get("outputs", [])
             if "text/markdown" in o.get("data", {})]
    assert any("n/a on CPU (smoke)" in md and "data:image/png;base64," in md for md in shown)
    report = (out_dir / "toy_convnet" / "report.md").read_text()  # the example family, trained through the gallery
    assert "| baseline |" in report and "| accelerated |" in report


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", [in_its_graph_group(path) for path in RECIPE_NOTEBOOKS])
def test_notebook_runs_headless_in_smoke_profile(path, tmp_path, monkeypatch):
    out_dir = tmp_path / "output"
    compiled_without_codegen(monkeypatch)
    params = {"profile": "smoke", "output_dir": str(out_dir), "data_root": str(tmp_path / "data"),
              "interactive": False, **HEADLESS_PARAMETERS.get(path.stem, {})}
    executed = _runner().run_notebook(path, out_dir / "notebooks", params, cell_timeout=900)
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    family = path.stem
    report = out_dir / family / "report.md"
    assert report.exists() and (out_dir / family / "report.png").stat().st_size > 10_000
    for recipe in ("baseline", "compiled", "accelerated"):
        lines = (out_dir / family / recipe / "metrics.jsonl").read_text().splitlines()
        summary = json.loads(lines[-1])
        assert summary["type"] == "summary" and summary["recipe"] == recipe
        assert summary["output_dir"] == str(out_dir / family / recipe)  # each run carries its own path
        assert recipe in report.read_text()
    text = _stream_text(nb)
    assert "accelerated:" in text and "img/s" in text  # the summary cell printed this run's own numbers
    assert "No CUDA runtime is found" not in _stream_text(nb, "stderr")
    shown = [o["data"]["text/markdown"] for c in nb.cells for o in c.get("outputs", [])
             if "text/markdown" in o.get("data", {})]
    assert any("What each recipe runs on this machine (a CPU)" in md for md in shown)  # from the resolved configs
    NOTEBOOK_CHECKS[family](nb, out_dir / family)  # a new notebook adds its entry below


def _stream_text(nb, name: str | None = None) -> str:
    """What the executed notebook's cells printed (``name``: only ``stdout`` or only ``stderr``)."""
    return "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                     if o.output_type == "stream" and name in (None, o.get("name")))


def _times_the_step_alone(nb, family_dir: Path) -> None:
    """The Swin notebook: the accelerated recipe's window attention shown on the model, and its section timing the
    training step alone."""
    text = _stream_text(nb)
    assert "fused attention: 4 Swin window-attention modules" in text and "Why: " in text
    step_dir = family_dir.parent / "model_step" / family_dir.name
    step_summary = json.loads((step_dir / "accelerated" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step_summary["reuse_batch"] is True and (step_dir / "report.md").exists()


def _shown_images(nb) -> list:
    """The pictures the executed notebook shows: image outputs, and those inlined in a markdown output (a report's
    figure, shown once inside its report)."""
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "image/png" in o.get("data", {}) or "data:image/png" in o.get("data", {}).get("text/markdown", "")]


def _exports_and_samples_a_pipeline(nb, family_dir: Path) -> None:
    """The SD notebook: the accelerated calls shown on the UNet with their reasons; trained parts exported as a
    diffusers pipeline and sampled from, one row per recipe."""
    text = _stream_text(nb)
    assert "fused kernels: swapped 4: geglu=4. Why: " in text and "compiled blocks: 12 blocks compiled" in text
    assert (family_dir / "accelerated" / "pipeline" / "model_index.json").is_file()
    assert len(_shown_images(nb)) >= 3  # data preview, report figure, sampled grid
    assert (family_dir / "samples.png").stat().st_size > 10_000


def _shows_the_one_line_optimize_and_the_pipelines(nb, family_dir: Path) -> None:
    """The ResNet notebook: each image pipeline timed alone, the plain loop with and without optimize(model)."""
    text = _stream_text(nb)
    for pipeline in ("cpu", "gpu_augment", "gpu_decode"):
        assert f"{pipeline} on cpu:" in text and "img/s" in text
    assert "optimize: chose" in text and "with optimize(model):" in text and "plain loop:" in text


def _samples_the_subject_in_a_bucket(nb, family_dir: Path) -> None:
    """The DreamBooth notebook: the subject and class pictures shown, the grid sampled from the trained weights and
    saved as a PNG, one row per recipe; the accelerated calls shown on the UNet."""
    text = _stream_text(nb)
    assert "fused kernels: swapped" in text and "compiled blocks: " in text and "Why: " in text
    assert len(_shown_images(nb)) >= 3  # data preview, report figure, sampled grid
    assert (family_dir / "samples.png").stat().st_size > 10_000
    assert "in a bucket" in "\n".join(c.source for c in nb.cells if c.cell_type == "code")


NOTEBOOK_CHECKS = {  # what a notebook shows beyond the recipes, the report and the summary: one entry per notebook
    "swin_transformer": _times_the_step_alone,
    "stable_diffusion": _exports_and_samples_a_pipeline,
    "resnet50": _shows_the_one_line_optimize_and_the_pipelines,
    "dreambooth": _samples_the_subject_in_a_bucket,
}


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.xdist_group(graph_group("optimization_ladder"))
def test_ladder_notebook_climbs_every_rung_in_smoke_profile(tmp_path, monkeypatch):
    """The first rung and every compiled one a CPU can run train and land in the ladder report; the GPU rungs are
    reported left out. The eager rungs between them train in-process in test_ladder.py, and the compiled ones compile
    without Inductor's code, as every notebook test's runs do (CI's time, RESULTS.md#ci)."""
    from gallery_lib.recipes.ladder import RUNGS, recipe_name
    from test_ladder import EAGER_RUNGS

    out_dir = tmp_path / "output"
    climbed = [rung for rung in RUNGS if rung.name not in EAGER_RUNGS]
    compiled_without_codegen(monkeypatch)
    # 4 steps a rung (1 of warm-up, where a compiled rung compiles; 3 timed): each rung trains, is timed and lands in
    # the table, as at 6, with 2 steps fewer in each rung process
    params = {"profile": "smoke", "output_dir": str(out_dir), "data_root": str(tmp_path / "data"),
              "interactive": False, "steps": 4, "rungs": [rung.name for rung in climbed]}
    executed = _runner().run_notebook(LADDER, out_dir / "notebooks", params, cell_timeout=1500)
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    rows = {row["name"]: row for row in json.loads((out_dir / "stable_diffusion" / "ladder.json").read_text())}
    assert list(rows) == [rung.name for rung in climbed]
    for rung in climbed:
        summary_line = (out_dir / "stable_diffusion" / recipe_name(rung) / "metrics.jsonl")
        if rung.needs_gpu:
            assert rows[rung.name]["failure"] == "needs a GPU" and not summary_line.exists()
            continue
        summary = json.loads(summary_line.read_text().splitlines()[-1])
        assert summary["type"] == "summary" and rows[rung.name]["img_per_s"] == summary["samples_per_s"]
    assert [rows[name]["batch_size"] for name in ("tf32", "compile", "checkpointing")] == [2, 4, 4]
    text = _stream_text(nb)
    # a CPU ranks no rung: no fastest rung, and the findings say why
    assert "Fastest rung" not in text and "Timings on a CPU are not speedups: run on a GPU for the comparison" in text
    shown = [o["data"]["text/markdown"] for c in nb.cells for o in c.get("outputs", [])
             if "text/markdown" in o.get("data", {})]
    left_out = "ladder-11-cuda_graphs (CUDA graphs): left out, needs a GPU"  # once, under the table
    assert left_out not in text and sum(md.count(left_out) for md in shown) == 1
    assert any("`compile=True`" in md for md in shown)  # the plan, read from the resolved configs


@pytest.mark.notebook
@pytest.mark.slow
def test_a_stopped_recipe_leaves_every_other_result_and_one_line(tmp_path):
    """A recipe whose loss stops being finite: the notebook shows the other recipe's report and summary, the stopped
    one in one line, and fails only in its last cell, so that papermill and CI see a failed gallery."""
    import papermill

    out_dir = tmp_path / "output"
    stopping = ["baseline", {"lr": 1e30, "max_nonfinite_steps": 2}]  # AdamW with this lr: inf weights after step 0
    params = {"profile": "smoke", "output_dir": str(out_dir), "data_root": str(tmp_path / "data"),
              "interactive": False, "model_step_runs": False, "recipes": ["baseline", stopping]}
    path = REPO / "notebooks" / "swin_transformer.ipynb"
    with pytest.raises(papermill.PapermillExecutionError, match="RunsFailed"):
        _runner().run_notebook(path, out_dir / "notebooks", params, cell_timeout=900)
    nb = nbformat.read(out_dir / "notebooks" / path.name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(i, o) for i, c in enumerate(code) for o in c.outputs if o.output_type == "error"]
    name = "baseline+lr=1e+30+max_nonfinite_steps=2"
    log = out_dir / "swin_transformer" / name / "logs" / "rank0.log"
    line = f"{name}: stopped, loss not finite from step 1, see {log}"
    assert [i for i, _ in errors] == [len(code) - 1]  # every cell before the last one ran
    assert errors[0][1].ename == "RunsFailed" and errors[0][1].traceback == [f"RunsFailed: {line}"]
    report = (out_dir / "swin_transformer" / "report.md").read_text()
    assert "| baseline | CPU |" in report and f"- {line}\n" in report and f"| {name}" not in report
    text = _stream_text(nb)
    assert f"[gallery] {line}" in text and f"- {line}." in text  # as it stopped, and in the summary
    assert "- baseline: " in text and "img/s" in text and "Traceback" not in text


@pytest.mark.slow  # over 10 s on 2 cores: left out of the fast tier
def test_the_smoke_gallery_compiles_scalar_cpu_code_unless_the_environment_says(monkeypatch):
    """Where the notebooks run their smoke profile, Inductor's C++ is scalar (it compiles about a quarter faster, and
    the smoke runs show code paths, not speed); the full profile keeps vector code, and so does a user's setting."""
    runner = _runner()
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for profile, expected in (("full", None), ("smoke", "0"), ("auto", "0")):
        monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
        runner.compile_for_smoke(profile)
        assert os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") == expected, profile
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK")
    runner.compile_for_smoke("auto")
    assert "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ
    monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "1")
    runner.compile_for_smoke("smoke")
    assert os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"


def test_two_lanes_run_notebooks_side_by_side_and_report_each(tmp_path):
    """``--jobs 2``: each notebook in its own process, two at a time, every line prefixed with its name; a failing
    notebook fails the whole run, after the others ran."""
    import subprocess
    import sys

    folder = tmp_path / "notebooks"
    folder.mkdir()
    for name, body in {"a_slow": "import time\ntime.sleep(6)\nprint('a done')",
                       "b_slow": "import time\ntime.sleep(6)\nprint('b done')",
                       "c_fails": "raise ValueError('c broke')"}.items():
        declared = "profile = 'x'\noutput_dir = ''\ndata_root = ''"
        declared += "" if name == "b_slow" else "\ninteractive = True"
        nb = nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_code_cell(declared, metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell(body)], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                     "language": "python"}})
        nbformat.write(nb, folder / f"{name}.ipynb")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(REPO / "ci" / "run_notebooks.py"), "--notebooks", str(folder),
                           "--output", str(tmp_path / "out"), "--profile", "smoke", "--jobs", "2", "-p", "steps=3"],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    lines = done.stdout.splitlines()
    assert done.returncode == 1 and lines[-1] == "[notebooks] 2 passed, 1 failed: c_fails.ipynb", done.stdout[-2000:]
    assert "[a_slow] a done" in lines and "[b_slow] b done" in lines
    assert not [line for line in lines if "[IPKernelApp]" in line]  # the kernel's machinery log stays out
    # A parameter the user asked for is reported where a notebook lacks it; one the runner injects (b_slow declares
    # no `interactive`) is not.
    assert "[a_slow] [notebooks] a_slow.ipynb takes no parameter steps: not passed" in lines
    assert not [line for line in lines if "takes no parameter interactive" in line]
    assert any(line.startswith("[c_fails] [notebooks] c_fails.ipynb FAILED") for line in lines)
    # Side by side: the whole run took less than the two sleeping notebooks' own times added up.
    ends = {name: float(next(line for line in lines if line.startswith(f"[{name}] [notebooks] {name}.ipynb ok in")
                             ).split(" ok in ")[1].split(" s")[0]) for name in ("a_slow", "b_slow")}
    assert elapsed < sum(ends.values()), (elapsed, ends)
    assert (tmp_path / "out" / "notebooks" / "c_fails.ipynb").is_file()  # the failed copy is kept


@pytest.mark.notebook
def test_bad_parameters_stop_a_notebook_in_one_line_before_it_trains(tmp_path):
    """More warm-up steps than steps in your_model: its ladder refuses them before the first rung trains, and Jupyter
    shows the message alone (a ConfigError renders as one line, no traceback); it stopped after the first rung had
    trained, with a traceback."""
    import papermill

    out_dir = tmp_path / "output"
    params = {"profile": "smoke", "output_dir": str(out_dir), "data_root": str(tmp_path / "data"), "steps": 2,
              "warmup_steps": 3}
    with pytest.raises(papermill.PapermillExecutionError, match="ConfigError"):
        _runner().run_notebook(YOUR_MODEL, out_dir / "notebooks", params, cell_timeout=300)
    nb = nbformat.read(out_dir / "notebooks" / YOUR_MODEL.name, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert [o.traceback for o in errors] == [["ConfigError: steps=2 with warmup_steps=3: the steps count the warm-up, "
                                              "so there must be more of them than of warm-up steps"]]
    assert "plain PyTorch" not in _stream_text(nb)  # no rung started
