"""Stable Diffusion 1.x parts: SD-1.5 sizes, a CPU training step on the tiny variant, the offline tokenizer,
loading a diffusers-layout folder, and the inference pipeline with its save/load round trip."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from gallery_lib.models import sd_parts as sd  # noqa: E402
from gallery_lib.models.offline_tokenizer import (  # noqa: E402
    CAPTION_WORDS, END_TOKEN, OFFLINE_VOCAB_SIZE, START_TOKEN, build_offline_clip_tokenizer, is_offline_tokenizer)

CAPTIONS = ["a photo of sks dog", "A painting of a RED house at night, très sombre 日本 #42"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return sd.build_stable_diffusion("sd_tiny")


def _count(module: torch.nn.Module) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), len(params)


def test_sd15_sizes_on_meta_device():
    with torch.device("meta"):
        unet, vae, text_encoder = sd.build_unet("sd15"), sd.build_vae("sd15"), sd.build_text_encoder("sd15")
    assert next(unet.parameters()).is_meta
    assert _count(unet) == (859_520_964, 686)
    assert _count(vae)[0] == 83_653_863
    assert _count(text_encoder)[0] == 123_060_480
    assert vae.config.scaling_factor == 0.18215
    assert text_encoder.config.vocab_size == 49408 and text_encoder.config.max_position_embeddings == 77


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="sd15, sd_tiny"):
        sd.build_stable_diffusion("sd21")
    with pytest.raises(ValueError, match="epsilon, v_prediction"):
        sd.build_stable_diffusion("sd_tiny", prediction_type="sample")
    with pytest.raises(ValueError, match="multiple of 4"):
        sd.build_stable_diffusion("sd_tiny", image_size=30)
    with pytest.raises(ValueError, match="multiple of 64 .*e.g. 512"):  # checked before the 860M-parameter build
        sd.build_stable_diffusion("sd15", image_size=500)
    with pytest.raises(TypeError, match=r"\[caption\]"):
        sd.tokenize(build_offline_clip_tokenizer(), "a dog")


def test_tiny_parts_layout(tiny):
    assert tiny.offline_tokenizer and tiny.source == "random init (sd_tiny config)"
    assert tiny.latent_downsample == 2 and tiny.vae_scale_factor == pytest.approx(0.18215)
    assert tiny.image_size == 32
    assert tiny.unet.training and not tiny.vae.training and not tiny.text_encoder.training
    assert not any(p.requires_grad for p in [*tiny.vae.parameters(), *tiny.text_encoder.parameters()])
    assert tiny.noise_scheduler.config.prediction_type == "epsilon"
    assert tiny.noise_scheduler.config.beta_schedule == "scaled_linear"
    assert sd.build_stable_diffusion("sd_tiny", image_size=48).unet.config.sample_size == 24


def test_random_weights_are_drawn_on_the_init_device():
    """On a GPU the trainer draws them there (sd15's take about 15 s on a CPU); ``meta`` shows every weight and
    buffer is made on the device given, none on the CPU and moved."""
    parts = sd.build_stable_diffusion("sd_tiny", init_device="meta")
    for module in (parts.unet, parts.vae, parts.text_encoder):
        assert {t.device.type for t in [*module.parameters(), *module.buffers()]} == {"meta"}
    assert parts.noise_scheduler.alphas_cumprod.device.type == "cpu"  # not a weight: as a loaded schedule
    assert {p.device.type for p in sd.build_stable_diffusion("sd_tiny").unet.parameters()} == {"cpu"}


def _training_step(parts: sd.StableDiffusionParts, pixels: torch.Tensor, captions: list[str]) -> torch.Tensor:
    with torch.no_grad():
        latents = parts.vae.encode(pixels).latent_dist.sample() * parts.vae_scale_factor
        text = parts.text_encoder(sd.tokenize(parts.tokenizer, captions))[0]
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, parts.noise_scheduler.config.num_train_timesteps, (len(pixels),))
    noisy = parts.noise_scheduler.add_noise(latents, noise, timesteps)
    prediction = parts.unet(noisy, timesteps, text).sample
    loss = F.mse_loss(prediction, sd.training_target(parts.noise_scheduler, latents, noise, timesteps))
    loss.backward()
    return loss


def test_tiny_training_step_trains_only_the_unet():
    parts = sd.build_stable_diffusion("sd_tiny")
    pixels = torch.rand(4, 3, 32, 32) * 2 - 1
    captions = ["a photo of a dog", "a red car", "a painting of a tree", "sks cat"]
    loss = _training_step(parts, pixels, captions)
    assert torch.isfinite(loss)
    unet_grads = [p.grad for p in parts.unet.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in unet_grads)
    assert any(g.abs().sum() > 0 for g in unet_grads)
    assert all(p.grad is None for p in [*parts.vae.parameters(), *parts.text_encoder.parameters()])

    # Timed on one thread: on a shared 2-core machine, two OpenMP threads competing with other processes can be
    # 10x slower than one (measured 0.07 s per step on one thread, 0.2-7 s on two under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(3):
            parts.unet.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _training_step(parts, pixels, captions)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert statistics.median(times) < 1.0, f"tiny SD steps took {times} s on one CPU thread"


def test_v_prediction_target_is_the_velocity():
    parts = sd.build_stable_diffusion("sd_tiny", prediction_type="v_prediction")
    scheduler = parts.noise_scheduler
    assert scheduler.config.prediction_type == "v_prediction"
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([10, 900])
    target = sd.training_target(scheduler, latents, noise, timesteps)
    torch.testing.assert_close(target, scheduler.get_velocity(latents, noise, timesteps))
    # v = sqrt(abar) * noise - sqrt(1 - abar) * x0, computed here from the betas
    abar = torch.cumprod(1 - scheduler.betas, 0)[timesteps].view(-1, 1, 1, 1)
    torch.testing.assert_close(target, abar.sqrt() * noise - (1 - abar).sqrt() * latents)
    assert sd.assemble_pipeline(parts).scheduler.config.prediction_type == "v_prediction"


def test_epsilon_target_is_the_noise(tiny):
    noise = torch.randn(2, 4, 8, 8)
    assert sd.training_target(tiny.noise_scheduler, torch.randn(2, 4, 8, 8), noise, torch.tensor([1, 2])) is noise


def test_offline_tokenizer_ids(tmp_path):
    tokenizer = build_offline_clip_tokenizer()
    ids = sd.tokenize(tokenizer, CAPTIONS)
    start, end = tokenizer.convert_tokens_to_ids([START_TOKEN, END_TOKEN])
    assert ids.dtype == torch.long and ids.shape == (2, 77) and tokenizer.model_max_length == 77
    assert len(tokenizer) == OFFLINE_VOCAB_SIZE <= sd.TINY_TEXT_CONFIG["vocab_size"]
    assert int(ids.max()) < OFFLINE_VOCAB_SIZE and (start, end) == (OFFLINE_VOCAB_SIZE - 2, OFFLINE_VOCAB_SIZE - 1)
    assert (ids[:, 0] == start).all()
    for row in ids.tolist():  # content, then the end token padding to 77: no byte fell back to the unknown token
        first_end = row.index(end)
        assert first_end > 1 and all(t not in (start, end) for t in row[1:first_end])
        assert all(t == end for t in row[first_end:])
    assert not torch.equal(ids[0], ids[1])
    assert torch.equal(ids, sd.tokenize(build_offline_clip_tokenizer(), CAPTIONS))  # deterministic across builds
    assert all(len(tokenizer(w, add_special_tokens=False).input_ids) == 1 for w in CAPTION_WORDS)
    assert tokenizer.decode(ids[1], skip_special_tokens=True).startswith("a painting of a red house at night")

    long_ids = sd.tokenize(tokenizer, ["dog " * 200])
    assert long_ids.shape == (1, 77) and long_ids[0, -1] == end

    tokenizer.save_pretrained(tmp_path)
    reloaded = type(tokenizer).from_pretrained(tmp_path)
    assert reloaded.model_max_length == 77 and is_offline_tokenizer(reloaded)
    assert torch.equal(sd.tokenize(reloaded, CAPTIONS), ids)


def _save_diffusers_layout(parts: sd.StableDiffusionParts, folder, *, tokenizer: bool) -> None:
    parts.unet.save_pretrained(folder / "unet")
    parts.vae.save_pretrained(folder / "vae")
    parts.text_encoder.save_pretrained(folder / "text_encoder")
    parts.noise_scheduler.save_pretrained(folder / "scheduler")
    if tokenizer:
        parts.tokenizer.save_pretrained(folder / "tokenizer")


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_local_folder_loads_the_same_parts(tiny, tmp_path):
    _save_diffusers_layout(tiny, tmp_path, tokenizer=True)
    loaded = sd.build_stable_diffusion("sd_tiny", pretrained=str(tmp_path), prediction_type="v_prediction")
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(tiny, name), getattr(loaded, name))
    assert loaded.source == f"local folder {tmp_path.resolve()}"
    assert loaded.offline_tokenizer  # the folder's tokenizer/ holds the stand-in saved from the random-init parts
    assert torch.equal(sd.tokenize(loaded.tokenizer, CAPTIONS), sd.tokenize(tiny.tokenizer, CAPTIONS))
    assert loaded.noise_scheduler.config.prediction_type == "v_prediction"
    assert not loaded.vae.training and not any(p.requires_grad for p in loaded.text_encoder.parameters())


def test_folder_tokenizer_is_used_and_the_stand_in_fills_a_missing_one(tiny, tmp_path):
    _save_diffusers_layout(tiny, tmp_path, tokenizer=False)
    loaded = sd.build_stable_diffusion("sd_tiny", pretrained=tmp_path)
    assert loaded.offline_tokenizer and is_offline_tokenizer(loaded.tokenizer)

    own_tokenizer = build_offline_clip_tokenizer()
    own_tokenizer.add_tokens(["<sks-token>"])  # any vocabulary other than the stand-in's
    own_tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded = sd.build_stable_diffusion("sd_tiny", pretrained=tmp_path)
    assert not loaded.offline_tokenizer and len(loaded.tokenizer) == OFFLINE_VOCAB_SIZE + 1


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")  # diffusers' hub call
def test_bad_pretrained_locations(tiny, tmp_path, monkeypatch):
    tiny.vae.save_pretrained(tmp_path / "vae")
    with pytest.raises(FileNotFoundError, match="has no unet/, text_encoder/"):
        sd.build_stable_diffusion("sd15", pretrained=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sd.build_stable_diffusion("sd15", pretrained=tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="diffusers layout"):
        sd.build_stable_diffusion("sd15", pretrained=str(tmp_path / "weights.bin"))

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying
    with pytest.raises(OSError, match="no network access") as info:
        sd.build_stable_diffusion("sd15", pretrained="gallery-tests/no-such-model")
    assert "'gallery-tests/no-such-model'" in str(info.value) and "pass the local folder" in str(info.value)


def test_pipeline_samples_and_round_trips(tiny, tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = sd.assemble_pipeline(tiny, unet=torch.compile(tiny.unet))  # the compile wrapper is removed
    assert pipe.unet is tiny.unet and isinstance(pipe.scheduler, DDIMScheduler)
    assert pipe.scheduler.config.steps_offset == 1 and not pipe.scheduler.config.set_alpha_to_one
    images = pipe(CAPTIONS, num_inference_steps=2, height=32, width=32, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (2, 32, 32, 3) and (images >= 0).all() and (images <= 1).all()

    pipe.save_pretrained(tmp_path)
    reloaded = StableDiffusionPipeline.from_pretrained(tmp_path)
    assert type(reloaded.tokenizer).__name__ == "CLIPTokenizer" and reloaded.safety_checker is None
    assert torch.equal(sd.tokenize(reloaded.tokenizer, CAPTIONS), sd.tokenize(tiny.tokenizer, CAPTIONS))
    _assert_same_weights(reloaded.unet, tiny.unet)
    assert sd.build_stable_diffusion("sd_tiny", pretrained=tmp_path).offline_tokenizer

    with pytest.raises(ValueError, match="ddim, ddpm"):
        sd.assemble_pipeline(tiny, scheduler="lms")
    with pytest.raises(TypeError, match="UNet2DConditionModel"):
        sd.assemble_pipeline(tiny, unet=torch.nn.Linear(2, 2))
