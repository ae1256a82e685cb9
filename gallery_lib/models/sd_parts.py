"""Stable Diffusion 1.x parts for the gallery: UNet (trained), VAE and CLIP text encoder (frozen), tokenizer, schedule.

``build_stable_diffusion("sd15")`` builds the SD-1.5 architecture with random weights from the configurations written
out below (no network needed); ``"sd_tiny"`` is the same families at a size that trains on a CPU in smoke runs.
``pretrained=`` loads a local folder in the diffusers layout (``unet/``, ``vae/``, ``text_encoder/``, optional
``tokenizer/`` and ``scheduler/``) or, for a string that is not a path, a Hugging Face Hub id. Without a
``tokenizer/`` folder the offline byte-level CLIP tokenizer stands in (``parts.offline_tokenizer`` says so).
``assemble_pipeline`` turns the parts, or a trained UNet, into a ``StableDiffusionPipeline`` for sampling and saving.
Diffusers and transformers are imported only when something is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

SD_VARIANTS = ("sd15", "sd_tiny")
PREDICTION_TYPES = ("epsilon", "v_prediction")

SD15_UNET_CONFIG: dict[str, Any] = dict(
    sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32, norm_eps=1e-5, act_fn="silu",
    flip_sin_to_cos=True, freq_shift=0, downsample_padding=1, mid_block_scale_factor=1, center_input_sample=False,
)
"""SD-1.5's UNet: 859,520,964 parameters in 686 tensors. ``attention_head_dim=8`` is diffusers' legacy name for
the number of heads (8 heads of 40, 80 and 160 channels)."""

SD15_VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3, out_channels=3, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4,
    norm_num_groups=32, act_fn="silu", sample_size=512, scaling_factor=0.18215,
)
"""The SD-1.x autoencoder (83.65M parameters): 8x downsampling to 4 latent channels."""

SD15_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768,
    # eos_token_id=2 is the legacy value of the released CLIP-L config: the pooled output then takes the position of
    # the highest input id, which is the end token in OpenAI's vocabulary and in the offline one alike.
    bos_token_id=0, eos_token_id=2, pad_token_id=1,
)
"""CLIP ViT-L/14's text transformer (123.06M parameters), the SD-1.x text encoder."""

SD_SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
    # Not DDPM arguments: kept in the config for the DDIM/PNDM inference schedulers built from it, as in SD-1.x.
    set_alpha_to_one=False, steps_offset=1, skip_prk_steps=True,
)
"""The SD-1.x noise schedule, shared by both variants."""

# The tiny variant follows diffusers' own tiny SD test components (32/64 channels, cross-attention width 32).
# Group norms use 8 groups so each group spans several channels, the reduction shape fused GroupNorm kernels see in SD.
TINY_UNET_CONFIG: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
)
TINY_VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
    norm_num_groups=8, sample_size=32, scaling_factor=0.18215,
)
TINY_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=1000, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=32,
    bos_token_id=0, eos_token_id=2, pad_token_id=1,
)

SD15_UNET_PARAMETERS = 859_520_964
"""The SD-1.5 UNet's parameters (``tests/test_memory_plan.py`` counts them on the meta device)."""
_CONFIGS = {"sd15": (SD15_UNET_CONFIG, SD15_VAE_CONFIG, SD15_TEXT_CONFIG),
            "sd_tiny": (TINY_UNET_CONFIG, TINY_VAE_CONFIG, TINY_TEXT_CONFIG)}
_REQUIRED_SUBFOLDERS = ("unet", "vae", "text_encoder")
_INFERENCE_SCHEDULERS = {"ddim": "DDIMScheduler", "ddpm": "DDPMScheduler", "pndm": "PNDMScheduler",
                         "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
                         "dpm_solver": "DPMSolverMultistepScheduler"}


@dataclass
class StableDiffusionParts:
    """The modules of one Stable Diffusion 1.x training run; only the UNet is trained."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    """Frozen: ``requires_grad`` off and in eval mode."""
    text_encoder: CLIPTextModel
    """Frozen, like the VAE."""
    tokenizer: Any
    """A ``transformers.CLIPTokenizer`` (the real one, or the offline stand-in)."""
    noise_scheduler: DDPMScheduler
    """The training noise schedule; its ``prediction_type`` sets the training target."""
    offline_tokenizer: bool
    """True when the tokenizer is the offline byte-level stand-in (built here, or saved by an earlier run)."""
    source: str
    """Where the weights came from: ``random init (<variant> config)``, ``local folder <path>`` or ``hub id <id>``."""

    @property
    def vae_scale_factor(self) -> float:
        """The factor that brings VAE latents to unit variance (0.18215 for SD-1.x)."""
        return float(self.vae.config.scaling_factor)

    @property
    def latent_downsample(self) -> int:
        """How many pixels one latent spans per side (8 for SD-1.x, 2 for ``sd_tiny``)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def image_size(self) -> int:
        """The default training and sampling resolution in pixels."""
        return int(self.unet.config.sample_size) * self.latent_downsample


def _check_variant(variant: str) -> None:
    if variant not in SD_VARIANTS:
        raise ValueError(f"unknown Stable Diffusion variant {variant!r}: choose one of {', '.join(SD_VARIANTS)}.")


def image_size_multiple(variant: str) -> int:
    """What divides the variant's image sizes: pixels per latent times the UNet's own downsampling, so that the skip
    connections line up (64 for SD-1.5)."""
    _check_variant(variant)
    return _image_size_multiple(*_CONFIGS[variant][:2])


def _image_size_multiple(unet_config: Any, vae_config: Any) -> int:
    return 2 ** (len(vae_config["block_out_channels"]) - 1) * 2 ** (len(unet_config["block_out_channels"]) - 1)


def _check_image_size(image_size: int, unet_config: Any, vae_config: Any) -> None:
    multiple = _image_size_multiple(unet_config, vae_config)
    if not isinstance(image_size, int) or image_size <= 0 or image_size % multiple:
        nearest = max(multiple, round(image_size / multiple) * multiple) if isinstance(image_size, int) else multiple
        raise ValueError(f"image_size={image_size!r} must be a positive multiple of {multiple} for this model "
                         f"(VAE downsampling x UNet downsampling), e.g. {nearest}.")


def build_unet(variant: str) -> UNet2DConditionModel:
    """The variant's UNet with random weights (on the current default device, so ``torch.device('meta')`` works)."""
    from diffusers import UNet2DConditionModel

    _check_variant(variant)
    return UNet2DConditionModel(**_CONFIGS[variant][0])


def build_vae(variant: str) -> AutoencoderKL:
    """The variant's autoencoder with random weights."""
    from diffusers import AutoencoderKL

    _check_variant(variant)
    return AutoencoderKL(**_CONFIGS[variant][1])


def build_text_encoder(variant: str) -> CLIPTextModel:
    """The variant's CLIP text encoder with random weights."""
    from transformers import CLIPTextConfig, CLIPTextModel

    _check_variant(variant)
    return CLIPTextModel(CLIPTextConfig(**_CONFIGS[variant][2]))


def _random_parts(variant: str, prediction_type: str, init_device: torch.device | str) -> dict[str, Any]:
    from diffusers import DDPMScheduler

    from gallery_lib.models.offline_tokenizer import build_offline_clip_tokenizer

    with torch.device(init_device):  # the weights only: the noise schedule stays on the CPU, as loaded ones are
        models = dict(unet=build_unet(variant), vae=build_vae(variant), text_encoder=build_text_encoder(variant))
    return dict(models, tokenizer=build_offline_clip_tokenizer(),
                noise_scheduler=DDPMScheduler.from_config(SD_SCHEDULER_CONFIG, prediction_type=prediction_type),
                offline_tokenizer=True, source=f"random init ({variant} config)")


def _load_parts(location: str, prediction_type: str, *, tokenizer: bool, scheduler: bool) -> dict[str, Any]:
    """Loads the parts of a diffusers-layout folder or hub repository; ``tokenizer``/``scheduler``: whether to load."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from gallery_lib.models.offline_tokenizer import build_offline_clip_tokenizer, is_offline_tokenizer

    # fp32 whatever the checkpoint holds: the training recipe decides the precision of each part.
    parts = dict(unet=UNet2DConditionModel.from_pretrained(location, subfolder="unet").float(),
                 vae=AutoencoderKL.from_pretrained(location, subfolder="vae").float(),
                 text_encoder=CLIPTextModel.from_pretrained(location, subfolder="text_encoder").float())
    parts["tokenizer"] = (CLIPTokenizer.from_pretrained(location, subfolder="tokenizer") if tokenizer
                          else build_offline_clip_tokenizer())
    # A stored schedule keeps its betas; the prediction type is this run's choice.
    parts["noise_scheduler"] = (
        DDPMScheduler.from_pretrained(location, subfolder="scheduler", prediction_type=prediction_type) if scheduler
        else DDPMScheduler.from_config(SD_SCHEDULER_CONFIG, prediction_type=prediction_type))
    # A pipeline saved from a run that used the stand-in stores it in tokenizer/: still the offline vocabulary.
    parts["offline_tokenizer"] = is_offline_tokenizer(parts["tokenizer"])
    return parts


def _load_folder(folder: Path, prediction_type: str) -> dict[str, Any]:
    if not folder.is_dir():
        raise NotADirectoryError(f"pretrained={str(folder)!r} is a file; pass a folder in the diffusers layout "
                                 f"({', '.join(s + '/' for s in _REQUIRED_SUBFOLDERS)} and optional tokenizer/).")
    missing = [name + "/" for name in _REQUIRED_SUBFOLDERS if not (folder / name).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"pretrained folder {str(folder)!r} has no {', '.join(missing)}: a Stable Diffusion folder in the "
            "diffusers layout holds unet/, vae/ and text_encoder/ (tokenizer/ and scheduler/ optional), as written "
            "by StableDiffusionPipeline.save_pretrained or huggingface-cli download.")
    parts = _load_parts(str(folder), prediction_type, tokenizer=(folder / "tokenizer").is_dir(),
                        scheduler=(folder / "scheduler").is_dir())
    return dict(parts, source=f"local folder {folder}")


def _load_hub(repo_id: str, prediction_type: str) -> dict[str, Any]:
    try:
        parts = _load_parts(repo_id, prediction_type, tokenizer=True, scheduler=True)
    except (OSError, ValueError) as exc:  # hub errors surface as OSError, malformed ids as ValueError
        raise OSError(
            f"pretrained={repo_id!r} is not an existing folder, so it was read as a Hugging Face Hub id, and loading "
            f"it failed ({type(exc).__name__}: {exc}). If it is a folder, check the path. This machine may have no "
            "network access: download the model where there is (huggingface-cli download <id> --local-dir <folder>) "
            "and pass the local folder; set HF_HUB_OFFLINE=1 to skip the download retries.") from exc
    return dict(parts, source=f"hub id {repo_id}")


def build_stable_diffusion(variant: str, *, pretrained: str | os.PathLike | None = None,
                           prediction_type: str = "epsilon", image_size: int | None = None,
                           init_device: torch.device | str = "cpu") -> StableDiffusionParts:
    """Builds the parts of a Stable Diffusion 1.x training run in fp32, on the CPU or, with random weights, on
    ``init_device``.

    Args:
        variant: ``sd15`` or ``sd_tiny``: the architecture built with random weights when ``pretrained`` is None.
            With ``pretrained``, the folder's or repository's own configurations are used.
        pretrained: A local folder in the diffusers layout, or a Hugging Face Hub id (needs network access).
        prediction_type: What the UNet learns to predict: ``epsilon`` (the noise) or ``v_prediction``.
        image_size: Training resolution in pixels; becomes the UNet's ``sample_size`` (the pipeline's default size).
            Must be a multiple of the total downsampling (64 for SD-1.x) so UNet skip connections line up.
        init_device: Where random weights are drawn: sd15's take about 15 s on a CPU, a few kernels on a GPU (the
            same seed draws other numbers there).
    """
    _check_variant(variant)
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type={prediction_type!r}: choose one of {', '.join(PREDICTION_TYPES)}.")
    if pretrained is None:
        if image_size is not None:  # before the build: sd15 takes a while to initialise on a CPU
            _check_image_size(image_size, *_CONFIGS[variant][:2])
        fields = _random_parts(variant, prediction_type, init_device)
    elif Path(pretrained).expanduser().exists():
        fields = _load_folder(Path(pretrained).expanduser().resolve(), prediction_type)
    elif not isinstance(pretrained, str):
        raise FileNotFoundError(f"pretrained folder {os.fspath(pretrained)!r} does not exist.")
    else:
        fields = _load_hub(pretrained, prediction_type)
    parts = StableDiffusionParts(**fields)

    vocab = parts.text_encoder.config.vocab_size
    if len(parts.tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(parts.tokenizer)} tokens but the text encoder embeds only {vocab}: "
                         "pair the text encoder with its own tokenizer/ folder.")
    if image_size is not None:
        _check_image_size(image_size, parts.unet.config, parts.vae.config)
        parts.unet.register_to_config(sample_size=image_size // parts.latent_downsample)

    parts.vae.requires_grad_(False).eval()
    parts.text_encoder.requires_grad_(False).eval()
    parts.unet.train()
    return parts


def tokenize(tokenizer, captions: list[str]) -> torch.LongTensor:
    """Token ids of ``captions``, shape ``(len(captions), model_max_length)``: padded to full length, truncated."""
    if isinstance(captions, str) or not all(isinstance(c, str) for c in captions):
        raise TypeError(f"captions must be a list of strings, got {type(captions).__name__} "
                        f"{captions!r:.80}: wrap a single caption as [caption].")
    return tokenizer(list(captions), padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def training_target(noise_scheduler: DDPMScheduler, latents: torch.Tensor, noise: torch.Tensor,
                    timesteps: torch.Tensor) -> torch.Tensor:
    """What the UNet is trained to predict for ``noise_scheduler.add_noise(latents, noise, timesteps)``."""
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"noise scheduler prediction_type={prediction_type!r}: "
                     f"choose one of {', '.join(PREDICTION_TYPES)}.")


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The plain module under ``torch.compile`` and DDP wrappers, which the pipeline cannot save."""
    while True:
        if hasattr(module, "_orig_mod"):
            module = module._orig_mod
        elif isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        else:
            return module


def assemble_pipeline(parts: StableDiffusionParts, unet: torch.nn.Module | None = None,
                      scheduler: str = "ddim", text_encoder: torch.nn.Module | None = None) -> StableDiffusionPipeline:
    """A ``StableDiffusionPipeline`` over ``parts`` (or a trained ``unet``) for sampling and ``save_pretrained``.

    Args:
        parts: The run's parts; the VAE, text encoder and tokenizer are shared, not copied.
        unet: The UNet to sample with (e.g. the EMA or trained copy); compiled and DDP wrappers are removed.
        scheduler: The inference sampler, built from the training schedule's config (same betas and prediction type):
            ``ddim``, ``ddpm``, ``pndm``, ``euler``, ``euler_a`` or ``dpm_solver``.
        text_encoder: A trained text encoder in place of the parts' frozen one.
    """
    import diffusers

    if scheduler not in _INFERENCE_SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}: choose one of {', '.join(_INFERENCE_SCHEDULERS)}.")
    unet = _unwrap(unet if unet is not None else parts.unet)
    if not isinstance(unet, diffusers.UNet2DConditionModel):
        raise TypeError(f"unet must be a diffusers UNet2DConditionModel, got {type(unet).__name__}.")
    sampler = getattr(diffusers, _INFERENCE_SCHEDULERS[scheduler]).from_config(parts.noise_scheduler.config)
    text_encoder = _unwrap(text_encoder if text_encoder is not None else parts.text_encoder)
    pipe = diffusers.StableDiffusionPipeline(vae=parts.vae, text_encoder=text_encoder, tokenizer=parts.tokenizer,
                                             unet=unet, scheduler=sampler, safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)  # one tqdm line per step floods papermill outputs
    return pipe
