"""The ``gallery`` command: ``prepare``, ``train``, ``compare``, ``run`` (all steps for one model), ``bench``, ``list``.

Flags follow the TorchAcc gallery where one exists (``--batch_size``, ``--nproc_per_node``,
``--amp_level O1|O2``, ``--compiler-opt``, ``--kernel-opt``); every flag accepts dashes or
underscores. A recipe sets the optimizations; explicit optimization flags override it, and the run
is then named after both (``baseline+compiler-opt``) so it never overwrites the plain recipe's results.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Sequence

from gallery_lib.config import (AMP_DTYPES, AMP_LEVELS, COMPILE_MODES, DEVICES, REPORT_TO, ConfigError,
                                RunConfig, parse_overrides, validate_for_machine)
from gallery_lib.config.families import import_family_module
from gallery_lib.recipes.profiles import PROFILES, base_config
from gallery_lib.recipes import recipe_config
from gallery_lib.app.bench import DEFAULT_RECIPES as _BENCH_RECIPES
from gallery_lib.app.bench_workloads import DENOISERS
from gallery_lib.run.checkpoint import CheckpointError

DEFAULT_RECIPES = "baseline,compiled,accelerated"
BENCH_RECIPES = ",".join(_BENCH_RECIPES)
_MIXED_PRECISION = {"no": {"amp_level": "O0"}, "fp16": {"amp_level": "O1", "amp_dtype": "float16"},
                    "bf16": {"amp_level": "O1", "amp_dtype": "bfloat16"}}
"""diffusers' ``--mixed_precision`` as the gallery's fields."""


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Adds ``--a-b`` with ``--a_b`` as an alias."""
    dashed = "--" + name.replace("_", "-")
    underscored = "--" + name.replace("-", "_")
    names = [dashed] if dashed == underscored else [dashed, underscored]
    parser.add_argument(*names, dest=name.replace("-", "_"), **kwargs)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run size (default: from the profile)")
    _flag(g, "profile", choices=PROFILES, default="auto",
          help="smoke: tiny model on a CPU; full: the GPU benchmark; auto: full when a GPU is visible (default: auto)")
    _flag(g, "model", help="gallery model, see `gallery list` (default: the profile's)")
    _flag(g, "data_dir",
          help="the model's data: train/<class>/<images> for classifiers, images with train/metadata.jsonl for "
               "Stable Diffusion (default: the prepared mock set, data/<dataset>_<profile>)")
    _flag(g, "output_dir", default="output", help="output root (default: output)")
    _flag(g, "batch_size", type=int, help="images per process per step")
    _flag(g, "find_batch_size", action="store_true", default=None,
          help="search for the largest batch that fits, from --batch_size down (x0.9 per out-of-memory), then train "
               "at it (single process only)")
    _flag(g, "gpu_memory_gib", type=float, metavar="GIB",
          help="the GPU memory the run may use: its processes are capped to it and the memory plan fits the step "
               "into it, e.g. 22 for a 24 GB card (default: $GALLERY_GPU_MEMORY_GIB, else the GPU's free memory; "
               "--set memory_plan=off runs as configured)")
    _flag(g, "steps", type=int, help="optimizer steps")
    _flag(g, "warmup_steps", type=int, help="steps excluded from speed figures")
    _flag(g, "image_size", type=int, help="training crop size")
    _flag(g, "nproc_per_node", type=int, help="processes (GPUs) started by torchrun (default: 1)")
    _flag(g, "num_workers", type=int, help="data-loader workers per process")
    _flag(g, "device", choices=DEVICES, help="default: auto")
    _flag(g, "lr", type=float, help="peak learning rate (default: the profile's, else 5e-4 per 512 images for "
                                     "AdamW, 0.1 per 256 for SGD)")
    _flag(g, "seed", type=int, help="default: 0")
    _flag(g, "verbose", action="store_true", default=None,
          help="log every detail (each module a kernel swap left alone); default: one line per kind")
    o = p.add_argument_group("optimizations (override the recipe's)")
    _flag(o, "amp_level", choices=AMP_LEVELS, help="O0 fp32, O1 autocast, O2 bf16 weights + fp32 master copies")
    _flag(o, "amp_dtype", choices=AMP_DTYPES, help="low-precision dtype (default: auto)")
    _flag(o, "compiler-opt", action="store_true", default=None, help="torch.compile the model")
    _flag(o, "compile_mode", choices=COMPILE_MODES, help="torch.compile mode (auto: CUDA graphs where the step is "
                                                          "small enough for them to pay)")
    _flag(o, "kernel-opt", action="store_true", default=None, help="swap in gallery_lib's fused kernels")
    _flag(o, "set", action="append", default=[], metavar="FIELD=VALUE",
          help="any other RunConfig field, flat or dotted by its section, e.g. --set fused_attention=true or "
               "--set kernels.fused_attention=true (repeatable)")
    a = p.add_argument_group("the same settings as diffusers' and timm's training scripts spell them")
    a.add_argument("--pretrained", "--pretrained_model_name_or_path", dest="pretrained",
                   help="a local diffusers folder (SD models) or checkpoint file (classifiers); default: random init")
    a.add_argument("--resolution", dest="image_size", type=int, help="= --image_size")
    a.add_argument("--train_batch_size", dest="batch_size", type=int, help="= --batch_size")
    a.add_argument("--mixed_precision", choices=tuple(_MIXED_PRECISION), help="no: fp32; fp16 or bf16 autocast")
    a.add_argument("--gradient_checkpointing", "--gradient-checkpointing", "--grad-checkpointing",
                   "--grad_checkpointing", dest="gradient_checkpointing", action="store_true", default=None,
                   help="recompute activations in the backward (less memory)")
    a.add_argument("--gradient_accumulation_steps", "--grad-accum-steps", "--grad_accum_steps",
                   dest="gradient_accumulation_steps", type=int,
                   help="batches whose gradients add up before each optimizer step")
    a.add_argument("--use_ema", "--model-ema", "--model_ema", dest="use_ema", action="store_true", default=None,
                   help="keep an EMA of the weights (the recipe picks how it is updated)")
    a.add_argument("--offload_ema", "--offload-ema", dest="offload_ema", action="store_true", default=None,
                   help="keep an EMA, in the CPU's memory between its updates (= --use_ema --set ema_offload=true)")
    a.add_argument("--report_to", "--report-to", dest="report_to", choices=REPORT_TO,
                   help="also log to TensorBoard (<run_dir>/tensorboard); metrics.jsonl is always written")
    a.add_argument("--torchcompile", nargs="?", const="inductor", metavar="BACKEND",
                   help="= --compiler-opt (timm's spelling; the backend is inductor)")


_SIZE_FIELDS = ("model", "data_dir", "output_dir", "batch_size", "find_batch_size", "gpu_memory_gib", "steps",
                "warmup_steps", "image_size", "nproc_per_node", "num_workers", "device", "lr", "seed", "verbose",
                "pretrained", "report_to")
_OPT_FLAGS = {"amp_level": "amp_level", "amp_dtype": "amp_dtype", "compiler_opt": "compile",
              "compile_mode": "compile_mode", "kernel_opt": "kernels"}


def base_from_args(args: argparse.Namespace) -> RunConfig:
    # on; the recipe then picks its update
    ema = "foreach" if getattr(args, "use_ema", None) or getattr(args, "offload_ema", None) else None
    return base_config(args.profile, ema=ema, **{f: getattr(args, f, None) for f in _SIZE_FIELDS})


def optimization_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {field: getattr(args, flag) for flag, field in _OPT_FLAGS.items()
                 if getattr(args, flag, None) is not None}
    overrides.update(_MIXED_PRECISION.get(getattr(args, "mixed_precision", None), {}))
    if getattr(args, "gradient_checkpointing", None):
        overrides["gradient_checkpointing"] = True
    if getattr(args, "gradient_accumulation_steps", None) is not None:
        overrides["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    if getattr(args, "offload_ema", None):
        overrides["ema_offload"] = True
    backend = getattr(args, "torchcompile", None)
    if backend is not None:
        if backend != "inductor":
            raise ConfigError(f"--torchcompile {backend}: the gallery compiles with inductor; pass --torchcompile "
                              "alone (or torch.compile(model, backend=...) in your own loop).")
        overrides["compile"] = True
    return {**overrides, **parse_overrides(getattr(args, "set", None) or [])}


def _recipe_list(text: str) -> list[str]:
    """Comma-separated entries. A comma inside an override's value stays in it
    (``accelerated+kernel_ops=geglu,group_norm_silu,peer``: two recipes): a piece that names no recipe continues an
    entry ending in ``field=value``."""
    from gallery_lib.recipes import all_recipes

    recipes = all_recipes()
    entries: list[str] = []
    for piece in filter(None, (part.strip() for part in text.split(","))):
        if entries and "=" in entries[-1].rsplit("+", 1)[-1] and piece.split("+")[0] not in recipes:
            entries[-1] += f",{piece}"
        else:
            entries.append(piece)
    return entries


def cmd_list(args: argparse.Namespace) -> int:
    from gallery_lib.families import FAMILIES
    from gallery_lib.recipes.ladder import RUNGS, recipe_name
    from gallery_lib.recipes import RECIPES, describe

    print("models:")
    for family in FAMILIES.values():
        for spec in family.models:
            print(f"  {spec.name:32s} {family.name:18s} {spec.description}")
    print("recipes:")
    for name in RECIPES:
        print(f"  {name:12s} {describe(name).splitlines()[0]}")
    print("optimization ladder rungs (Stable Diffusion; notebooks/optimization_ladder.ipynb):")
    for rung in RUNGS:
        print(f"  {recipe_name(rung):28s} {rung.title}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from gallery_lib.app.workflow import prepare

    base = base_from_args(args)
    path = prepare(base)
    print(f"data ready at {path}")
    return 0


def configs_from_args(args: argparse.Namespace) -> list[RunConfig]:
    """The run configs a ``train`` or ``run`` command asks for, resolved and checked (``ConfigError`` otherwise);
    nothing is prepared or launched."""
    base = base_from_args(args)
    overrides = optimization_overrides(args)
    recipes = [args.recipe] if hasattr(args, "recipe") else _recipe_list(args.recipes)
    configs = [recipe_config(base, recipe, overrides) for recipe in recipes]
    # Checkpointing changes how a run is kept, not what it trains: the run keeps its recipe name (and folder).
    if getattr(args, "checkpoint_every", None) is not None:
        configs = [cfg.replace(checkpoint_every=args.checkpoint_every) for cfg in configs]
    resume = getattr(args, "resume_from_checkpoint", None) or getattr(args, "resume", None)
    if resume == "latest":
        configs = [cfg.replace(resume=True) for cfg in configs]
    elif resume:
        configs = [cfg.replace(resume=True, resume_from=resume) for cfg in configs]
    return configs


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several nodes (torchrun's own flags, passed through; give them on every node)")
    _flag(g, "nnodes", type=int, default=1, help="nodes in the job (default: 1, torchrun --standalone)")
    _flag(g, "node_rank", type=int, help="this node's rank: 0 on the node at --rdzv-endpoint (static rendezvous)")
    _flag(g, "rdzv_endpoint", metavar="HOST:PORT", help="node 0's address, the same on every node")
    _flag(g, "rdzv_backend", help="static (torchrun's default, with --node-rank) or c10d (with --rdzv-id)")
    _flag(g, "rdzv_id", help="a job id shared by the nodes (c10d)")


def cmd_train(args: argparse.Namespace) -> int:
    from gallery_lib.run.launch import Nodes, RunFailed, launch

    (cfg,) = configs_from_args(args)
    nodes = Nodes(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                  rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id)
    try:
        result = launch(cfg, nodes=nodes)
    except RunFailed as exc:  # the run streamed its log above: one line says why it stopped
        print(f"gallery: {exc.failure.line(cfg.recipe) if exc.failure else exc}", file=sys.stderr)
        return 1
    print(f"metrics: {result.metrics_path}" if result.summary else
          f"this node's part is done; rank 0's node writes {result.metrics_path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from gallery_lib.app.workflow import compare

    base = base_from_args(args)
    report = compare(base, _recipe_list(args.recipes) if args.recipes else None)
    print(report.markdown)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from gallery_lib.app.workflow import compare, launch_all, prepare, refuse_runs_sharing_a_folder

    base = base_from_args(args)
    configs = configs_from_args(args)
    refuse_runs_sharing_a_folder(configs)
    for cfg in configs:  # every machine check before any data is prepared
        validate_for_machine(cfg)
    if args.data_dir is None:
        prepare(base)
    runs = launch_all(configs)
    report = compare(base, runs)
    print(report.markdown)
    for line in runs.failure_lines():
        print(f"gallery: {line}", file=sys.stderr)
    return 1 if runs.failures else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from gallery_lib.reports.bench import bench_table
    from gallery_lib.reports.bench_goals import describe_goals
    from gallery_lib.app import bench

    if args.timm_model is not None or args.diffusers_model is not None:
        return cmd_bench_your_model(args)
    for flag in ("image_size", "steps", "model_config"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag.replace('_', '-')} is for --timm-model or --diffusers-model: a family's model "
                              "runs at its profile's size and steps (--batch-size, --warmup-steps and --timed-steps "
                              "change them).")
    if args.profile_steps:
        raise ConfigError("--profile-steps is for --timm-model or --diffusers-model: a family's runs profile with "
                          f"--set profile_steps={args.profile_steps}.")
    models = bench.resolve_models(_recipe_list(args.models or ""), args.profile)
    recipes = _recipe_list(args.recipes)
    if not recipes:
        raise ConfigError(f"--recipes {args.recipes!r} names no recipe: pass some of {BENCH_RECIPES}.")
    runs = bench.plan_runs(models, recipes, bench.parse_batch_sizes(args.batch_size, models), profile=args.profile,
                           warmup_steps=args.warmup_steps, timed_steps=args.timed_steps, output_dir=args.output_dir,
                           data_root=args.data_root, overrides=parse_overrides(args.set),
                           processes=bench.parse_processes(args.processes))
    out = bench.out_path(args.out, bench.gpu_name())
    record = bench.run_bench(runs, out, command=args.command_line, profile=args.profile)
    print(f"\n{bench_table(record['rows'])}\n\n{describe_goals(record['rows'], record['device'])}")
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


def cmd_bench_your_model(args: argparse.Namespace) -> int:
    from gallery_lib.app import bench, bench_your_model
    from gallery_lib.app.bench_workloads import Workload, parse_model_config

    kind, name = ("timm", args.timm_model) if args.timm_model is not None else ("diffusers", args.diffusers_model)
    given = [f"--{name.replace('_', '-')}" for name, default in _FAMILY_BENCH_FLAGS.items()
             if getattr(args, name) != default]
    if args.timm_model is not None and args.diffusers_model is not None:
        given.append("--diffusers-model")
    if given:
        raise ConfigError(f"--{kind}-model benches one model (eager, peer, accelerated), not the gallery's families "
                          f"nor another model: leave out {', '.join(given)}; it takes --batch-size, --image-size, "
                          "--steps, --warmup-steps, --profile-steps, --out (and with --diffusers-model --model-config).")
    workload = Workload(kind, name, parse_model_config(args.model_config))
    settings = bench_your_model.resolve_bench(workload, batch_size=bench_your_model.parse_batch_size(args.batch_size),
                                              image_size=args.image_size, steps=args.steps,
                                              warmup_steps=args.warmup_steps, profile_steps=args.profile_steps)
    gpu = bench.gpu_name() if settings.device == "cuda" else None
    out = bench.out_path(args.out, gpu, name=f"{workload.kind}-{bench.slug(workload.name)}")
    record = bench_your_model.run_model_bench(settings, out, command=args.command_line)
    print(f"\n{bench_your_model.model_table(record)}")
    written = [str(path) for path in (out, out.with_suffix(".md"), out.with_suffix(".png")) if path.exists()]
    print(f"\nwrote {', '.join(written)}")
    failed = [row for row in record["rows"] if "error" in row]
    for row in failed:
        print(f"gallery: {row['variant']}: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


_FAMILY_BENCH_FLAGS = {"models": None, "recipes": BENCH_RECIPES, "profile": "auto", "processes": None,
                       "timed_steps": None, "set": [], "data_root": "data", "output_dir": "output/bench"}
"""The flags of a bench of the gallery's families, at their defaults: ``--timm-model`` and ``--diffusers-model``
refuse any other value."""


def _add_bench_flags(p: argparse.ArgumentParser) -> None:
    defaults = _FAMILY_BENCH_FLAGS
    _flag(p, "timm_model", metavar="NAME",
          help="bench a timm model instead of the families: eager, peer (torch.compile, on a GPU with CUDA graphs and "
               "channels_last for a convolutional network) and accelerate(model), from the same initial weights "
               "through one plain loop; takes --batch-size, --image-size, --steps, --warmup-steps and --out")
    _flag(p, "diffusers_model", metavar="CLASS",
          help=f"bench a diffusers denoiser ({', '.join(DENOISERS)}) instead of the families, built from its class's "
               "default config (--model-config changes it) with random weights, on noised samples with the noise's "
               "mean squared error; as --timm-model otherwise (--image-size: the sample size, default 32 on a GPU)")
    _flag(p, "model_config", action="append", default=[], metavar="KEY=VALUE",
          help="with --diffusers-model: a value of the class's config, JSON or text, e.g. num_layers=12 or "
               "block_out_channels=[64,128] (repeatable)")
    _flag(p, "models", help="comma-separated gallery models, or family shortcuts meaning the profile's model of a "
                            "family: sd, swin, resnet, dreambooth (default: every family's)")
    _flag(p, "recipes", default=defaults["recipes"],
          help="comma-separated; a recipe with fields changed as RECIPE+FIELD=VALUE, e.g. accelerated+ema=off "
               f"(default: {BENCH_RECIPES})")
    _flag(p, "batch_size", action="append", default=[], metavar="[MODEL=]SIZES",
          help="comma-separated batch sizes for every model (32,48), or for one (sd=32,48); repeatable "
               "(default: the profile's); with --timm-model one size (default: 128 on a GPU, 4 on a CPU)")
    _flag(p, "image_size", type=int, help="with --timm-model: the image size (default: 224 on a GPU, 32 on a CPU); "
                                          "with --diffusers-model the sample size (32 on a GPU, 8 on a CPU)")
    _flag(p, "steps", type=int, help="with --timm-model or --diffusers-model: steps per variant, warm-up included "
                                     "(default: 60 on a GPU, 6 or 4 on a CPU)")
    _flag(p, "profile_steps", type=int, help="with --timm-model or --diffusers-model: steps after the timed ones run "
                                              "under torch.profiler, each variant's kernel time by kind in its row "
                                              "(default: 0, none)")
    _flag(p, "profile", choices=PROFILES, default=defaults["profile"],
          help="smoke: the tiny models on a CPU; full: the GPU models; auto: full when a GPU is visible")
    _flag(p, "processes", metavar="COUNTS",
          help="comma-separated process counts (GPUs) to run each recipe at, e.g. 1,2: the table gives the scaling "
               "over one process (default: nproc_per_node, 1)")
    _flag(p, "warmup_steps", type=int, help="untimed steps first, compilation included (default: the profile's; "
                                             "with --timm-model 25 on a GPU, 3 on a CPU, at most a "
                                             "third of fewer --steps)")
    _flag(p, "timed_steps", type=int, help="steps timed after warm-up (default: 30 on a GPU, at least that; the "
                                            "profile's on a CPU)")
    _flag(p, "set", action="append", default=[], metavar="FIELD=VALUE",
          help="any RunConfig field, flat or dotted (lr or optimizer.lr), for every run (repeatable)")
    _flag(p, "data_root", default=defaults["data_root"],
          help="where each model's mock data is prepared (default: data)")
    _flag(p, "output_dir", default=defaults["output_dir"], help="the runs' output root (default: output/bench)")
    _flag(p, "out", help="the result file, or a folder to write it in (default: output/bench/bench-<gpu>-<date>.json, "
                         "with --timm-model output/bench/timm-<model>-<gpu>-<date>.json, with --diffusers-model "
                         "diffusers-<class>-...); its figure is written beside it as .png (and, for one model, its "
                         "table as .md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gallery", description=__doc__.split("\n\n")[0].replace("``", "`"))
    parser.add_argument("--family-module", "--family_module", dest="family_modules", action="append", default=[],
                        metavar="FILE.py", help="a module outside the library that registers a model family "
                        "(gallery_lib.families.register_family), e.g. examples/toy_family.py; repeatable")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="models and recipes").set_defaults(func=cmd_list)
    p = sub.add_parser("prepare", help="make the mock dataset for a profile")
    _add_run_flags(p)
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("train", help="one training run (one recipe)")
    _add_run_flags(p)
    _flag(p, "recipe", default="baseline", help="baseline, compiled, peer or accelerated (default: baseline)")
    _flag(p, "checkpoint_every", type=int, help="save a checkpoint every N steps in <run>/checkpoints (default: off)")
    p.add_argument("--checkpointing_steps", dest="checkpoint_every", type=int, help="= --checkpoint_every")
    _flag(p, "resume", nargs="?", const="latest", metavar="latest|PATH",
          help="continue the run from its own <run>/checkpoints/latest, or from the checkpoint PATH names (a "
               "step_<N>.pt file, a checkpoints folder or a run folder, e.g. another run's)")
    p.add_argument("--resume_from_checkpoint", metavar="latest|PATH", help="= --resume (diffusers' spelling)")
    _add_node_flags(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("compare", help="write the report of a model's runs")
    _add_run_flags(p)
    _flag(p, "recipes", help="runs to compare, comma-separated (default: all found)")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("run", help="prepare data, run each recipe, write the report")
    _add_run_flags(p)
    _flag(p, "recipes", default=DEFAULT_RECIPES, help=f"comma-separated (default: {DEFAULT_RECIPES})")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("bench", help="time each model's training step per recipe and batch size; write a result "
                                     "file, a figure and which of the speed goals the run met")
    _add_bench_flags(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = "gallery " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        for path in args.family_modules:
            import_family_module(path)
        return args.func(args)
    except (ConfigError, FileNotFoundError, CheckpointError) as exc:
        print(f"gallery: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a run's own line says where it stopped and how to go on
        print(f"gallery: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
