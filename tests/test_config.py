"""RunConfig validation, serialization, recipes and profiles."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gallery_lib.config import ConfigError, RunConfig, parse_overrides, validate_for_machine
from gallery_lib.config.run_config import core_field_names, task_setting_names
from gallery_lib.config.sections import EMA, SECTION_OF, SECTION_TYPES, Compile, Kernels, Training
from gallery_lib.recipes.profiles import base_config, data_spec
from gallery_lib.recipes import RECIPES, apply_recipe


def micro(**kw) -> RunConfig:
    return RunConfig(**{"model": "swin_micro", "batch_size": 8, "steps": 4, "warmup_steps": 1, **kw})


@pytest.mark.parametrize("field, value, fragment", [
    ("model", "resnet9000", "model='resnet9000' is not known: choose one of"),
    ("batch_size", 0, "batch_size=0 is invalid: expected an integer >= 1"),
    ("batch_size", 7, "use an even batch size"),
    ("batch_size", 2.5, "batch_size=2.5 is invalid"),
    ("steps", -1, "steps=-1 is invalid"),
    ("warmup_steps", 4, "leave at least one timed step"),
    ("amp_level", "O3", "amp_level='O3' is not known: choose one of O0, O1, O2"),
    ("amp_dtype", "fp8", "amp_dtype='fp8' is not known"),
    ("compile_mode", "turbo", "compile_mode='turbo' is not known"),
    ("compile_scope", "layers", "compile_scope='layers' is not known: choose one of model, blocks"),
    ("precompile_workers", -1, "precompile_workers=-1 is invalid: expected an integer >= 0"),
    ("precompile_workers", 4, "precompile_workers=4 needs compile=True and compile_scope='blocks'"),
    ("device", "tpu", "device='tpu' is not known"),
    ("nproc_per_node", 0, "nproc_per_node=0 is invalid"),
    ("lr", -1.0, "lr=-1.0 is invalid"),
    ("label_smoothing", 1.5, "label_smoothing=1.5 is invalid"),
    ("mixup_alpha", -0.1, "mixup_alpha=-0.1 is invalid"),
    ("label_smoothing", 1.0, "label_smoothing=1.0 is invalid"),  # moved from the loader's own checks
    ("re_prob", 1.5, "re_prob=1.5 is invalid"),
    ("fused_attention", "maybe", "fused_attention='maybe' is invalid: expected true or false"),
])
def test_invalid_values_name_field_value_and_fix(field, value, fragment):
    with pytest.raises(ConfigError, match="^" + field) as info:
        micro(**{field: value})
    assert fragment in str(info.value)


@pytest.mark.parametrize("alphas", [dict(mixup_alpha=0.8, cutmix_alpha=0), dict(mixup_alpha=0, cutmix_alpha=1.0)])
def test_odd_batch_is_refused_with_mixup_or_cutmix(alphas):  # moved from the loader's own checks
    with pytest.raises(ConfigError, match="use an even batch size"):
        micro(batch_size=5, **alphas)


def test_odd_batch_is_fine_without_mixup():
    assert micro(batch_size=7, mixup_alpha=0, cutmix_alpha=0).batch_size == 7


def test_o2_rejects_float16():
    with pytest.raises(ConfigError, match="O2"):
        micro(amp_level="O2", amp_dtype="float16")


def test_ema_stream_programs_need_the_stream_mode():
    assert micro(ema="stream", ema_stream_programs=32).ema_stream_programs == 32
    with pytest.raises(ConfigError, match="ema_stream_programs=32 .* set ema='stream'"):
        micro(ema="fused", ema_stream_programs=32)


def test_json_round_trip_and_unknown_fields(tmp_path):
    cfg = micro(lr=1e-3, auto_augment="rand-m9-mstd0.5-inc1", extra={"note": "x"})
    path = cfg.save(tmp_path / "config.json")
    assert RunConfig.load(path) == cfg
    data = json.loads(path.read_text())
    data["batchsize"] = 3
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['batchsize'\]"):
        RunConfig.from_dict(data)
    with pytest.raises(ConfigError, match="unknown config field"):
        cfg.replace(compiler=True)


def test_derived_values():
    cfg = micro(batch_size=64, nproc_per_node=2, output_dir="out")
    assert cfg.global_batch_size == 128
    assert cfg.peak_lr == pytest.approx(5e-4 * 128 / 512)  # the Swin reference's linear scaling rule
    assert str(cfg.run_dir) == "out/swin_transformer/baseline"


def test_machine_checks_before_any_work():
    cfg = micro()
    assert validate_for_machine(cfg, cuda_devices=0, cpu_count=2) == "cpu"
    assert validate_for_machine(cfg, cuda_devices=1) == "cuda"
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        validate_for_machine(micro(device="cuda"), cuda_devices=0)
    with pytest.raises(ConfigError, match="nproc_per_node=4 but only 2 GPU"):
        validate_for_machine(micro(nproc_per_node=4), cuda_devices=2)
    with pytest.raises(ConfigError, match="nproc_per_node=3 but this machine has 2 CPU"):
        validate_for_machine(micro(nproc_per_node=3), cuda_devices=0, cpu_count=2)
    with pytest.raises(ConfigError, match="captures CUDA graphs and needs a GPU"):
        validate_for_machine(micro(compile=True, compile_mode="reduce-overhead"), cuda_devices=0)


def test_pretrained_weights_must_be_here_or_read_as_a_hub_id(tmp_path):
    """A mistyped path is refused before the run, not read as a Hub id whose download fails inside it."""
    sd = RunConfig(model="sd_tiny", device="cpu")
    for missing in ("/models/sd15", "./sd15", "~/sd15-not-here", "../sd15", "a/b/c"):
        with pytest.raises(ConfigError, match=f"pretrained='{re.escape(missing)}' is not a file or folder on this "
                                              r"machine, nor a Hugging Face Hub id \('owner/name'\)"):
            validate_for_machine(sd.replace(pretrained=missing), cuda_devices=0)
    for taken in ("runwayml/stable-diffusion-v1-5", "sd-legacy/stable-diffusion-v1-5", "gpt2", str(tmp_path)):
        assert validate_for_machine(sd.replace(pretrained=taken), cuda_devices=0) == "cpu"


def test_recipes_differ_only_in_their_switches():
    base = micro(lr=1e-3, steps=9)
    configs = {name: apply_recipe(name, base) for name in RECIPES}
    shared = ("model", "batch_size", "steps", "lr", "data_dir", "seed", "mixup_alpha", "weight_decay", "clip_grad")
    for cfg in configs.values():
        assert all(getattr(cfg, f) == getattr(base, f) for f in shared)
    b, c, p, a = configs["baseline"], configs["compiled"], configs["peer"], configs["accelerated"]
    assert (b.compile, b.fused_optimizer, b.amp_level) == (False, False, "O1")
    assert (c.compile, c.fused_optimizer, c.amp_dtype) == (True, True, "bfloat16")
    assert p == c.replace(recipe="peer", channels_last=True)  # Swin's plain-PyTorch peer: timm's --channels-last
    # accelerated keeps only switches that measured faster than compiled: for Swin-T, registry window attention
    assert a.replace(recipe="compiled", fused_attention=False) == c and a.fused_attention
    assert {cfg.recipe for cfg in configs.values()} == set(RECIPES)
    with pytest.raises(ConfigError, match="recipe='turbo' is not known"):
        apply_recipe("turbo", base)


def test_profiles():
    smoke = base_config("smoke", data_root="/d")
    assert smoke.model == "swin_micro" and smoke.profile == "smoke" and smoke.data_dir == "/d/imagenet_like_smoke"
    full = base_config("full", batch_size=None, steps=12)
    assert (full.model, full.image_size, full.batch_size, full.steps) == ("swin_tiny_patch4_window7_224", 224, 128, 12)
    assert full.warmup_steps == 4  # scaled down with the steps so timed steps remain
    assert data_spec("smoke")["num_classes"] == 10
    with pytest.raises(ConfigError, match="profile='huge' is not known"):
        base_config("huge")


@pytest.mark.parametrize("model", ["sd15", "dreambooth_sd15"])
def test_a_model_named_over_the_smoke_profiles_takes_an_image_size_it_can_train_at(model):
    """The smoke profile sizes images for its tiny model (32 px); SD-1.5 takes multiples of 64. Named on a CPU, the
    model gets the profile's size rounded up to one it takes; a size the user gives that it cannot take is an error
    before any run starts, naming one that fits."""
    assert base_config("smoke", model=model).image_size == 64
    assert base_config("smoke", model=model, image_size=128).image_size == 128
    with pytest.raises(ConfigError, match=rf"image_size=96 does not fit '{model}': its image sizes are multiples of "
                                          r"64\. Set image_size=128"):
        base_config("smoke", model=model, image_size=96)
    with pytest.raises(ConfigError, match="image_size=32 does not fit"):
        base_config("full", model=model).replace(image_size=32)
    assert base_config("smoke").image_size == 64 and base_config("smoke", family="stable_diffusion").image_size == 32


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(-4, 300), steps=st.integers(-2, 50), warm=st.integers(-2, 60),
       amp=st.sampled_from(["O0", "O1", "O2", "O9", ""]), mix=st.one_of(st.floats(-1, 2), st.just(float("nan"))))
def test_config_either_builds_valid_or_raises_config_error(batch, steps, warm, amp, mix):
    try:
        cfg = micro(batch_size=batch, steps=steps, warmup_steps=warm, amp_level=amp, mixup_alpha=mix)
    except ConfigError as exc:
        assert "=" in str(exc)  # names the field and the value
        return
    assert cfg.batch_size >= 1 and 0 <= cfg.warmup_steps < cfg.steps and cfg.amp_level in ("O0", "O1", "O2")
    assert cfg.mixup_alpha >= 0 and (cfg.batch_size % 2 == 0 or not cfg.uses_mixup)


def test_model_step_config_times_the_step_alone_in_its_own_folder():
    from gallery_lib.app.workflow import model_step_config

    base = base_config("full", output_dir="out")
    step = model_step_config(base)
    assert step.reuse_batch and step.max_nonfinite_steps == 0 and not step.resume
    assert step.run_dir.parts[:2] == ("out", "model_step") and step.run_dir != base.run_dir
    assert (step.steps, step.warmup_steps) == (60, 30)  # SDPA needed ~25 steps to settle on the H200
    assert step.replace(reuse_batch=False, output_dir="out", max_nonfinite_steps=5, steps=base.steps,
                        warmup_steps=base.warmup_steps, export_model=True) == base


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["flat_config_swin_micro.json", "flat_config_sd_tiny.json"])
def test_flat_config_json_written_before_the_sections_still_loads(name, tmp_path):
    """Files written flat by 552a0d8, before the sections: every field loads under its flat name, and the file saved
    again comes out in sections and loads to the same config."""
    old = json.loads((FIXTURES / name).read_text())
    cfg = RunConfig.load(FIXTURES / name)
    assert {key: cfg.to_dict()[key] for key in old} == old
    path = cfg.save(tmp_path / "config.json")
    saved = json.loads(path.read_text())
    assert list(saved) == [*SECTION_TYPES, "options", "extra"]
    assert saved["optimizer"]["lr"] == old["lr"] and saved["job"]["model"] == old["model"]
    assert RunConfig.load(path) == cfg == RunConfig.from_dict(old)


def test_a_file_with_the_old_step_notes_loads_with_the_intent_they_noted(tmp_path):
    """Files written while the recipes noted in ``extra`` that they had chosen ``compile_mode`` and the large-step
    kernels by the step's size (``block_graphs_by_batch``, ``small_step_switches``, read by the batch-size search to
    choose again) load with those settings as the intent they were: the same mode and kernels at their batch, those
    of another batch there, and no decision left in ``extra``. Without the notes, concrete values stay as written."""
    base = base_config("full", family="stable_diffusion", data_root="/data", device="cuda")
    cfg = apply_recipe("accelerated", base)
    assert (cfg.compile_mode, cfg.kernel_ops, cfg.batch_size) == ("auto", "auto", 8)
    written = cfg.to_sections()
    written["compile"]["compile_mode"], written["kernels"]["kernel_ops"] = "reduce-overhead", "geglu"
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**written, "extra": {**written["extra"], "block_graphs_by_batch": True,
                                                     "small_step_switches": {"kernel_ops": "geglu"}}}))
    loaded = RunConfig.load(old)
    assert loaded == cfg and (loaded.resolved_compile_mode, loaded.kernel_op_names) == ("reduce-overhead", ("geglu",))
    large = loaded.replace(batch_size=64)
    assert (large.resolved_compile_mode, large.kernel_op_names) == ("default", ("geglu", "group_norm_silu"))
    concrete = tmp_path / "concrete.json"
    concrete.write_text(json.dumps(written))
    named = RunConfig.load(concrete).replace(batch_size=64)
    assert (named.compile_mode, named.kernel_op_names) == ("reduce-overhead", ("geglu",))


def test_auto_is_a_choice_resolved_for_the_step():
    """``compile_mode='auto'`` and ``kernel_ops='auto'`` are accepted, from ``--set`` too, and resolve from the
    config alone: CUDA graphs where the family's step is small enough and they can replay."""
    cfg = micro(**parse_overrides(["compile=true", "compile_mode=auto", "kernels=true", "kernel_ops=auto"]))
    assert (cfg.compile_mode, cfg.resolved_compile_mode, cfg.cuda_graphs) == ("auto", "reduce-overhead", True)
    assert cfg.kernel_op_names == ("group_norm_silu", "layer_norm", "geglu")  # Swin names no kernels: all
    accumulated = cfg.replace(gradient_accumulation_steps=2)  # no error: auto leaves out what cannot replay
    assert (accumulated.resolved_compile_mode, accumulated.cuda_graphs) == ("default", False)
    assert not cfg.replace(compile=False).cuda_graphs
    with pytest.raises(ConfigError, match=r"compile_mode='auto' \('reduce-overhead' at batch 8\) captures CUDA graphs"):
        validate_for_machine(cfg, cuda_devices=0)
    with pytest.raises(ConfigError, match="compile_mode='fast' is not known: choose one of default, .*, auto"):
        micro(compile_mode="fast")
    with pytest.raises(ConfigError, match="kernel_ops='fast' is invalid: expected 'all', 'auto' or a comma list"):
        micro(kernel_ops="fast")
    with pytest.raises(ValueError, match="kernel_ops='auto' is resolved for the step"):
        Kernels(kernel_ops="auto").kernel_op_names  # the section alone knows no step


# a flat file of 552a0d8 loads them at their defaults
ADDED_SINCE_THE_FIXTURES = {"clip_in_optimizer", "ema_in_optimizer", "compile_whole", "memory_plan", "gpu_memory_gib",
                            "ema_offload", "foreach_optimizer"}


def test_every_field_has_one_section_and_keeps_its_flat_name():
    old = json.loads((FIXTURES / "flat_config_swin_micro.json").read_text())
    core = set(old) - set(task_setting_names())
    # the fields of 552a0d8, none lost or renamed, and those added since
    assert core_field_names() == core | {"options"} | ADDED_SINCE_THE_FIXTURES
    assert set(SECTION_OF) == (core | ADDED_SINCE_THE_FIXTURES) - {"extra"}
    assert sum(len(dataclasses.fields(cls)) for cls in SECTION_TYPES.values()) == len(SECTION_OF)


def test_dotted_names_are_aliases_of_the_flat_ones():
    cfg = micro(lr=1e-3, compile=True, mixup_alpha=0.2)
    assert micro(**{"optimizer.lr": 1e-3, "compile.compile": True, "options.mixup_alpha": 0.2}) == cfg
    assert micro(optimizer={"lr": 1e-3}, compile={"compile": True}, options={"mixup_alpha": 0.2}) == cfg
    assert cfg.sections.optimizer.lr == cfg.lr == 1e-3 and cfg.sections.compile.compile is cfg.compile is True
    assert cfg.optimizer == "adamw" and cfg.sections.optimizer.optimizer == "adamw"
    assert cfg.replace(**{"optimizer.lr": 2e-3}) == cfg.replace(lr=2e-3) and cfg.replace(lr=2e-3).lr == 2e-3
    assert dataclasses.replace(cfg, lr=2e-3, mixup_alpha=0) == cfg.replace(lr=2e-3, mixup_alpha=0)
    assert parse_overrides(["optimizer.lr=1e-3", "lr_warmup_steps=2", "options.mixup_alpha=0"]) == {
        "lr": 1e-3, "lr_warmup_steps": 2, "mixup_alpha": 0}
    with pytest.raises(ConfigError, match=r"training\.lr=0\.1: lr is optimizer\.lr"):
        micro(**{"training.lr": 0.1})
    with pytest.raises(ConfigError, match="job has no field 'mixup_alpha'"):
        micro(**{"job.mixup_alpha": 0})
    with pytest.raises(ConfigError, match="there is no section 'optimiser'"):
        micro(**{"optimiser.lr": 0.1})
    with pytest.raises(ConfigError, match=r"lr is given twice \(0\.1 and 0\.2\)"):
        micro(lr=0.1, **{"optimizer.lr": 0.2})
    with pytest.raises(ConfigError, match="there is no setting 'optimizer.lrr'; did you mean optimizer.lr"):
        parse_overrides(["optimizer.lrr=1"])


def test_each_section_checks_its_own_rules():
    """A section's rules hold wherever it is built; those that tie sections together are RunConfig's."""
    with pytest.raises(ConfigError, match="leave at least one timed step"):
        Training(steps=4, warmup_steps=4)
    with pytest.raises(ConfigError, match="needs compile=True and compile_scope='blocks'"):
        Compile(precompile_workers=2)
    with pytest.raises(ConfigError, match="ema_stream_programs=8 .* set ema='stream'"):
        EMA(ema="fused", ema_stream_programs=8)
    assert Kernels(kernels=True, kernel_ops="geglu, layer_norm").kernel_op_names == ("geglu", "layer_norm")
    with pytest.raises(ConfigError, match="find_batch_size=True is invalid with nproc_per_node=2"):
        micro(find_batch_size=True, nproc_per_node=2)
