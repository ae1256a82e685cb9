"""README's numbers, rendered from the result files that hold them.

Each block of README.md between ``<!-- numbers:NAME -->`` and ``<!-- /numbers:NAME -->`` is written here from
``benchmarks/results/``; ``tests/test_readme.py`` fails when README disagrees with its files.

    python benchmarks/readme_numbers.py           # rewrites README.md's blocks
    python benchmarks/readme_numbers.py --check   # exit 1, naming the block, where README differs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

HEADLINE = (  # (what was trained, its gallery model, the bench file holding its peer and accelerated rows, batch,
    #            the rows' names in it: a file from a commit whose recipe differed names the row by its switch)
    ("Swin-T, 224 px", "swin_tiny_patch4_window7_224", "swin_repeat_h200/bench_swin_rep.json", 128, "peer",
     "accelerated"),
    ("ResNet-50, 224 px", "resnet50", "head_1931023_h200/bench_resnet_head.json", 256, "peer", "accelerated"),
    # ran before the peer took channels_last, and DreamBooth's recipe ema_in_optimizer: each row named by the switch
    # (a test checks it is the recipe now)
    ("SD-1.5 UNet, 512 px", "sd15", "peer_layout_h200/bench_sd_b32_cl.json", 32, "peer+channels_last", "accelerated"),
    ("DreamBooth, SD-1.5 full fine-tuning, 512 px", "dreambooth_sd15", "one_pass_fixed_h200/bench_db_op_rep.json", 1,
     "peer", "accelerated+ema_in_optimizer"),
)
CPU_GALLERY = "cpu_gallery"
"""The folder of the CPU gallery's timings, ``gallery_<commit>.txt``; the newest file is quoted."""


def headline_table() -> str:
    """Peer against accelerated on one GPU, as ``gallery bench`` reads its rows (``gallery_lib.reports.bench``)."""
    from gallery_lib.reports.bench import find_row
    from gallery_lib.reports.bench_goals import ratio_text

    lines = ["| model | GPU, batch | `peer` img/s | `accelerated` img/s | speedup "
             "| peak reserved GiB, peer → accelerated | commit |", "|---|---|---|---|---|---|---|"]
    for label, model, path, batch, peer_row, fast_row in HEADLINE:
        record = json.loads((RESULTS / path).read_text())
        rows = record["rows"]
        peer, fast = find_row(rows, model, peer_row, batch, 1), find_row(rows, model, fast_row, batch, 1)
        gpu = record["gpu"].replace("NVIDIA ", "").split(" ")[0]
        lines.append(f"| {label} | {gpu}, {batch} | {peer['samples_per_s']:,.1f} | {fast['samples_per_s']:,.1f} | "
                     f"{ratio_text(fast['samples_per_s'] / peer['samples_per_s'], _speedup_goal(model, batch))} | "
                     f"{peer['peak_reserved_gib']:.1f} → {fast['peak_reserved_gib']:.1f} | "
                     f"{record['commit'][:7]}{' (uncommitted changes)' if record.get('dirty') else ''} |")
    return "\n".join(lines)


def _speedup_goal(model: str, batch: int) -> float | None:
    """The ratio over the peer that ``model``'s family sets as its goal at ``batch`` (``ModelFamily.speed_goals``): a
    ratio just under it keeps the digits that say so."""
    from gallery_lib.config.families import family_of

    return next((goal.limits["min_ratio"] for goal in family_of(model).speed_goals
                 if goal.check == "speedup" and goal.model == model and goal.limits.get("batch_size") == batch), None)


def cpu_gallery_time() -> str:
    """The newest CPU gallery run's wall time and CPU, e.g. ``7 min 44 s on 2 cores of an AMD EPYC from a fresh
    clone (commit 73f626f)``: the time depends on the CPU as much as on the code."""
    runs = sorted((RESULTS / CPU_GALLERY).glob("gallery_*.txt"), key=lambda p: _started(p.read_text()))
    text = runs[-1].read_text()
    wall = int(re.search(r"wall (\d+) s", text).group(1))
    commit = re.search(r"# commit (\w+)", text).group(1)
    cpu = re.search(r"# machine: \d+ cores \(([^,)]+)", text).group(1)
    return f"{wall // 60} min {wall % 60} s on 2 cores of an {cpu} from a fresh clone (commit {commit})"


def _started(text: str) -> str:
    match = re.search(r"started (\d\d:\d\d:\d\d) UTC (\d{4}-\d\d-\d\d)", text)
    return f"{match.group(2)} {match.group(1)}" if match else ""


CARDS = (("T4", "16 GB", 15.0), ("A10G, L4", "24 GB", 22.5), ("RTX 4090", "24 GB", 24.0),
         ("A100", "40 GB", 40.0), ("A100, H100", "80 GB", 80.0))
"""Cards people rent, by the memory ``nvidia-smi`` reports (GiB): the plan gets that less a CUDA context."""
MEMORY_FAMILIES = (("SD-1.5", "stable_diffusion", {}),
                   ("DreamBooth", "dreambooth", {"instance_prompt": "a photo of sks dog"}))
VISION_FAMILIES = (("Swin-T", "swin_transformer", {}), ("ResNet-50", "resnet50", {}))
MEMORY_RECIPES = ("baseline", "peer", "accelerated")


def memory_classes(families=MEMORY_FAMILIES) -> str:
    """What the memory plan picks on each card for the notebooks' GPU runs (the full profile, one process), from the
    footprints each family measured (``ModelFamily.memory_footprints``): the plan's own answer, not a new
    measurement."""
    from gallery_lib.recipes import recipe_config
    from gallery_lib.recipes.profiles import base_config
    from gallery_lib.run.memory_plan import CONTEXT_GIB, PLAN, MemoryPlan

    bases = [base_config("full", family=family, data_root="/data", device="cuda", precompile_workers=0, **extra)
             for _, family, extra in families]
    lines = ["| card | free for the run (GiB) | " + " | ".join(
                 f"{label} `{recipe}`" for label, _, _ in families for recipe in MEMORY_RECIPES) + " |",
             "|---|---|" + "---|" * (len(families) * len(MEMORY_RECIPES))]
    rows = [(f"{card} ({size})", round(total - CONTEXT_GIB, 1)) for card, size, total in CARDS]
    rows.insert(1, ("`--gpu-memory-gib 16` (the cap measured on an H200)", 16.0))
    for label, budget in rows:
        cells = [_plan_cell(MemoryPlan.from_dict(recipe_config(base.replace(gpu_memory_gib=budget), recipe,
                                                               {}).extra[PLAN]))
                 for base in bases for recipe in MEMORY_RECIPES]
        lines.append(f"| {label} | {budget:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ladder_classes() -> str:
    """What the memory plan picks for each rung of the optimization ladder on each card, at the rung's global batch,
    from the peaks the rungs measured: the plan's own answer, not a new measurement."""
    from gallery_lib.recipes.ladder import ladder_base, ladder_configs, recipe_name, rung_named
    from gallery_lib.run.memory_plan import CONTEXT_GIB, PLAN, MemoryPlan

    base = ladder_base("full", data_root="/data", device="cuda", precompile_workers=0)
    budgets = [(f"{card} ({size})", round(total - CONTEXT_GIB, 1)) for card, size, total in CARDS]
    budgets.insert(1, ("`--gpu-memory-gib 16`", 16.0))
    plans = [ladder_configs(base.replace(gpu_memory_gib=budget), on_gpu=True) for _, budget in budgets]
    lines = ["| rung | " + " | ".join(f"{label}: {budget:.1f} GiB" for label, budget in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for name in plans[0]:
        cells = [_plan_cell(MemoryPlan.from_dict(configs[name].extra[PLAN])) for configs in plans]
        lines.append(f"| {recipe_name(rung_named(name))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plan_cell(plan) -> str:
    """``batch 8 (22.9)``, ``batch 8, checkpointing (tried)``, ``batch 8, uncompiled, EMA on the CPU (tried)``, or
    ``does not fit``."""
    ema = (", EMA on the CPU" if plan.ema_offloaded else "") + (", AdamW per tensor" if plan.per_tensor_update else "")
    if plan.chosen is not None:
        return f"{plan.chosen.short()}{ema} ({plan.estimate_gib:.1f})"
    if plan.probe:
        return f"{plan.probe[0].short()}{ema} (tried)"
    return "does not fit"


BLOCKS = {"headline": headline_table, "cpu-gallery": cpu_gallery_time, "memory-classes": memory_classes,
          "memory-classes-vision": lambda: memory_classes(VISION_FAMILIES), "memory-classes-ladder": ladder_classes}


def render(readme: str) -> str:
    """``readme`` with every block rewritten."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- numbers:{name} -->)(.*?)(<!-- /numbers:{name} -->)", re.S)
        if not pattern.search(readme):
            raise ValueError(f"README.md has no <!-- numbers:{name} --> block")
        body = make()
        sep = "\n" if "\n" in body else ""
        readme = pattern.sub(lambda m: f"{m.group(1)}{sep}{body}{sep}{m.group(3)}", readme)
    return readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 where README differs")
    args = parser.parse_args()
    path = ROOT / "README.md"
    text = path.read_text()
    rendered = render(text)
    if args.check:
        if rendered != text:
            print("README.md's numbers differ from their result files: run python benchmarks/readme_numbers.py",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
