"""The run's own sections: ``job`` (which model, which recipe, where it writes), ``data`` (what it reads),
``checkpoint`` (the weights and state it starts from and saves) and ``metrics`` (what it records)."""

from __future__ import annotations

from dataclasses import dataclass

from gallery_lib.config.settings import ConfigError, Section, setting

DEVICES = ("auto", "cuda", "cpu")
REPORT_TO = ("none", "tensorboard")


@dataclass(frozen=True, kw_only=True)
class Job(Section):
    """``job``: the model, the recipe, the device and the output folder."""

    model: str
    """Gallery model name, e.g. ``swin_tiny_patch4_window7_224`` or the CPU-sized ``swin_micro``."""
    recipe: str = setting("baseline", kind=str)
    """Name of the recipe this config was resolved from (``baseline``, ``compiled``, ``accelerated``...)."""
    profile: str = setting("custom", kind=str)
    """Profile the defaults came from (``smoke`` on a CPU, ``full`` on a GPU); informative only."""
    output_dir: str = setting("output", kind=str)
    """Root of the output tree; this run writes to ``<output_dir>/<model family>/<recipe>/``."""
    device: str = setting("auto", choices=DEVICES)
    """``auto`` picks CUDA when present, else CPU."""
    seed: int = setting(0, kind=int, minimum=0)
    """Seed for model init, data order and augmentation."""
    verbose: bool = setting(False, kind=bool)
    """Log every detail (each module a kernel swap left alone); by default one line per kind of thing."""

    def check(self) -> None:
        if not self.recipe:
            raise ConfigError(f"recipe={self.recipe!r} is invalid: expected a recipe name.")


@dataclass(frozen=True, kw_only=True)
class Data(Section):
    """``data``: the training images and how they are loaded."""

    data_dir: str = setting("data/imagenet_like", kind=str)
    """Training data: an ImageNet-style folder with ``train/<class>/*`` images for classifiers, an imagefolder with
    ``train/metadata.jsonl`` (``file_name``, ``text``) for text-to-image models."""
    image_size: int = setting(224, kind=int, minimum=16)
    """Training crop size in pixels."""
    num_workers: int = setting(4, kind=int, minimum=0)
    """Data-loader worker processes per training process."""
    reuse_batch: bool = setting(False, kind=bool)
    """Train on the first batch over and over: times the model step alone, without the data pipeline
    (as timm's ``benchmark.py`` does with random inputs). For benchmarks only: the model learns nothing useful."""
    max_bad_fraction: float = setting(0.1, kind=float, above=0, maximum=1, hint="1 never stops for bad files")
    """Stop with an error when more than this share of the image loads so far failed (judged every ``log_every``
    steps, once 50 images were read); each bad file is skipped, logged with its path and counted. In (0, 1]."""



@dataclass(frozen=True, kw_only=True)
class Checkpoint(Section):
    """``checkpoint``: the weights a run starts from, the state it saves and resumes, the model it exports."""

    pretrained: str | None = setting(None, kind=str, optional=True)
    """Start from these weights instead of a random init: a local folder (a timm checkpoint file for classifiers; the
    diffusers layout ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/`` for Stable Diffusion) or a hub id when
    the machine has network."""
    checkpoint_every: int = setting(0, kind=int, minimum=0, hint="0 disables checkpoints")
    """Steps between checkpoints in ``<run_dir>/checkpoints/`` (0 disables periodic checkpoints). A run stopped
    for non-finite losses saves one whatever this value is."""
    keep_checkpoints: int = setting(2, kind=int, minimum=1)
    """Newest checkpoints kept on disk; older ones are deleted (never the one ``latest`` names)."""
    resume: bool = setting(False, kind=bool)
    """Continue from ``<run_dir>/checkpoints/latest`` (model, optimizer, scheduler, scaler, RNG, data position);
    an error if there is no checkpoint to resume from."""
    resume_from: str | None = setting(None, kind=str, optional=True)
    """A checkpoint to continue from instead of the run's own latest: a ``step_<N>.pt`` file, a ``checkpoints``
    folder or a run folder (the checkpoint its ``latest`` names), e.g. another run's. Implies ``resume``; the state
    must fit the run as with ``resume``. The run writes its metrics afresh and its checkpoints to its own folder.
    diffusers' ``--resume_from_checkpoint PATH``."""
    max_restarts: int = setting(0, kind=int, minimum=0, hint="0 disables restarts")
    """Times torchrun restarts the workers after a failure (``--max-restarts``); a restarted run resumes from the
    latest checkpoint on its own, so set ``checkpoint_every`` too."""
    export_model: bool = setting(True, kind=bool)
    """Save the trained model at the end of the run (Stable Diffusion: a diffusers pipeline folder in
    ``<run_dir>/pipeline`` with the EMA UNet when ``ema`` is on)."""



@dataclass(frozen=True, kw_only=True)
class Metrics(Section):
    """``metrics``: how often the run reads its numbers back, what it profiles, where the metrics go."""

    log_every: int = setting(10, kind=int, minimum=1)
    """Steps between host syncs: losses and timings are read back and written in batches of this size."""
    profile_steps: int = setting(0, kind=int, minimum=0)
    """Run the last this many steps under ``torch.profiler`` and write the kernel time per step by kind to
    ``<run_dir>/profile.json`` (0: off). They are left out of the speed figures, which come from the steps between
    warm-up and them (at least one): profiled steps run slower, and the profiler can keep slowing the steps after it
    (``gallery_lib/run/profiling.py``)."""
    report_to: str = setting("none", choices=REPORT_TO)
    """Where the metrics go besides ``metrics.jsonl`` (which stays the record): ``none``, or ``tensorboard`` (step
    scalars and the summary in ``<run_dir>/tensorboard/``, the reports' figure beside the runs; needs the
    ``tensorboard`` package, the ``tracking`` extra). diffusers' ``--report_to``."""
