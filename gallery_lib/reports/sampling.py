"""Sampling from a trained text-to-image run: load the exported diffusers pipeline and draw a grid of images.
The training data is shown the same way (``dataset_preview``, ``dreambooth_preview``).

A run with ``export_model`` saves ``<run_dir>/pipeline`` (the EMA UNet when the run kept an EMA, the frozen VAE and
text encoder, the tokenizer and the scheduler), a plain ``StableDiffusionPipeline`` folder; this module only loads
it and arranges the images with their prompts, so what the notebook shows is what any diffusers user would get.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from gallery_lib.config.run_config import flat_config


def load_pipeline(run_dir: str | os.PathLike, device: str | torch.device | None = None):
    """The pipeline a run exported, on ``device`` (default: CUDA when present), in bf16 on a GPU.

    A LoRA run (``<run_dir>/lora``) is loaded the diffusers way: its base pipeline (``<run_dir>/pipeline`` for a
    random-init base, else the run's ``pretrained`` folder), then ``pipe.load_lora_weights(<run_dir>/lora)``.
    """
    from diffusers import StableDiffusionPipeline

    run_dir = Path(run_dir)
    lora = run_dir / "lora"
    path = run_dir / "pipeline"
    if lora.is_dir() and not path.is_dir():
        path = Path(flat_config(json.loads((run_dir / "config.json").read_text())).get("pretrained") or path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path} holds no exported pipeline: run the recipe with export_model=True "
                                "(the default) to the end first.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = StableDiffusionPipeline.from_pretrained(path, **_dtype_argument(dtype))
    if lora.is_dir():
        pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _dtype_argument(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """diffusers renamed ``from_pretrained``'s ``torch_dtype`` to ``dtype`` (the old name warns, older releases
    know only it)."""
    from diffusers.utils import deprecation_utils

    return {"dtype": dtype} if hasattr(deprecation_utils, "_resolve_dtype") else {"torch_dtype": dtype}


def sample_grid(pipe, prompts: Sequence[str], *, steps: int = 25, guidance_scale: float = 5.0, seed: int = 0,
                size: int | None = None, run_dir: str | os.PathLike | None = None):
    """One image per prompt, tiled with the prompts as titles (a matplotlib figure); seeded, so a call repeats.
    With ``run_dir`` (the run the pipeline came from) the grid says when its weights were random or smoke-trained,
    and also goes to its TensorBoard when it reports there."""
    if not prompts:
        raise ValueError("sample_grid needs at least one prompt")
    grid = image_grid(_draw(pipe, prompts, steps, guidance_scale, seed, size), prompts)
    if run_dir is not None:
        from gallery_lib.run.tensorboard import log_to_run

        note = random_weights_note([_run_config(Path(run_dir))])
        if note:
            grid.suptitle(note, fontsize=9)

        log_to_run(run_dir, "samples", grid)
    return grid


def compare_samples(runs: Mapping[str, Any] | Sequence[str | os.PathLike], prompts: Sequence[str], *,
                    steps: int = 25, guidance_scale: float = 5.0, seed: int = 0, size: int | None = None,
                    save_to: str | os.PathLike | None = None):
    """One row of samples per run, the same prompts and seeds in every row, so the recipes' trained weights sit side
    by side (baseline above accelerated): a matplotlib figure, also saved as ``save_to`` when given.

    ``runs`` is what ``run_recipes`` returned (run name -> result with a ``run_dir``) or a list of run folders. Each
    run's exported pipeline is loaded, sampled and freed in turn; a run that exported none is named in the title.

        compare_samples(results, ["a red circle", "a blue square"])
    """
    if not prompts:
        raise ValueError("compare_samples needs at least one prompt")
    named = ({name: Path(result.run_dir) for name, result in runs.items()} if isinstance(runs, Mapping)
             else {Path(path).name: Path(path) for path in runs})
    images, titles, missing, sampled = [], [], [], []
    for name, run_dir in named.items():
        try:
            pipe = load_pipeline(run_dir)
        except FileNotFoundError:
            missing.append(name)
            continue
        images += _draw(pipe, prompts, steps, guidance_scale, seed, size)  # the same starting noise in every row
        titles += [f"{name}: {prompt}" for prompt in prompts]
        sampled.append(run_dir)
        del pipe
    if not images:
        raise FileNotFoundError(f"no run among {list(named)} exported a pipeline: run them with export_model=True "
                                "(the default) to the end first.")
    grid = image_grid(images, titles, columns=len(prompts))
    title = (f"seed {seed}, {steps} denoising steps; one row per run"
             + (f" (no exported pipeline: {', '.join(missing)})" if missing else ""))
    note = random_weights_note([_run_config(run_dir) for run_dir in sampled])
    grid.suptitle(title + (f"\n{note}" if note else ""))
    if save_to is not None:
        grid.savefig(save_to, dpi=100)
    return grid


def random_weights_note(configs: Sequence[Mapping[str, Any]]) -> str:
    """What a grid must say when its weights started random (no ``pretrained`` folder, the gallery's default) or
    trained only a smoke run's few steps: the pictures then show a working pipeline, not what a model learned.
    Empty when every run fine-tuned pretrained weights outside the smoke profile."""
    configs = [cfg for cfg in configs if cfg]  # a folder without its config.json says nothing
    random = [cfg for cfg in configs if not cfg.get("pretrained")]
    smoke = [cfg for cfg in configs if cfg.get("profile") == "smoke"]
    if not random and not smoke:
        return ""
    steps = sorted({cfg["steps"] for cfg in random + smoke if cfg.get("steps") is not None})
    trained = f" trained for {'/'.join(map(str, steps))} steps" if steps else ""
    start = "random weights (no pretrained model)" if random else "pretrained weights"
    return (f"{start}{trained}{' in the smoke profile' if smoke else ''}: these pictures show that the pipeline "
            "runs, not what a model learned")


def _run_config(run_dir: Path) -> dict[str, Any]:
    """A run's resolved ``config.json`` under flat names (empty when it wrote none)."""
    path = Path(run_dir) / "config.json"
    return flat_config(json.loads(path.read_text())) if path.is_file() else {}


def _draw(pipe, prompts: Sequence[str], steps: int, guidance_scale: float, seed: int, size: int | None) -> list:
    """One image per prompt at ``size`` (default: the pipeline's own), the starting noise drawn from ``seed``."""
    size = size or pipe.unet.config.sample_size * pipe.vae_scale_factor
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return pipe(list(prompts), num_inference_steps=steps, guidance_scale=guidance_scale, height=size, width=size,
                generator=generator).images


def dataset_preview(data_dir: str | os.PathLike, count: int = 8):
    """The first ``count`` training images of a caption folder with their captions (a matplotlib figure)."""
    from gallery_lib.data.captions import CaptionFolder

    dataset = CaptionFolder(data_dir, split="train")
    samples = [dataset[k] for k in range(min(count, len(dataset)))]
    return image_grid([image for image, _ in samples], [meta["text"] for _, meta in samples])


def dreambooth_preview(cfg, count: int = 4):
    """The first ``count`` subject pictures under the instance prompt, and class pictures under the class prompt."""
    from gallery_lib.data.dreambooth import ImageFiles
    from gallery_lib.tasks.dreambooth import class_dir, instance_dir

    folders = [(instance_dir(cfg.options, cfg.data_dir), cfg.instance_prompt)]
    if cfg.with_prior_preservation:
        folders.append((class_dir(cfg.options, cfg.data_dir), cfg.class_prompt))
    images, titles = [], []
    for folder, prompt in folders:
        pictures = ImageFiles(folder, transform=None)
        for k in range(min(count, len(pictures))):
            images.append(pictures[k])
            titles.append(f"{prompt} ({folder.name}/{pictures.files[k].name})")
    return image_grid(images, titles, columns=count)


def image_grid(images: Sequence, titles: Sequence[str], columns: int = 4):
    """Images (PIL or HWC arrays) in a grid, each titled; a matplotlib figure closed for pyplot, ready to display."""
    import matplotlib.pyplot as plt

    cols = min(columns, len(images))
    rows = -(-len(images) // cols)
    # constrained layout makes room for the titles, a suptitle added later included (tight_layout, run once here,
    # would leave that suptitle over the first row)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3.3 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, title in zip(axes.flat, images, titles):
        ax.imshow(image)
        ax.set_title(_wrap(title), fontsize=8)
    plt.close(fig)  # returned for display; not left open in pyplot's global state
    return fig


def _wrap(text: str, width: int = 32) -> str:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])
