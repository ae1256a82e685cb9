"""DreamBooth: teach Stable Diffusion one subject from a few pictures, as diffusers' ``train_dreambooth.py`` does.

Every step trains on the subject's pictures captioned with the instance prompt ("a photo of sks dog": ``sks`` is a
rare token that comes to mean this one dog) and, with prior preservation, on as many pictures of the class captioned
with the class prompt ("a photo of dog"), so the model keeps what a dog in general looks like. The batch is the
instance half followed by the class half; the loss is the instance half's MSE plus ``prior_loss_weight`` times the
class half's. The UNet trains (fully, or through LoRA adapters with ``lora_rank``, as ``train_dreambooth_lora.py``);
``train_text_encoder`` trains the CLIP text encoder too. Everything else (the frozen VAE, the DDPM noise, the target)
is text-to-image training (``text_to_image.py``), whose step this task reuses.

``cache_latents`` encodes every picture once before training, and with a frozen text encoder both prompts once:
the same function, as for text-to-image. The exported model is a diffusers pipeline folder (full fine-tuning) or
LoRA weights in the diffusers format (``pytorch_lora_weights.safetensors``), which ``pipe.load_lora_weights`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gallery_lib.config.sections import Data, Job
from gallery_lib.config.sections.training import Training as TrainingSettings
from gallery_lib.config.settings import ConfigError, setting
from gallery_lib.tasks.text_to_image import TextToImageOptions, TextToImageTask, _no_progress_bars

if TYPE_CHECKING:
    from gallery_lib.config.family import ModelFamily

INSTANCE_FOLDER, CLASS_FOLDER = "instance", "class"
LORA_TARGETS = {"unet": ("to_k", "to_q", "to_v", "to_out.0"), "text_encoder": ("q_proj", "k_proj", "v_proj",
                                                                                "out_proj")}
"""The layers LoRA adapts, as diffusers' DreamBooth LoRA script: the attention projections."""


@dataclass(frozen=True, kw_only=True)
class DreamBoothOptions(TextToImageOptions):
    """The settings of DreamBooth runs, named as diffusers' ``train_dreambooth.py`` arguments."""

    instance_prompt: str = setting("a photo of sks dog", kind=str)
    """The caption of every subject picture; it must contain ``identifier``."""
    class_prompt: str = setting("a photo of dog", kind=str)
    """The caption of every class picture (prior preservation)."""
    identifier: str = setting("sks", kind=str)
    """The rare token that names the subject: a word of the instance prompt, not of the class prompt."""
    instance_data_dir: str | None = setting(None, kind=str, optional=True)
    """The folder of subject pictures; ``None``: ``<data_dir>/instance``."""
    class_data_dir: str | None = setting(None, kind=str, optional=True)
    """The folder of class pictures; ``None``: ``<data_dir>/class``."""
    with_prior_preservation: bool = setting(True, kind=bool)
    prior_loss_weight: float = setting(1.0, kind=float, minimum=0.0)
    num_class_images: int = setting(100, kind=int, minimum=1)
    """Class pictures used (the first ones by file name); the class folder must hold at least this many."""
    train_text_encoder: bool = setting(False, kind=bool)
    lora_rank: int = setting(0, kind=int, minimum=0)
    """0: full fine-tuning; ``r > 0``: LoRA adapters of rank ``r`` (alpha ``r``) on the attention projections."""

    resume_fields = ("prediction_type", "lora_rank", "train_text_encoder", "with_prior_preservation")

    def check(self, *, training: TrainingSettings) -> None:
        """The rules among these settings (the prompts and the identifier); none ties them to the run's ``training``
        settings."""
        if self.identifier not in self.instance_prompt.split():
            raise ConfigError(f"instance_prompt={self.instance_prompt!r} does not contain the identifier "
                              f"{self.identifier!r}: the subject is learnt under that word, e.g. "
                              f"instance_prompt='a photo of {self.identifier} dog' (or set identifier=).")
        if self.with_prior_preservation and self.identifier in self.class_prompt.split():
            raise ConfigError(f"class_prompt={self.class_prompt!r} contains the identifier {self.identifier!r}: the "
                              "class prompt describes any member of the class, e.g. 'a photo of dog'.")


def instance_dir(options: DreamBoothOptions, data_dir: str) -> Path:
    """The folder of subject pictures: ``options.instance_data_dir``, else ``<data_dir>/instance``."""
    return Path(options.instance_data_dir or Path(data_dir) / INSTANCE_FOLDER)


def class_dir(options: DreamBoothOptions, data_dir: str) -> Path:
    """The folder of class pictures: ``options.class_data_dir``, else ``<data_dir>/class``."""
    return Path(options.class_data_dir or Path(data_dir) / CLASS_FOLDER)


class UNetWithTextEncoder(torch.nn.Module):
    """The trained pair when the text encoder trains too: ``(noisy latents, timesteps, token ids) -> (prediction,)``."""

    def __init__(self, unet: torch.nn.Module, text_encoder: torch.nn.Module) -> None:
        super().__init__()
        self.unet, self.text_encoder = unet, text_encoder

    def forward(self, sample, timestep, input_ids, return_dict: bool = False):
        context = self.text_encoder(input_ids, return_dict=False)[0]
        return self.unet(sample, timestep, context, return_dict=False)


class DreamBoothTask(TextToImageTask):
    name = "dreambooth"
    options = DreamBoothOptions

    def __init__(self, dist, precision, *, family: ModelFamily, job: Job, data: Data, options: DreamBoothOptions,
                 batch_size: int, channels_last: bool, pretrained: str | None) -> None:
        """The SD parts of ``job.model`` (``family``; from the ``pretrained`` weights, when given), what trains of
        them, and the loader of the subject's pictures (with prior preservation, the class's too), ``batch_size`` of
        each per batch, as the task's ``options`` and the ``data`` section say (channels-last with
        ``channels_last``)."""
        from gallery_lib.data.captions import caption_image_transform
        from gallery_lib.data.dreambooth import DreamBoothPairs, ImageFiles
        from gallery_lib.models.sd_parts import tokenize

        self._build_parts(dist, precision, family=family, job=job, data=data, options=options, batch_size=batch_size,
                          channels_last=channels_last, pretrained=pretrained)
        unet, text_encoder = self.parts.unet, self.parts.text_encoder
        if options.lora_rank:
            _add_lora(unet, options.lora_rank, LORA_TARGETS["unet"])
            if options.train_text_encoder:
                _add_lora(text_encoder, options.lora_rank, LORA_TARGETS["text_encoder"])
        elif options.train_text_encoder:
            text_encoder.requires_grad_(True)
        if options.train_text_encoder:  # trained: fp32 weights under autocast, like the UNet
            self.model = UNetWithTextEncoder(unet, text_encoder.train()).to(self.device)
        else:
            text_encoder.to(self.device, dtype=self.frozen_dtype)
            self.model = unet.to(self.device)
        self.model.train()

        transform = caption_image_transform(data.image_size, center_crop=True)
        prior = options.with_prior_preservation
        self.dataset = DreamBoothPairs(ImageFiles(instance_dir(options, data.data_dir), transform),
                                       ImageFiles(class_dir(options, data.data_dir), transform,
                                                  limit=options.num_class_images) if prior else None)
        prompts = [options.instance_prompt] + ([options.class_prompt] if prior else [])
        # The batch's token ids: the instance prompt for its first half, the class prompt for the second.
        self.input_ids = tokenize(self.parts.tokenizer, prompts).repeat_interleave(batch_size, 0).to(self.device)
        self._build_loader(self.dataset, dist)

    # ----------------------------------------------------------------- batches
    def _pair_pixels(self, instance: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """The batch's images: the instance half, then (with prior preservation) the class half."""
        return self._pixels(torch.cat([instance, other]) if self.settings.with_prior_preservation else instance)

    def _to_device(self, batch) -> dict[str, torch.Tensor]:
        instance, other, _ = batch
        return {"pixels": self._pair_pixels(instance, other), "input_ids": self.input_ids}

    def _from_cache(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        indices = indices.to(self.device, non_blocking=True)
        # (batch, halves, ...) -> the instance half, then the class half
        mean, std = (t[indices].transpose(0, 1).flatten(0, 1) for t in (self._mean, self._std))
        return {"latent_mean": mean, "latent_std": std, "context": self._context}

    @torch.no_grad()
    def _encode(self, pixels: torch.Tensor, input_ids: torch.Tensor):
        """The latent distribution of ``pixels`` and the conditioning: the prompts' embeddings, or their token ids
        when the text encoder trains (it then runs inside the trained module)."""
        latent = self.parts.vae.encode(pixels).latent_dist
        if self.settings.train_text_encoder:
            return latent.mean, latent.std, input_ids
        return latent.mean, latent.std, self.parts.text_encoder(input_ids, return_dict=False)[0]

    @torch.no_grad()
    def _cache(self, batches) -> None:
        """Encodes every example of the epoch-0 ``batches`` once, and the prompts once."""
        means, stds = [], []
        halves = 2 if self.settings.with_prior_preservation else 1
        for instance, other, _ in batches:
            pixels = self._pair_pixels(instance, other)
            latent = self.parts.vae.encode(pixels).latent_dist
            # stored per example as (instance, class): (n, halves, C, h, w)
            means.append(latent.mean.unflatten(0, (halves, -1)).transpose(0, 1))
            stds.append(latent.std.unflatten(0, (halves, -1)).transpose(0, 1))
        self._mean, self._std = torch.cat(means), torch.cat(stds)
        self._context = self._encode_prompts()

    def _encode_prompts(self) -> torch.Tensor:
        """The batch's conditioning: each prompt encoded once and repeated (token ids when the text encoder trains)."""
        if self.settings.train_text_encoder:
            return self.input_ids
        distinct = self.input_ids[::self.batch_size]
        return self.parts.text_encoder(distinct, return_dict=False)[0].repeat_interleave(self.batch_size, 0)

    # ----------------------------------------------------------------- the step
    def loss(self, module: torch.nn.Module, batch: dict[str, torch.Tensor], precision) -> torch.Tensor:
        prediction, target = self._denoise(module, batch, precision)
        prediction, target = prediction.float(), target.float()
        if not self.settings.with_prior_preservation:
            return F.mse_loss(prediction, target, reduction="mean")
        (prediction, prior_prediction), (target, prior_target) = prediction.chunk(2), target.chunk(2)
        prior_loss = F.mse_loss(prior_prediction, prior_target, reduction="mean")
        return F.mse_loss(prediction, target, reduction="mean") + self.settings.prior_loss_weight * prior_loss

    @staticmethod
    def check_data(*, model: str, data_dir: str, options: DreamBoothOptions) -> None:
        """Refuses, before launch, a missing or empty instance folder, and with prior preservation a class folder
        with fewer than ``num_class_images`` pictures (``ConfigError``, saying the fix: how to prepare ``model``'s
        data, or which of the ``options`` to set); the folders are the ``options``' own, else in ``data_dir``."""
        from gallery_lib.data.dreambooth import image_files

        folders = [("instance", instance_dir(options, data_dir), 1, "instance_data_dir")]
        if options.with_prior_preservation:
            folders.append(("class", class_dir(options, data_dir), options.num_class_images, "class_data_dir"))
        for kind, folder, needed, option in folders:
            if not folder.is_dir():
                raise ConfigError(f"no {kind} pictures: {folder} is not a folder. Prepare the mock data with "
                                  f"`gallery prepare --model {model}`, or set {option}= to a folder of images.")
            found = len(image_files(folder))
            if found < needed:
                fix = ("add pictures, or lower num_class_images (diffusers would generate the missing ones with "
                       "the pipeline; the gallery does not)" if kind == "class" else "add pictures of the subject")
                raise ConfigError(f"{folder} holds {found} image file(s); the {kind} folder needs at least {needed}: "
                                  f"{fix}.")

    # ----------------------------------------------------------------- reporting and export
    def describe(self) -> str:
        d, opts = self.dataset, self.settings
        text = f"{len(d.instance)} pictures of {opts.instance_prompt!r}"
        if d.class_images is not None:
            text += (f" and {len(d.class_images)} of {opts.class_prompt!r} (prior preservation, weight "
                     f"{opts.prior_loss_weight:g})")
        trained = "UNet" + (" and text encoder" if opts.train_text_encoder else "")
        how = f"LoRA rank {opts.lora_rank} on the {trained}" if opts.lora_rank else f"the whole {trained}"
        text += f" at {self.data.image_size} px; trains {how}, from {self.parts.source}"
        if self.cache_time_s is not None:
            text += f"; latents and prompt embeddings cached in {self.cache_time_s:.1f} s"
        return text

    def train_flops_per_sample(self) -> float | None:
        """Per example: the UNet's forward + backward for each of its images (two with prior preservation); with
        LoRA the frozen UNet's backward computes input gradients only. The text encoder is not counted."""
        per_image = self._unet_train_flops(frozen_weights=bool(self.settings.lora_rank))
        return per_image * (2 if self.settings.with_prior_preservation else 1) if per_image else None

    def summary(self) -> dict[str, Any]:
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"cache_time_s": self.cache_time_s, "trainable_parameters": trainable,
                "lora_rank": self.settings.lora_rank}

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        return {}  # no held-out score: the report's sample grid shows what the model learned

    def export(self, run_dir: str | Path, model: torch.nn.Module) -> str:
        """Full fine-tuning: a diffusers pipeline folder in ``<run_dir>/pipeline``. LoRA: the adapters (the EMA's
        when there is one) in ``<run_dir>/lora`` and, for a random-init base, the base pipeline in
        ``<run_dir>/pipeline`` to load them into. Returns the folder to load."""
        from gallery_lib.models.sd_parts import assemble_pipeline

        unet, text_encoder = (model.unet, model.text_encoder) if self.settings.train_text_encoder else (model, None)
        self._saved_parts_on_cpu(unet, text_encoder)
        run_dir = Path(run_dir)
        if not self.settings.lora_rank:
            with _no_progress_bars():
                assemble_pipeline(self.parts, unet=unet, text_encoder=text_encoder).save_pretrained(
                    run_dir / "pipeline")
            return str(run_dir / "pipeline")
        save_lora(run_dir / "lora", unet, text_encoder)
        if self.pretrained is None:  # the base the adapters were trained on exists nowhere else
            base_unet = _without_lora(unet)
            base_text = _without_lora(text_encoder) if self.settings.train_text_encoder else None
            with _no_progress_bars():
                assemble_pipeline(self.parts, unet=base_unet, text_encoder=base_text).save_pretrained(
                    run_dir / "pipeline")
        return str(run_dir / "lora")


def _add_lora(model: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> None:
    """Freezes ``model`` and adds trainable LoRA adapters (diffusers' DreamBooth LoRA settings: gaussian init,
    alpha = rank) to its ``targets`` layers; the adapters keep fp32 weights."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(targets)))


def save_lora(folder: Path, unet: torch.nn.Module, text_encoder: torch.nn.Module | None) -> None:
    """The adapters of ``unet`` (and ``text_encoder``) as ``folder/pytorch_lora_weights.safetensors`` in the
    diffusers format, the file ``StableDiffusionPipeline.load_lora_weights(folder)`` reads."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    def layers(model):
        return convert_state_dict_to_diffusers(get_peft_model_state_dict(model)) if model is not None else None

    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=layers(unet),
                                              text_encoder_lora_layers=layers(text_encoder), safe_serialization=True)


def _without_lora(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with each LoRA-wrapped layer replaced by the layer it wraps: the frozen base."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    base = copy.deepcopy(model)
    for name, module in list(base.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent), child, module.get_base_layer())
    base.__dict__.pop("peft_config", None)  # so save_pretrained writes the plain model
    base._hf_peft_config_loaded = False
    return base
