"""Bad input to the `gallery` command: a clear one-line error before anything is prepared or launched, never a
traceback; and a property test driving the command's parsing with random flags and values."""

from __future__ import annotations

import subprocess
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gallery_lib.app.cli import build_parser, configs_from_args, main
from gallery_lib.config import ConfigError, RunConfig


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a training process was started for bad input")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture
def class_folder(tmp_path):
    (tmp_path / "classes" / "train" / "cat").mkdir(parents=True)
    return tmp_path / "classes"


@pytest.fixture
def caption_folder(tmp_path):
    (tmp_path / "captions" / "train").mkdir(parents=True)
    (tmp_path / "captions" / "train" / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "a cat"}\n')
    return tmp_path / "captions"


def _refused(capsys, argv: list[str]) -> str:
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert err.startswith("gallery: error: ") and "Traceback" not in err and err.count("\n") == 1
    return err


BAD_INPUT = [  # (argv, what the error says)
    (["--recipe", "baseline", "--compile-mode", "reduce-overhead"],
     "compile_mode='reduce-overhead' has no effect in the baseline recipe, which runs with compile=False: use the "
     "compiled, peer or accelerated recipe"),
    (["--recipe", "compiled", "--set", "kernel_ops=geglu"], "has no effect in the compiled recipe"),
    (["--recipe", "baseline", "--set", "coordinate_descent_tuning=true"],
     "coordinate_descent_tuning=True has no effect in the baseline recipe, which runs with compile=False"),
    (["--set", "fused_attention=maybe"], "fused_attention='maybe' is invalid: expected true or false"),
    (["--set", "fused_atention=1"], "there is no setting 'fused_atention'; did you mean fused_attention?"),
    (["--set", "nosuchfield"], "expected FIELD=VALUE"),
]


@pytest.mark.parametrize("extra, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_flags_are_refused_in_one_line(capsys, no_launch, class_folder, extra, message):
    err = _refused(capsys, ["train", "--profile", "smoke", "--model", "swin_micro", "--data-dir",
                            str(class_folder), *extra])
    assert message in err


def test_resume_without_a_checkpoint_is_refused_before_launch(capsys, no_launch, class_folder, tmp_path):
    err = _refused(capsys, ["train", "--profile", "smoke", "--model", "resnet_micro", "--data-dir", str(class_folder),
                            "--output-dir", str(tmp_path / "out"), "--resume"])
    assert "no checkpoint to resume from" in err


def test_data_of_the_wrong_kind_is_refused_before_launch(capsys, no_launch, class_folder, caption_folder):
    err = _refused(capsys, ["train", "--profile", "smoke", "--model", "sd_tiny", "--data-dir", str(class_folder)])
    assert "sd_tiny trains on captioned images" in err and "metadata.jsonl does not exist" in err
    err = _refused(capsys, ["train", "--profile", "smoke", "--model", "resnet_micro", "--data-dir",
                            str(caption_folder)])
    assert "holds no class folders (it looks like a caption folder" in err


def test_help_reads_as_text(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "metadata.jsonl" in out  # --data-dir names both kinds of data
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


_VALUES = st.sampled_from(["", "0", "1", "-3", "2.5", "1e-3", "true", "maybe", "O1", "O3", "none", "cuda", "cpu",
                           "reduce-overhead", "swin_micro", "sd_tiny", "resnet_micro", "nosuch", "geglu", "a=b"])
_FLAGS = st.sampled_from(["--batch-size", "--steps", "--warmup-steps", "--image-size", "--num-workers", "--lr",
                          "--seed", "--device", "--amp-level", "--amp-dtype", "--compile-mode", "--model",
                          "--nproc-per-node", "--recipe", "--checkpoint-every"])
_SETTINGS = st.sampled_from(["lr", "fused_attention", "compile_mode", "mixup_alpha", "kernel_ops", "ema",
                             "image_pipeline", "optimizer", "batch_size", "clip_grad", "no_such", "cache_latents"])
_ARGUMENT = st.one_of(
    st.tuples(_FLAGS, _VALUES).map(list),
    st.tuples(st.just("--set"), st.tuples(_SETTINGS, _VALUES).map(lambda kv: "=".join(kv))).map(list),
    st.sampled_from([["--compiler-opt"], ["--kernel-opt"], ["--resume"], ["--find-batch-size"]]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=st.lists(_ARGUMENT, max_size=5), profile=st.sampled_from(["smoke", "full"]))
def test_any_flags_give_a_valid_config_or_a_clean_error(arguments, profile):
    argv = ["train", "--profile", profile] + [part for argument in arguments for part in argument]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's own usage error: a message and exit code 2, no traceback
        assert exc.code == 2
        return
    try:
        configs = configs_from_args(args)
    except ConfigError as exc:
        assert str(exc).strip()  # a message saying what is wrong
        return
    assert configs and all(isinstance(cfg, RunConfig) for cfg in configs)
