"""Text-to-image training of a latent diffusion model (Stable Diffusion 1.x), as diffusers' ``train_text_to_image.py``.

Per step: encode the images with the frozen VAE (a sample of the latent distribution, times the VAE's scaling
factor), encode the captions with the frozen CLIP text encoder, draw noise and a timestep per image, noise the
latents with the DDPM schedule, and regress the UNet's prediction on the noise (``epsilon``) or on the velocity
(``v_prediction``) with a mean-squared error. Only the UNet trains. As in diffusers, the frozen models are stored in
the mixed-precision dtype and the UNet keeps fp32 weights under autocast.

``cache_latents`` moves the frozen encoders out of the loop: before training, every image is encoded once (the mean
and standard deviation of its latent distribution are kept) and every distinct caption once; each step then draws a
fresh latent sample ``mean + std * randn`` from the cache, the very operation (and random draw) of the online path,
so both train the same function. It saves the VAE encoder (about half the UNet's training FLOPs per image at 512 px),
the text encoder and the image decoding, at the price of a one-off encoding pass reported as ``cache_time_s``.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gallery_lib.data.loader import TrainLoader, SampleSeeded, sampled_loader
from gallery_lib.models.sd_parts import PREDICTION_TYPES, assemble_pipeline, tokenize, training_target
from gallery_lib.config.sections import Data, Job
from gallery_lib.config.sections.training import Training as TrainingSettings
from gallery_lib.config.settings import ConfigError, setting

if TYPE_CHECKING:
    from gallery_lib.config.family import ModelFamily


@dataclass(frozen=True, kw_only=True)
class TextToImageOptions:
    """The settings of latent-diffusion runs."""

    prediction_type: str = setting("epsilon", choices=PREDICTION_TYPES)
    """What the network predicts, ``epsilon`` (the noise; SD 1.x) or ``v_prediction``."""
    cache_latents: bool = setting(False, kind=bool)
    """Encode every image with the frozen VAE and every caption with the frozen text encoder once, before training,
    and train from the cached latent distributions and embeddings (same function: a fresh latent sample is drawn from
    the cached distribution every step). Images are center-cropped, not flipped."""

    resume_fields = ("prediction_type",)
    """Settings a resumed run must share with its checkpoint (beside the run's own)."""

    def check(self, *, training: TrainingSettings) -> None:
        """No rule ties these settings to the run's ``training`` settings."""


class TextToImageTask:
    name = "text-to-image"
    options = TextToImageOptions

    def __init__(self, dist, precision, *, family: ModelFamily, job: Job, data: Data, options: TextToImageOptions,
                 batch_size: int, channels_last: bool, pretrained: str | None) -> None:
        """The SD parts of ``job.model`` (``family``; from the ``pretrained`` weights, when given), the UNet to train,
        and the loader of the ``data`` section's caption folder in batches of ``batch_size``, trained as the task's
        ``options`` say (channels-last with ``channels_last``)."""
        from gallery_lib.data.captions import CaptionFolder, caption_image_transform

        self._build_parts(dist, precision, family=family, job=job, data=data, options=options, batch_size=batch_size,
                          channels_last=channels_last, pretrained=pretrained)
        self.parts.text_encoder.to(self.device, dtype=self.frozen_dtype)
        self.model = self.parts.unet.to(self.device).train()
        self.dataset = CaptionFolder(data.data_dir, split="train",
                                     transform=caption_image_transform(data.image_size, center_crop=True))
        self._build_loader(_Tokenized(self.dataset, self.parts.tokenizer), dist)

    def _build_parts(self, dist, precision, *, family: ModelFamily, job: Job, data: Data,
                     options: TextToImageOptions, batch_size: int, channels_last: bool, pretrained: str | None) -> None:
        """Keeps the run's settings (``__init__``'s arguments); builds the SD parts of ``job.model``, the frozen VAE
        on the device, the noise schedule."""
        self.job, self.data = job, data
        self.settings = options
        """The run's task settings (an instance of ``options``)."""
        self.batch_size, self.channels_last, self.pretrained = batch_size, channels_last, pretrained
        self.device = dist.device
        self.parts = family.build(job.model, pretrained=pretrained, prediction_type=options.prediction_type,
                                  image_size=data.image_size, init_device=self.device)
        # diffusers casts the frozen models to the mixed-precision dtype; the trained UNet keeps fp32 weights.
        self.frozen_dtype = precision.dtype or torch.float32
        # nn.Module.to: diffusers' own .to(dtype) warns of fp32-only modules even when the VAE lists none
        torch.nn.Module.to(self.parts.vae, self.device, dtype=self.frozen_dtype)
        self.noise_scheduler = self.parts.noise_scheduler
        self.scaling_factor = self.parts.vae_scale_factor

    def _build_loader(self, source: torch.utils.data.Dataset, dist) -> None:
        """``self.loader`` over ``source``; with ``cache_latents``, over the indices of the cache ``_cache`` fills
        from ``source`` first."""
        cache_latents = self.settings.cache_latents
        self.cache_time_s = None
        if cache_latents:
            start = time.perf_counter()
            self._cache(self._first_epoch(source))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.cache_time_s = time.perf_counter() - start
            source = _Indices(len(source))
        loader = sampled_loader(source, batch_size=self.batch_size, device=self.device,
                                num_workers=0 if cache_latents else self.data.num_workers, seed=self.job.seed,
                                world_size=dist.world_size, rank=dist.rank)
        self.loader = TrainLoader(loader, self.dataset, finish=self._from_cache if cache_latents else self._to_device)

    def _first_epoch(self, source: torch.utils.data.Dataset) -> torch.utils.data.DataLoader:
        """Every sample of ``source`` in order, each loaded as the training loader loads it in epoch 0."""
        seed = self.job.seed
        # Its own generator: a DataLoader without one draws its worker seed from the global RNG, which would shift
        # every later noise draw against a run that does not cache.
        return torch.utils.data.DataLoader(SampleSeeded(source, seed), batch_size=self.batch_size,
                                           sampler=[(k, 0) for k in range(len(source))],
                                           num_workers=self.data.num_workers,
                                           generator=torch.Generator().manual_seed(seed))

    # ----------------------------------------------------------------- batches
    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images on the device, in the frozen VAE's dtype and in [-1, 1]."""
        pixels = images.to(self.device, non_blocking=True).to(self.frozen_dtype).div_(127.5).sub_(1.0)
        if self.channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return pixels

    def _to_device(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, input_ids, _ = batch
        return {"pixels": self._pixels(images), "input_ids": input_ids.to(self.device, non_blocking=True)}

    def _from_cache(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        indices = indices.to(self.device, non_blocking=True)
        return {"latent_mean": self._mean[indices], "latent_std": self._std[indices],
                "context": self._context[self._caption_of[indices]]}

    @torch.no_grad()
    def _encode(self, pixels: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = self.parts.vae.encode(pixels).latent_dist
        context = self.parts.text_encoder(input_ids, return_dict=False)[0]
        return dist.mean, dist.std, context

    @torch.no_grad()
    def _cache(self, batches) -> None:
        """Encodes every sample of the epoch-0 ``batches`` once; each distinct caption is encoded and stored once."""
        means, stds, caption_of, contexts, seen = [], [], [], [], {}
        for images, input_ids, _ in batches:
            batch = self._to_device((images, input_ids, None))
            keys = [tuple(ids) for ids in input_ids.tolist()]
            new = []  # first occurrences of a caption
            for i, key in enumerate(keys):
                if key not in seen:
                    seen[key] = len(seen)
                    new.append(i)
            mean, std, context = self._encode(batch["pixels"], batch["input_ids"])
            means.append(mean)
            stds.append(std)
            contexts.append(context[new])
            caption_of.extend(seen[key] for key in keys)
        self._mean, self._std = torch.cat(means), torch.cat(stds)
        self._context = torch.cat(contexts)
        self._caption_of = torch.tensor(caption_of, device=self.device)

    # ----------------------------------------------------------------- the step
    @staticmethod
    def check_data(*, model: str, data_dir: str, options: TextToImageOptions) -> None:
        """Refuses, before launch, a missing ``data_dir`` (``FileNotFoundError``) or one that is not a caption folder
        (images with ``metadata.jsonl``; ``ConfigError``), saying how to prepare ``model``'s data. The task's
        ``options`` do not change what its data looks like."""
        from gallery_lib.data.captions import find_caption_folder

        if not Path(data_dir).is_dir():
            raise FileNotFoundError(f"no training data at {data_dir}: prepare mock data there with `gallery prepare "
                                    f"--model {model} --data-dir {shlex.quote(str(data_dir))}`, or pass --data-dir a "
                                    "folder of images with train/metadata.jsonl.")
        try:
            find_caption_folder(Path(data_dir), "train")
        except FileNotFoundError as exc:
            raise ConfigError(f"{model} trains on captioned images: {exc}") from None

    def loss(self, module: torch.nn.Module, batch: dict[str, torch.Tensor], precision) -> torch.Tensor:
        prediction, target = self._denoise(module, batch, precision)
        return F.mse_loss(prediction.float(), target.float(), reduction="mean")

    def _denoise(self, module: torch.nn.Module, batch: dict[str, torch.Tensor],
                 precision) -> tuple[torch.Tensor, torch.Tensor]:
        """The UNet's prediction for freshly noised latents of ``batch``, and what it should have predicted."""
        if "pixels" in batch:
            mean, std, context = self._encode(batch["pixels"], batch["input_ids"])
        else:
            mean, std, context = batch["latent_mean"], batch["latent_std"], batch["context"]
        # DiagonalGaussianDistribution.sample(): the same draw whether the distribution was just computed or cached.
        # Contiguous: a CPU VAE may return channels-last latents, and the cache need not keep that layout (the
        # UNet's kernels, and randn_like, depend on it).
        mean, std = mean.contiguous(), std.contiguous()
        latents = (mean + std * torch.randn(mean.shape, device=mean.device, dtype=mean.dtype)) * self.scaling_factor
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                  device=latents.device).long()
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        target = training_target(self.noise_scheduler, latents, noise, timesteps)
        if self.channels_last:
            noisy = noisy.contiguous(memory_format=torch.channels_last)
        with precision.autocast():
            prediction = module(noisy, timesteps, context, return_dict=False)[0]
        return prediction, target

    # ----------------------------------------------------------------- reporting and export
    def describe(self) -> str:
        text = (f"{len(self.dataset)} captioned images at {self.data.image_size} px, {self.settings.prediction_type} "
                f"prediction, UNet from {self.parts.source}")
        if self.parts.offline_tokenizer:
            text += "; captions tokenized by the offline stand-in CLIP tokenizer (no downloaded vocabulary)"
        if self.cache_time_s is not None:
            text += f"; latents and text embeddings cached in {self.cache_time_s:.1f} s"
        return text

    def train_flops_per_sample(self) -> float | None:
        """UNet forward + backward for one image (the frozen encoders are not counted, as in published SD MFU)."""
        return self._unet_train_flops(frozen_weights=False)

    def _unet_train_flops(self, *, frozen_weights: bool) -> float | None:
        """The UNet's forward + backward FLOPs for one image; ``frozen_weights``: the backward computes only the
        input gradients (LoRA training, whose adapters add a negligible share)."""
        from gallery_lib.models.flops import train_flops_per_sample

        unet = self.parts.unet
        latent = self.data.image_size // self.parts.latent_downsample
        context_shape = (1, self.parts.text_encoder.config.max_position_embeddings,
                         self.parts.text_encoder.config.hidden_size)

        def build() -> torch.nn.Module:
            return type(unet).from_config(unet.config).requires_grad_(not frozen_weights)

        def loss_of(model: torch.nn.Module) -> torch.Tensor:
            sample = torch.randn(1, unet.config.in_channels, latent, latent, requires_grad=frozen_weights)
            return model(sample, torch.tensor([10]), torch.randn(context_shape), return_dict=False)[0].float().sum()
        return train_flops_per_sample(build, loss_of)

    def summary(self) -> dict[str, Any]:
        return {"cache_time_s": self.cache_time_s, "prediction_type": self.settings.prediction_type,
                "offline_tokenizer": self.parts.offline_tokenizer}

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        return {}  # no held-out score: the report's sample grid shows what the model learned

    def export(self, run_dir: str | Path, model: torch.nn.Module) -> str:
        """Saves a diffusers pipeline with the UNet ``model`` (the EMA's when there is one) to ``<run_dir>/pipeline``;
        returns the path."""
        self._saved_parts_on_cpu(model)
        path = Path(run_dir) / "pipeline"
        with _no_progress_bars():  # a bar per saved part, written into the run's log as text
            assemble_pipeline(self.parts, unet=model).save_pretrained(path)
        return str(path)

    def _saved_parts_on_cpu(self, *trained: torch.nn.Module | None) -> None:
        """The parts as a saved pipeline holds them, moved in place: fp32, contiguous (safetensors stores no other
        layout) and on the CPU, where they are written from anyway: the fp32 copies made on the GPU would need memory
        the finished run still holds (its graphs, the optimizer's state), and a run that fits its GPU to the last GiB
        ran out of memory there after its last step."""
        for module in trained:
            if module is not None:
                module.to("cpu", memory_format=torch.contiguous_format)
        torch.nn.Module.to(self.parts.vae, "cpu", torch.float32)
        self.parts.text_encoder.to("cpu", torch.float32)


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


class _Tokenized(torch.utils.data.Dataset):
    """Caption samples as ``(uint8 image, token ids, index)``; tokenizing happens in the loader workers."""

    def __init__(self, dataset, tokenizer) -> None:
        self.dataset, self.tokenizer = dataset, tokenizer

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, k: int):
        image, meta = self.dataset[k]
        return image, tokenize(self.tokenizer, [meta["text"]])[0], meta["index"]


class _Indices(torch.utils.data.Dataset):
    """Sample ``k`` is the number ``k``: with cached latents a batch is the indices into the cache."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> int:
        return k
