"""The gallery command: flag spellings, recipe overrides, and errors before any work starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gallery_lib.app.cli import base_from_args, build_parser, main, optimization_overrides, recipe_config


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_dash_and_underscore_spellings_are_the_same_flag():
    a = parse("train", "--batch_size", "64", "--nproc_per_node", "1", "--amp_level", "O2", "--compiler-opt",
              "--kernel_opt", "--profile", "smoke")
    b = parse("train", "--batch-size", "64", "--nproc-per-node", "1", "--amp-level", "O2", "--compiler_opt",
              "--kernel-opt", "--profile", "smoke")
    assert vars(a) == vars(b)
    assert optimization_overrides(a) == {"amp_level": "O2", "compile": True, "kernels": True}


def test_overrides_rename_the_run_so_recipe_results_are_not_overwritten():
    args = parse("train", "--profile", "smoke", "--recipe", "baseline", "--amp_level", "O2", "--compiler-opt")
    cfg = recipe_config(base_from_args(args), args.recipe, optimization_overrides(args))
    assert cfg.recipe == "baseline+amp_level=O2+compile" and cfg.compile and cfg.amp_level == "O2"
    plain = recipe_config(base_from_args(args), "baseline", {})
    assert plain.recipe == "baseline" and plain.run_dir != cfg.run_dir


def test_set_overrides_any_field_and_names_the_run():
    args = parse("train", "--profile", "smoke", "--recipe", "compiled", "--set", "fused_attention=true",
                 "--set", "lr=0.002")
    cfg = recipe_config(base_from_args(args), args.recipe, optimization_overrides(args))
    assert cfg.fused_attention is True and cfg.lr == 0.002 and cfg.compile
    assert cfg.recipe == "compiled+fused_attention+lr=0.002"
    off = recipe_config(base_from_args(args), "compiled", {"compile": False})
    assert off.recipe == "compiled+no-compile" and not off.compile  # a switch turned off is named as such
    # how a run is carried out keeps its name, so a resumed run goes on in the folder it stopped in
    carried = recipe_config(base_from_args(args), "compiled", {"resume": True, "checkpoint_every": 5, "lr": 0.002})
    assert carried.recipe == "compiled+lr=0.002" and carried.resume and carried.checkpoint_every == 5
    assert recipe_config(base_from_args(args), "compiled", {"resume": True}).recipe == "compiled"


def test_a_path_or_a_sentence_set_names_the_run_by_one_folder_of_safe_characters(tmp_path):
    """``--set instance_data_dir=/my/photos`` trained into ``baseline+instance_data_dir=/my/photos/``: three folders
    deep, where the report found no run."""
    photos = tmp_path / "my photos"
    args = parse("train", "--model", "dreambooth_tiny", "--recipe", "baseline", "--set",
                 f"instance_data_dir={photos}/", "--set", "instance_prompt=a photo of sks cat")
    cfg = recipe_config(base_from_args(args), args.recipe, optimization_overrides(args))
    assert cfg.instance_data_dir == f"{photos}/" and cfg.instance_prompt == "a photo of sks cat"
    assert cfg.recipe == "baseline+instance_data_dir=my_photos+instance_prompt=a_photo_of_sks_cat"
    assert cfg.run_dir == Path(cfg.output_dir) / "dreambooth" / cfg.recipe


def test_compile_mode_auto_is_a_choice_of_the_flag_and_of_set():
    for argv in (("--compile_mode", "auto"), ("--set", "compile_mode=auto")):
        args = parse("train", "--profile", "smoke", "--recipe", "compiled", *argv)
        cfg = recipe_config(base_from_args(args), args.recipe, optimization_overrides(args))
        assert cfg.compile_mode == "auto" and cfg.recipe == "compiled+compile_mode=auto"


@pytest.mark.parametrize("argv, message", [
    (["train", "--profile", "smoke", "--recipe", "fastest"], "recipe='fastest' is not known"),
    (["train", "--profile", "smoke", "--batch_size", "7"], "batch_size=7 is invalid"),
    (["train", "--profile", "smoke", "--model", "resnet1"], "model='resnet1' is not known"),
    (["train", "--profile", "smoke", "--device", "cuda"], "no CUDA GPU is visible"),
    (["train", "--profile", "smoke", "--nproc_per_node", "64"], "nproc_per_node=64"),
    (["run", "--profile", "smoke", "--recipes", "baseline,warp"], "recipe='warp' is not known"),
    (["run", "--profile", "smoke", "--nproc_per_node", "64"], "nproc_per_node=64"),
    (["train", "--profile", "smoke", "--set", "fused_attn=1"], "no setting 'fused_attn'; did you mean fused_attention"),
])
def test_bad_input_fails_fast_with_a_clear_message(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "data").exists() and not (tmp_path / "output").exists()  # nothing was prepared or run


def test_missing_data_folder_is_reported(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--profile", "smoke", "--data_dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no training data" in err and "gallery prepare" in err


def test_a_run_on_a_data_folder_that_is_not_there_stops_before_its_first_recipe_with_the_command_that_fills_it(
        capsys, tmp_path, monkeypatch):
    """`gallery run --data-dir` trains on the folder it names (it prepares only the default one): missing, the run
    stops before any recipe starts, and the prepare command it names writes into that folder."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--model", "swin_micro", "--recipes", "baseline,accelerated", "--data-dir",
                 "data dir/swin"]) == 2
    out, err = capsys.readouterr()
    assert "===" not in out and not (tmp_path / "output").exists()  # no recipe started
    assert ("no training data at data dir/swin/train: prepare mock data there with `gallery prepare --model swin_micro "
            "--data-dir 'data dir/swin'`") in err


def test_list_and_console_entry_point():
    out = subprocess.run([sys.executable, "-m", "gallery_lib.app.cli", "list"], capture_output=True, text=True,
                         check=True)
    assert "swin_tiny_patch4_window7_224" in out.stdout and "accelerated" in out.stdout


def test_diffusers_and_timm_spellings_set_the_same_fields():
    from gallery_lib.app.cli import build_parser, configs_from_args

    diffusers = ("train --profile smoke --model sd_tiny --recipe compiled --train_batch_size 3 --resolution 64 "
                 "--mixed_precision fp16 --gradient_checkpointing --use_ema --checkpointing_steps 5 "
                 "--resume_from_checkpoint latest --pretrained_model_name_or_path /models/sd15 --gradient_accumulation_steps 2")
    (cfg,) = configs_from_args(build_parser().parse_args(diffusers.split()))
    assert (cfg.batch_size, cfg.image_size, cfg.amp_level, cfg.amp_dtype) == (3, 64, "O1", "float16")
    assert cfg.gradient_checkpointing and cfg.ema == "foreach" and cfg.checkpoint_every == 5 and cfg.resume
    assert cfg.pretrained == "/models/sd15" and cfg.gradient_accumulation_steps == 2 and cfg.global_batch_size == 6
    assert cfg.recipe == ("compiled+amp_level=O1+amp_dtype=float16+gradient_checkpointing"
                          "+gradient_accumulation_steps=2")  # named after its changes
    timm = ("train --profile smoke --model swin_micro --grad-checkpointing --model-ema --torchcompile --amp-dtype bfloat16"
            " --grad-accum-steps 3")
    (cfg,) = configs_from_args(build_parser().parse_args(timm.split()))
    assert cfg.compile and cfg.gradient_checkpointing and cfg.ema == "loop" and cfg.amp_dtype == "bfloat16"
    assert cfg.gradient_accumulation_steps == 3
    (cfg,) = configs_from_args(build_parser().parse_args("train --profile smoke --mixed_precision no".split()))
    assert cfg.amp_level == "O0"
    (cfg,) = configs_from_args(build_parser().parse_args("train --profile smoke --offload_ema".split()))
    assert cfg.ema != "off" and cfg.ema_offload and cfg.recipe.endswith("+ema_offload")


@pytest.mark.parametrize("argv, message", [
    (["--torchcompile", "cudagraphs"], "--torchcompile cudagraphs: the gallery compiles with inductor"),
])
def test_spellings_the_gallery_cannot_honour_are_refused(argv, message, capsys):
    from gallery_lib.app.cli import main

    assert main(["train", "--profile", "smoke", "--model", "swin_micro", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_report_of_runs_not_there_names_the_command_that_trains_them_where_the_report_looks(capsys, tmp_path,
                                                                                             monkeypatch):
    """`gallery compare --output-dir elsewhere` with no runs there: the train command it names writes into that
    folder, for that model (it said `--model <model>` and trained into the default folder)."""
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--model", "resnet_micro", "--output-dir", "my runs"]) == 2
    assert ("train it first: `gallery train --model resnet_micro --recipe baseline --output-dir 'my runs'` or the "
            "notebook's training cell") in capsys.readouterr().err


def test_a_recipe_listed_twice_is_refused_before_anything_runs(capsys, tmp_path, monkeypatch):
    """`--recipes baseline,baseline` trained baseline twice into one folder (the second moved the first to earlier/)
    and the report listed it twice."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--model", "swin_micro", "--recipes", "baseline,accelerated,baseline"]) == 2
    assert ("baseline listed twice: each run of a recipe trains in one folder; list it once, or change a setting of "
            "the second (RECIPE+FIELD=VALUE names a run of its own)") in capsys.readouterr().err
    assert not (tmp_path / "data").exists() and not (tmp_path / "output").exists()
