"""What ``gallery bench --timm-model`` and ``--diffusers-model`` train: a model built by name with random weights, the
random batches made once for it, how it is called on a batch, and its loss.

- a timm classifier: images and labels, cross-entropy over the logits;
- a diffusers denoiser (``UNet2DModel``, ``DiTTransformer2DModel``): noised latents (or images), a timestep per sample
  and, where the model is class-conditional, a class per sample; the mean squared error against the noise, as
  diffusers' training scripts have it (epsilon prediction).
"""

from __future__ import annotations

import difflib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gallery_lib.config import ConfigError

CLASSES = 1000
"""A timm classifier's head, and a class-conditional denoiser's classes where its config names none."""
DENOISERS = ("UNet2DModel", "DiTTransformer2DModel")
"""The diffusers classes the bench builds: called with noised samples and timesteps (and classes), they predict the
noise at the sample's shape. Text-conditioned ones (``UNet2DConditionModel``) are the SD family's."""
CPU_CONFIGS = {
    "UNet2DModel": {"block_out_channels": [8, 16], "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
                    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1, "norm_num_groups": 4},
    "DiTTransformer2DModel": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8,
                              "norm_num_groups": 4},
}
"""Each class's layout at a size a CPU trains in seconds, where no ``--model-config`` is given (the default configs,
DiT-XL/2's 675M parameters among them, are GPU models): there the bench checks the code path, not speed."""


@dataclass(frozen=True)
class Batch:
    """One training batch: what the model is called with (keyword arguments) and what its output is compared to."""

    inputs: dict[str, torch.Tensor]
    target: torch.Tensor


@dataclass(frozen=True)
class Workload:
    """A model the user names: ``kind`` ``timm`` or ``diffusers``, its name, and (diffusers) config values that
    replace the class's defaults."""

    kind: str
    name: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name if self.kind == "timm" else f"diffusers.{self.name}"

    def on(self, device: str) -> Workload:
        """As built on ``device``: a denoiser without ``--model-config`` on a CPU gets its class's ``CPU_CONFIGS``."""
        if self.kind == "diffusers" and device == "cpu" and not self.config:
            return Workload(self.kind, self.name, dict(CPU_CONFIGS[self.name]))
        return self

    def check(self) -> None:
        """``ConfigError`` for a name the library does not know, with the closest it knows, before anything is
        built."""
        if self.kind == "timm":
            _check_timm_name(self.name)
            if self.config:
                raise ConfigError("--model-config is for --diffusers-model: a timm model is built by its name.")
        else:
            _check_denoiser(self.name)
            import diffusers

            known = set(inspect.signature(getattr(diffusers, self.name).__init__).parameters) - {"self"}
            if "sample_size" in self.config:
                raise ConfigError("--model-config sample_size: the sample size is --image-size (the batches are made "
                                  "at it).")
            unknown = sorted(set(self.config) - known)
            if unknown:
                close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(f"--model-config {unknown[0]}: {self.name} has no such config value; {hint}"
                                  f"it takes {', '.join(sorted(known))}.")

    def build(self, image_size: int) -> torch.nn.Module:
        """The model with random weights (seed 0) on the CPU, at ``image_size`` (a denoiser's sample size)."""
        torch.manual_seed(0)
        flag = f"--{self.kind}-model {self.name}"
        try:
            if self.kind == "timm":
                from gallery_lib.models import create_timm_model

                return create_timm_model(self.name, image_size=image_size, num_classes=CLASSES)
            import diffusers

            cls = getattr(diffusers, self.name)
            return cls(**{"sample_size": image_size, **self.config})
        except (TypeError, ValueError, AssertionError, RuntimeError) as exc:  # a size or config it cannot be built at
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{flag}: could not build it at {image_size} px: {reason}") from None

    def batches(self, model: torch.nn.Module, count: int, batch_size: int, image_size: int,
                device: str) -> list[Batch]:
        """``count`` random batches for ``model``, on ``device``, the same for every variant (seeded)."""
        generator = torch.Generator().manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator)

        made = []
        for _ in range(count):
            if self.kind == "timm":
                inputs = {"x": randn(batch_size, 3, image_size, image_size)}
                target = torch.randint(0, CLASSES, (batch_size,), generator=generator)
            else:
                channels = model.config.in_channels
                clean, noise = randn(batch_size, channels, image_size, image_size), randn(batch_size, channels,
                                                                                         image_size, image_size)
                timesteps = torch.randint(0, 1000, (batch_size,), generator=generator)
                alpha = (1 - timesteps.float() / 1000).view(-1, 1, 1, 1)  # a plain schedule: data to noise
                inputs = {_sample_argument(model): alpha.sqrt() * clean + (1 - alpha).sqrt() * noise,
                          "timestep": timesteps}
                classes = _classes(model)
                if classes:
                    inputs["class_labels"] = torch.randint(0, classes, (batch_size,), generator=generator)
                target = noise
            made.append(Batch({k: v.to(device) for k, v in inputs.items()}, target.to(device)))
        return made

    def example(self, batch: Batch) -> Any:
        """What the model is called with (``accelerate``'s ``example``): a classifier's images, a denoiser's keyword
        arguments."""
        if self.kind == "timm":
            return batch.inputs["x"]
        return {**batch.inputs, "return_dict": False}

    def forward(self, model: torch.nn.Module, batch: Batch) -> Any:
        """The model called on ``batch`` as ``accelerate`` calls it: a timm model's logits, a denoiser's tuple."""
        example = self.example(batch)
        return model(**example) if isinstance(example, dict) else model(example)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy for a classifier, the noise's mean squared error for a denoiser (the first of its outputs);
        in fp32 either way."""
        if self.kind == "timm":
            return F.cross_entropy(output.float(), target)
        return F.mse_loss(output[0].float(), target.float())


def parse_model_config(assignments: list[str]) -> dict[str, Any]:
    """``["num_layers=12", "block_out_channels=[64,128]"]`` -> ``{"num_layers": 12, "block_out_channels": [64, 128]}``
    (``--model-config``): each value read as JSON where it is JSON, else kept as text."""
    config = {}
    for item in assignments:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ConfigError(f"--model-config {item!r} is invalid: expected KEY=VALUE, e.g. --model-config "
                              "num_layers=12.")
        try:
            config[key] = json.loads(text)
        except json.JSONDecodeError:
            config[key] = text
    return config


def _check_timm_name(name: str) -> None:
    try:
        import timm
    except ImportError:
        raise ConfigError("--timm-model needs timm: pip install timm") from None
    if timm.is_model(name):
        return
    names = timm.list_models()
    family = [n for n in names if n.startswith(name.split("_")[0])]  # 'resnet_typo': a resnet, not tresnet_m
    close = (difflib.get_close_matches(name, family, n=3, cutoff=0.5)
             or difflib.get_close_matches(name, names, n=3, cutoff=0.6))
    hint = (f"did you mean {' or '.join(close)}?" if close else
            "timm.list_models('*resnet*') lists the names matching a pattern")
    raise ConfigError(f"--timm-model {name!r} is no timm model; {hint}")


def _check_denoiser(name: str) -> None:
    if name in DENOISERS:
        try:
            import diffusers  # noqa: F401
        except ImportError:
            raise ConfigError("--diffusers-model needs diffusers: pip install diffusers") from None
        return
    close = difflib.get_close_matches(name, DENOISERS, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"--diffusers-model {name!r}: {hint}the bench builds {', '.join(DENOISERS)} (a noised sample "
                      "and a timestep in, the noise out); SD's UNet is the stable_diffusion family's.")


def _sample_argument(model: torch.nn.Module) -> str:
    """The name of the forward's first argument: ``sample`` for a UNet, ``hidden_states`` for a DiT."""
    return next(iter(inspect.signature(model.forward).parameters))


def _classes(model: torch.nn.Module) -> int:
    """How many classes a class-conditional denoiser embeds (0: none)."""
    config = model.config
    return getattr(config, "num_class_embeds", None) or getattr(config, "num_embeds_ada_norm", None) or 0
