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
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

HEADLINE_CALLS = ("head_0537162_h200/bench_head1.json", "head_0537162_h200/bench_head2.json",
                  "head_0537162_h200/bench_head3_db.json")
"""The timed ``gallery bench`` calls README's headline rows come from: one commit, one machine, separate calls
(``results/head_0537162_h200/README.md``). Each row reads every call that ran its model."""
HEADLINE = (  # (what was trained, its gallery model, batch): the rows `peer` and `accelerated`, as the recipes ship
    ("Swin-T, 224 px", "swin_tiny_patch4_window7_224", 128),
    ("ResNet-50, 224 px", "resnet50", 256),
    ("SD-1.5 UNet, 512 px", "sd15", 32),
    ("DreamBooth, SD-1.5 full fine-tuning, 512 px", "dreambooth_sd15", 1),
)
HEADLINE_COLUMNS = ("model", "GPU, batch", "calls", "`peer` img/s", "`accelerated` img/s", "speedup: median [range]",
                    "goal", "peak reserved GiB, peer → accelerated", "commit")


class Call(NamedTuple):
    """One timed call's record and, in it, one model's ``peer`` and ``accelerated`` rows."""
    record: dict
    peer: dict
    fast: dict


@dataclass(frozen=True)
class HeadlineRow:
    """One model's ``peer`` and ``accelerated`` rows from each call that ran it, and its family's speedup goal."""
    label: str
    model: str
    batch: int
    calls: list[Call]
    """In ``HEADLINE_CALLS``' order."""
    goal: dict

    @property
    def ratios(self) -> list[float]:
        return [call.fast["samples_per_s"] / call.peer["samples_per_s"] for call in self.calls]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def median(self, role: str, key: str) -> float:
        """The median over the calls of ``key`` in the ``peer`` or ``fast`` (``accelerated``) row."""
        return statistics.median(getattr(call, role)[key] for call in self.calls)

    @property
    def spread(self) -> float:
        """The median call's p80/p20 of ``accelerated``'s step."""
        return statistics.median(call.fast["p80_step_ms"] / call.fast["p20_step_ms"] for call in self.calls)

    @property
    def met(self) -> bool:
        return (self.ratio >= self.goal["min_ratio"] and self.spread <= self.goal.get("max_spread", float("inf"))
                and self.median("fast", "samples_per_s") >= self.goal.get("min_samples_per_s", 0.0))


def headline_rows() -> list[HeadlineRow]:
    """The headline's rows from ``HEADLINE_CALLS``; every call must name one commit, and every row two calls or more."""
    from gallery_lib.reports.bench import find_row

    records = [json.loads((RESULTS / path).read_text()) for path in HEADLINE_CALLS]
    commits = {record["commit"] for record in records}
    if len(commits) != 1:
        raise ValueError(f"the headline's calls name {len(commits)} commits ({', '.join(sorted(commits))}): one only")
    rows = []
    for label, model, batch in HEADLINE:
        calls = [Call(record, find_row(record["rows"], model, "peer", batch, 1),
                      find_row(record["rows"], model, "accelerated", batch, 1)) for record in records]
        calls = [call for call in calls if call.peer and call.fast]
        if len(calls) < 2:
            raise ValueError(f"{label}: {len(calls)} call(s) with peer and accelerated at batch {batch}; two or more")
        rows.append(HeadlineRow(label, model, batch, calls, _speedup_goal(model, batch)))
    return rows


def headline_table() -> str:
    """Peer against accelerated on one GPU, as ``gallery bench`` reads its rows (``gallery_lib.reports.bench``): the
    median of the calls, the range of their ratios, and the family's goal met or missed."""
    from gallery_lib.reports.bench_goals import limits_beyond_ratio, ratio_text

    lines = ["| " + " | ".join(HEADLINE_COLUMNS) + " |", "|" + "---|" * len(HEADLINE_COLUMNS)]
    for row in headline_rows():
        record = row.calls[0].record
        gpu = record["gpu"].replace("NVIDIA ", "").split(" ")[0]
        low, high, goal = min(row.ratios), max(row.ratios), row.goal["min_ratio"]
        reserved = [max(getattr(call, role)["peak_reserved_gib"] for call in row.calls) for role in ("peer", "fast")]
        cells = [row.label, f"{gpu}, {row.batch}", str(len(row.calls)), f"{row.median('peer', 'samples_per_s'):,.1f}",
                 f"{row.median('fast', 'samples_per_s'):,.1f}",
                 f"{ratio_text(row.ratio, goal)} [{ratio_text(low, goal)[:-1]}-{ratio_text(high, goal)[:-1]}]",
                 f">= {goal:.2f}x{limits_beyond_ratio(**row.goal)}: {'met' if row.met else 'missed'}",
                 f"{reserved[0]:.1f} → {reserved[1]:.1f}",
                 f"{record['commit'][:7]}{' (uncommitted changes)' if record.get('dirty') else ''}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _speedup_goal(model: str, batch: int) -> dict:
    """The speedup goal ``model``'s family sets at ``batch`` (``ModelFamily.speed_goals``): its limits."""
    from gallery_lib.config.families import family_of

    return next(goal.limits for goal in family_of(model).speed_goals
                if goal.check == "speedup" and goal.model == model and goal.limits.get("batch_size") == batch)


CPU_GALLERY = "cpu_gallery"
"""The folder of the CPU gallery's timings, ``gallery_<commit>.txt``; the newest file is quoted."""


def cpu_gallery_time() -> str:
    """The newest CPU gallery run's wall time and CPU, e.g. ``7 min 44 s on 2 cores of an AMD EPYC from a fresh
    clone (commit 73f626f)``: the time depends on the CPU as much as on the code."""
    runs = sorted((RESULTS / CPU_GALLERY).glob("gallery_*.txt"), key=lambda p: _started(p.read_text()))
    text = runs[-1].read_text()
    wall = int(re.search(r"wall (\d+) s", text).group(1))
    commit = re.search(r"# commit (\w+)", text).group(1)
    # the CPU's name as the kernel gives it ("Intel(R) Xeon(R) Processor with AVX-512"), trademarks left out
    plain = re.sub(r"\((R|TM)\)| Processor", "", text)
    cpu = re.search(r"# machine: \d+ cores \(([^,)]+)", plain).group(1)
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
        cells = [MemoryPlan.from_dict(recipe_config(base.replace(gpu_memory_gib=budget), recipe, {}).extra[PLAN]
                                      ).cell(short=True) for base in bases for recipe in MEMORY_RECIPES]
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
        cells = [MemoryPlan.from_dict(configs[name].extra[PLAN]).cell(short=True) for configs in plans]
        lines.append(f"| {recipe_name(rung_named(name))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


CAPS = ("16 GiB", "22 GiB", "38 GiB")


def measured_classes() -> str:
    """What each notebook's recipes ran under each cap, from the rows RESULTS#memory-plan names (``row: MODEL, CAP,
    RECIPE: SETTING | selector``): the setting the plan ran, its img/s and peak reserved, each measured under that
    cap; ``-`` where none ran."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results_md  # beside this script: its placeholders, their parser and the index

    from gallery_lib.app.bench import DEFAULT_RECIPES

    index = results_md.read_index()
    _, body = results_md.PLACEHOLDER.search((results_md.SOURCES / "memory-plan.md").read_text()).groups()
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for label, selector, file in results_md.parse(body)[1]:
        where, _, setting = label.partition(": ")
        model, cap, recipe = (part.strip() for part in where.split(","))
        run = results_md.select(index, selector, file)
        speed = f"{run['samples_per_s']:,.1f} img/s, {run['peak_reserved_gib']:.1f} GiB"
        cells.setdefault((model, recipe), {})[cap] = f"{setting}: {speed}"
    lines = ["| notebook | recipe | " + " | ".join(f"`--gpu-memory-gib {cap.split()[0]}`" for cap in CAPS) + " |",
             "|---|---|" + "---|" * len(CAPS)]
    models = dict.fromkeys(model for model, _ in cells)  # in the section's order
    for model in models:
        for recipe in DEFAULT_RECIPES:
            by_cap = cells.get((model, recipe))
            if by_cap:
                lines.append(f"| {model} | `{recipe}` | " + " | ".join(by_cap.get(cap, "-") for cap in CAPS) + " |")
    return "\n".join(lines)


NOTEBOOKS = {"stable_diffusion": "Stable Diffusion", "dreambooth": "DreamBooth", "swin_transformer": "Swin-T",
             "resnet50": "ResNet-50", "optimization_ladder": "the optimization ladder", "your_model": "your model"}
"""The notebooks in README's order, by file name, as the whole-notebook table names them."""


CARD_CAPS = (("16 GB", 16.0), ("24 GB", 22.0), ("40 GB", 38.0), ("80 GB", 78.0))
"""Each card class and the cap that stands in for it (what the card leaves free for a run, less a margin; an 80 GB
H100 is its own class, run under 78 GiB)."""
NOTEBOOK_RECIPES = ("baseline", "compiled", "peer", "accelerated")
RUNG_NOTEBOOKS = ("optimization_ladder", "your_model")


def notebook_times() -> str:
    """A table per notebook, a row per card class: the whole notebook's full profile under the class's cap, timed from
    its first cell to its last (``benchmarks/gpu_notebook.sh``'s ``notebooks_caps_*/notebook_*.json``), with what each
    recipe ran (the plan's setting, img/s, peak reserved) and ``accelerated`` over ``peer``; "not run whole yet"
    where no record is."""
    records = [json.loads(path.read_text()) for path in RESULTS.glob("notebooks_caps_*/notebook_*.json")]
    blocks, unrun = [], []
    for notebook, title in NOTEBOOKS.items():
        ran = [record for record in records if record["notebook"] == notebook]
        if notebook == "optimization_ladder" and ran:  # longer than a call: its parts put together, rung by rung
            blocks.append(f"**{title}**\n\n" + _rungs_by_cap(ran))
            continue
        if notebook in RUNG_NOTEBOOKS:  # rungs, not the four recipes: how many finished
            if not ran:
                unrun.append(title)
                continue
            lines = [f"**{title}**", "", "| cap | rungs | GPU | steps per run | first cell to last | "
                     "runs that finished | runs that do not fit (shown so, before they start) |",
                     "|---|---|---|---|---|---|---|"]
            for record in sorted(_newest(ran, lambda record: (float(record["cap_gib"]),
                                                              str(record["params"].get("rungs")))),
                                 key=lambda record: float(record["cap_gib"])):
                cells = _record_cells(record)
                runs = [run for run in record["runs"].values() if run]
                done = sum(bool(run.get("samples_per_s")) for run in runs)
                too_large = sum(run.get("failure", {}).get("kind") == "does_not_fit" for run in runs)
                rungs = ", ".join(record["params"].get("rungs") or ["all"])
                lines.append(f"| {float(record['cap_gib']):g} GiB | {rungs} | {' | '.join(cells)} | "
                             f"{done} of {len(runs)} | {too_large} |")
            blocks.append("\n".join(lines))
            continue
        lines = [f"**{title}**", "", "| card (cap) | GPU | steps per run | first cell to last | " + " | ".join(
            f"`{recipe}`" for recipe in NOTEBOOK_RECIPES) + " | `accelerated` / `peer` |",
            "|---|---|---|---|" + "---|" * (len(NOTEBOOK_RECIPES) + 1)]
        for card, cap in CARD_CAPS:
            at_cap = _newest([record for record in ran if float(record["cap_gib"]) == cap],
                             lambda record: float(record["cap_gib"]))
            if not at_cap:
                lines.append(f"| {card} ({cap:g} GiB) | not run whole yet |" + " |" * (len(NOTEBOOK_RECIPES) + 3))
            for record in at_cap:
                lines.append(f"| {card} ({cap:g} GiB) | " + " | ".join(_notebook_row(record)) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks + ([f"Not run whole under a cap yet: {' and '.join(unrun)}."] if unrun else []))


def _rungs_by_cap(records: list[dict]) -> str:
    """The ladder under each cap, a row per rung: the newest run of the rung under that cap from whichever part ran
    it (a finished or refused run before a stopped one), and the parts those runs came from, their times summed."""
    caps = sorted({float(record["cap_gib"]) for record in records})
    shown: dict[float, dict[str, tuple[dict, dict]]] = {cap: {} for cap in caps}
    for record in sorted(records, key=lambda record: record["date"]):
        for rung, run in record["runs"].items():
            if not run:
                continue
            at_cap = shown[float(record["cap_gib"])]
            if rung not in at_cap or _settled(run) or not _settled(at_cap[rung][1]):
                at_cap[rung] = (record, run)
    rungs = sorted({rung for by_rung in shown.values() for rung in by_rung})
    lines = ["| rung | " + " | ".join(f"{cap:g} GiB" for cap in caps) + " |", "|---|" + "---|" * len(caps)]
    for rung in rungs:
        lines.append(f"| {rung} | " + " | ".join(_rung_cell(*shown[cap][rung]) if rung in shown[cap] else "-"
                                                for cap in caps) + " |")
    parts = []
    for cap in caps:
        used = list({id(record): record for record, _ in shown[cap].values()}.values())
        wall = sum(int(record["wall_s"]) for record in used)
        gpus = ", ".join(dict.fromkeys(record["gpu"].replace("NVIDIA ", "") for record in used))
        cut = sum(record["exit_code"] == 124 for record in used)
        parts.append(f"{len(used)} part{'s' * (len(used) > 1)} on {gpus}, {wall // 60} min {wall % 60} s"
                     + (f", {cut} of them stopped by the call's time limit" if cut else ""))
    lines.append("| its parts, first cell to last | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def _settled(run: dict) -> bool:
    """Whether a rung's run finished or was refused before it started (not stopped by memory or a time limit)."""
    return bool(run.get("samples_per_s")) or (run.get("failure") or {}).get("kind") == "does_not_fit"


def _rung_cell(record: dict, run: dict) -> str:
    """What one rung ran under a cap: the plan's setting, img/s and reserved; ``does not fit``; or why it stopped."""
    failure = run.get("failure") or {}
    if run.get("samples_per_s"):
        return _recipe_cell(run)
    if failure.get("kind") == "does_not_fit":
        return "does not fit"
    if record["exit_code"] == 124 and failure.get("kind") != "out_of_memory":
        return "stopped by its call's time limit"
    return "stopped: " + (failure.get("reason") or "no summary").split(" with ")[0]


def _newest(records: list[dict], key) -> list[dict]:
    """The newest record of each ``key``: a notebook run again at a cap (new code, another GPU) replaces its row."""
    newest: dict = {}
    for record in sorted(records, key=lambda record: record["date"]):
        newest[key(record)] = record
    return list(newest.values())


def _record_cells(record: dict) -> list[str]:
    """A whole-notebook record's GPU, steps and wall time."""
    wall = int(record["wall_s"])
    code = record["exit_code"]
    stopped = {0: "", 124: " (stopped at its time limit)"}.get(code, f" (stopped, exit {code})")
    seeded = ", with the footprints an earlier run learned" if record.get("footprints_from") else ""
    return [record["gpu"].replace("NVIDIA ", ""), str(record["params"].get("steps", "the profile's")),
            f"{wall // 60} min {wall % 60} s{stopped}{seeded}"]


def _notebook_row(record: dict) -> list[str]:
    """One whole-notebook record's cells after the card: the GPU, the steps, the wall time, each recipe, the ratio."""
    # the notebook's recipe runs: not its runs of the training step alone (``model_step/<recipe>``), nor an empty
    # entry (a folder, not a run, in earlier records)
    runs = {name: run for name, run in record["runs"].items() if run and "/" not in name}
    fast, peer = (runs.get(name, {}).get("samples_per_s") for name in ("accelerated", "peer"))
    return [*_record_cells(record), *(_recipe_cell(runs.get(name)) for name in NOTEBOOK_RECIPES),
            f"{fast / peer:.2f}x" if fast and peer else "-"]


def _recipe_cell(run: dict | None) -> str:
    """``8, checkpointing, EMA on the CPU: 27.0 img/s, 14.9 GiB`` (the setting the plan ran, with ``the 3rd tried``
    where others ran out of memory first), ``stopped: <why>`` or ``-``."""
    from gallery_lib.run.memory_plan import MemoryPlan

    if not run:
        return "-"
    if not run.get("samples_per_s"):
        failure = run.get("failure", {})
        reason = failure.get("reason", "no summary")
        return reason if failure.get("kind") == "does_not_fit" else f"stopped: {reason}"
    recorded = run.get("memory_plan")
    plan = MemoryPlan.from_dict(recorded) if recorded else None
    setting = (plan.chosen.short() + plan.moved_state(short=True) if plan and plan.chosen
               else f"{run['global_batch_size']}")
    tried = len((recorded or {}).get("gave_way") or ())
    setting += f" (the {_ordinal(tried + 1)} tried)" if tried else ""
    return f"{setting}: {run['samples_per_s']:,.1f} img/s, {run['peak_reserved_mb'] / 1024:.1f} GiB"


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``."""
    return f"{n}{'th' if n % 100 in (11, 12, 13) else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


BLOCKS = {"headline": headline_table, "cpu-gallery": cpu_gallery_time, "memory-classes": memory_classes,
          "memory-classes-vision": lambda: memory_classes(VISION_FAMILIES), "memory-classes-ladder": ladder_classes,
          "memory-measured": measured_classes, "notebook-times": notebook_times}


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
