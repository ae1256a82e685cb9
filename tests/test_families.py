"""The family registry: a new family is one module (examples/toy_family.py), and every library path reads from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gallery_lib.config import ConfigError, RunConfig
from gallery_lib.families import FAMILIES, MODELS, family_env, family_of, unregister_family
from gallery_lib.recipes.profiles import base_config
from gallery_lib.recipes import apply_recipe
from gallery_lib.run.memory_plan import NAMED


def without_named(cfg: RunConfig) -> RunConfig:
    return cfg.replace(extra={k: v for k, v in cfg.extra.items() if k != NAMED})


@pytest.fixture
def toy():
    import importlib

    import toy_family  # importing it registers the family

    if "toy_convnet" not in FAMILIES:  # unregistered by an earlier test: import it again
        importlib.reload(toy_family)
    family = FAMILIES["toy_convnet"]
    yield family
    unregister_family(family.name)


def test_builtin_families_declare_what_the_library_reads():
    for family in FAMILIES.values():
        assert {"smoke", "full"} <= set(family.run_profiles) and family.model_names()
        assert all(MODELS[name].family == family.name for name in family.model_names())
        smoke = base_config("smoke", family=family.name)
        assert smoke.model_family is family and MODELS[smoke.model].tiny


def test_the_gallerys_families_load_through_its_entry_point_in_order():
    """No table of module names in the base layer: the installed package's entry point lists the families, in the
    order ``gallery list`` shows them, the first being the default one (``pip install -e .`` writes it)."""
    from importlib.metadata import entry_points

    from gallery_lib.config.families import ENTRY_POINT_GROUP

    assert [entry.value for entry in entry_points(group=ENTRY_POINT_GROUP)] == ["gallery_lib.families.builtin:BUILTIN"]
    assert list(FAMILIES)[:4] == ["swin_transformer", "stable_diffusion", "resnet50", "dreambooth"]
    assert base_config("smoke").model_family is FAMILIES["swin_transformer"]


def test_a_registered_family_resolves_profiles_recipes_and_switches(toy, tmp_path):
    base = base_config("smoke", family="toy_convnet", data_root=str(tmp_path))
    assert base.data_dir == str(tmp_path / "toy_images_smoke") and base.task == "classification"
    plain = apply_recipe("compiled", base)
    fast = apply_recipe("accelerated", base)
    assert (plain.channels_last, plain.fused_loss, plain.compile_scope) == (False, False, "model")
    assert (fast.channels_last, fast.fused_loss, fast.compile_scope) == (True, True, "blocks")
    assert not fast.fused_attention  # the toy has no attention hook, so it inherits no other family's switch
    assert family_of("toy_convnet") is toy and "toy_convnet" in MODELS


@pytest.mark.parametrize("family", ["swin_transformer", "resnet50"])
def test_accelerated_replays_cuda_graphs_on_a_gpu_and_compiles_plainly_on_a_cpu(family, monkeypatch):
    """Swin and ResNet-50 keep CUDA graphs on a GPU (benchmarks/RESULTS.md#bench-h100, #resnet50); a CPU has none."""
    base = base_config("full", family=family, data_root="/data")
    assert apply_recipe("accelerated", base.replace(device="cpu")).compile_mode == "default"
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    fast = apply_recipe("accelerated", base)
    assert (fast.compile, fast.resolved_compile_mode, fast.compile_scope) == (True, "reduce-overhead", "model")
    assert apply_recipe("peer", base).resolved_compile_mode == "reduce-overhead"  # the one word a skilled user adds too


def test_swin_reads_channels_last_images_accelerated_on_a_gpu_and_the_peer_everywhere(monkeypatch):
    """channels_last images measured faster for Swin's accelerated step on a GPU, and for its peer, which takes them
    as timm's --channels-last does (benchmarks/RESULTS.md#swin-channels-last, #swin-peer-channels-last); README's
    Swin-T peer row ran with the switch named, the same run as the recipe now."""
    from gallery_lib.recipes import recipe_config

    base = base_config("full", family="swin_transformer", data_root="/data")
    assert not apply_recipe("accelerated", base.replace(device="cpu")).channels_last
    assert apply_recipe("peer", base.replace(device="cpu")).channels_last
    monkeypatch.setattr("gallery_lib.recipes.named.runs_on_gpu", lambda base: True)
    fast = apply_recipe("accelerated", base)
    assert fast.channels_last and not fast.channels_last_graphs and fast.fused_attention
    peer = apply_recipe("peer", base)
    assert peer.channels_last and not peer.fused_attention  # timm's --channels-last, which the peer takes too
    named = recipe_config(base, "accelerated", {"channels_last": True})
    assert named.extra[NAMED] == ["channels_last"]  # the memory plan leaves what the user named as named
    assert without_named(named).replace(recipe="accelerated") == without_named(fast)
    assert without_named(recipe_config(base, "peer", {"channels_last": True})).replace(recipe="peer") == \
        without_named(peer)


def test_large_step_switches_need_the_size_they_start_at(toy):
    import dataclasses

    with pytest.raises(ValueError, match="accelerated_on_large_steps and large_step_pixels go together"):
        dataclasses.replace(toy, accelerated_on_large_steps={"kernel_ops": "geglu"})
    with pytest.raises(ValueError, match="accelerated_on_large_steps and large_step_pixels go together"):
        dataclasses.replace(toy, large_step_pixels=1024)


def test_an_option_the_family_cannot_take_fails_before_any_data(toy, tmp_path):
    with pytest.raises(ConfigError, match="fused_attention=True is invalid for 'toy_convnet'.*no attention hook"):
        base_config("smoke", family="toy_convnet", data_root=str(tmp_path), fused_attention=True)
    with pytest.raises(ConfigError, match="cache_latents=True applies to text-to-image and dreambooth models"):
        base_config("smoke", family="toy_convnet", data_root=str(tmp_path), cache_latents=True)
    assert not (tmp_path / "toy_images_smoke").exists()


def test_training_processes_import_an_outside_family_again(toy):
    env = family_env(toy)
    module, _, root = env["GALLERY_FAMILY_MODULES"].partition("=")
    assert module == "toy_family" and root.endswith("examples")
    assert family_env(FAMILIES["swin_transformer"]) == {}  # built-in families need nothing


@pytest.mark.slow
def test_a_new_family_runs_baseline_and_accelerated_through_the_gallery(toy, tmp_path):
    from gallery_lib.app.workflow import compare, prepare, run_recipes

    base = base_config("smoke", family="toy_convnet", data_root=str(tmp_path / "data"),
                       output_dir=str(tmp_path / "out"), device="cpu")
    prepare(base, progress=False)
    results = run_recipes(base, ["baseline", "accelerated"], echo=None)  # torchrun processes, as notebooks run
    for recipe, result in results.items():
        summary = result.summary
        assert summary["recipe"] == recipe and summary["output_dir"] == str(tmp_path / "out/toy_convnet" / recipe)
        assert summary["steps"] == 6 and summary["final_loss"] == summary["final_loss"]  # finished, not NaN
    notes = results["accelerated"].summary["notes"]
    assert any("channels_last" in note for note in notes)
    assert any("2 repeated blocks in place" in note for note in notes)
    path = tmp_path / "out/toy_convnet/accelerated/config.json"
    saved = json.loads(path.read_text())
    assert saved["options"]["fused_loss"] is True and RunConfig.load(path) == results["accelerated"].config
    assert "accelerated" in compare(base, list(results)).markdown


@pytest.mark.parametrize("module", ["gallery_lib.families.stable_diffusion", "gallery_lib.families.dreambooth"])
def test_a_family_module_imported_first_loads_every_family(module):
    """A fresh process that imports one family module before anything else (a test, a user's script) gets that
    family and all the others: registering the first one does not import its neighbours while it is half-built."""
    import subprocess
    import sys

    code = f"import {module}; from gallery_lib.families import FAMILIES; print(sorted(FAMILIES))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'dreambooth', 'resnet50', 'stable_diffusion', 'swin_transformer'" in out.stdout


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "toy_family.py"


def test_the_cli_takes_a_family_module_from_a_file(capsys, toy):
    from gallery_lib.app.cli import main

    assert main(["--family-module", str(EXAMPLE), "list"]) == 0
    assert "toy_convnet" in capsys.readouterr().out
    assert main(["--family-module", "no_such_family.py", "list"]) == 2
    err = capsys.readouterr().err
    assert "--family-module no_such_family.py: no such Python file" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_example_family_trains_through_gallery_train(tmp_path):
    """``gallery --family-module examples/toy_family.py train``: a fresh process (the command) registers the family
    from the file, and the training process it launches imports it again."""
    import subprocess
    import sys

    out = tmp_path / "out"
    command = [sys.executable, "-m", "gallery_lib.app.cli", "--family-module", str(EXAMPLE), "train",
               "--model", "toy_convnet", "--profile", "smoke", "--steps", "3", "--warmup-steps", "1",
               "--data-dir", str(tmp_path / "toy_images"), "--output-dir", str(out)]
    prepared = subprocess.run([*command[:5], "prepare", "--model", "toy_convnet", "--profile", "smoke",
                               "--data-dir", str(tmp_path / "toy_images")], capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    trained = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((out / "toy_convnet" / "baseline" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["type"] == "summary" and summary["model"] == "toy_convnet" and summary["steps"] == 3


def test_every_measured_footprint_names_its_committed_result_files():
    """The memory plan reads the footprints as measurements: each names the files under ``benchmarks/results/`` that
    hold it (a note in brackets may follow a name), and those files are committed."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for family in FAMILIES.values():
        for footprint in family.memory_footprints:
            names = [name.split(" (")[0].strip() for name in footprint.source.split(",")]
            assert names and all(names), f"{family.name}: {footprint} names no result file"
            missing = [name for name in names if not (results / name).exists()]
            assert not missing, f"{family.name} {footprint.model} {footprint.recipe}: {missing} not committed"


def test_a_footprint_read_from_a_whole_notebook_run_is_what_that_run_measured():
    """A footprint whose one source is a whole notebook's record (``notebooks_caps_*/notebook_*.json``) holds the
    peak that run reserved, at the setting its plan ran: its batch per step, its checkpointing and compilation."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    checked = 0
    for family in FAMILIES.values():
        for footprint in family.memory_footprints:
            if "," in footprint.source or not footprint.source.startswith("notebooks_caps_"):
                continue
            run = json.loads((results / footprint.source).read_text())["runs"][footprint.recipe]
            ran = run["memory_plan"]["chosen"]
            assert (ran["accumulation"], ran["checkpointing"], ran["uncompiled"]) == (
                1, footprint.gradient_checkpointing, footprint.uncompiled), footprint
            assert dict(footprint.reserved_gib) == {ran["batch_size"]: round(run["peak_reserved_mb"] / 1024, 2)}, (
                footprint)
            checked += 1
    assert checked >= 10  # SD-1.5's compiled recipe at 16 GiB and the ladder's rungs at 38
