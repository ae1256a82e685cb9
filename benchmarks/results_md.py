"""``benchmarks/RESULTS.md``, written from its sections' sources and the results index.

Each section of RESULTS.md has a source, ``benchmarks/results_sections/<anchor>.md``: the prose that says what ran, the
command and what it means, in Markdown, with its tables of measured runs as placeholders. A placeholder names rows of
``benchmarks/results.jsonl`` (``benchmarks/results_index.py``), one per line, by the file they came from and their
model, recipe, batch, processes or order in the file, and the columns to show::

    <!-- runs
    file: peer_layout_h200/bench_sd_b32_cl.json
    columns: label as recipe | img/s | vs peer+channels_last | step ms | reserved | steady
    row: | recipe=peer
    row: peer + channels_last | recipe=peer+channels_last
    file: peer_layout_h200/bench_sd_b32_cold.json
    row: the peer, cold | recipe=peer
    -->

A row's label comes before ``|`` (empty: the recipe, as code); its selector's keys are ``file`` (by default the
``file:`` given last before the row), ``model``, ``recipe``, ``batch``, ``processes`` and ``nth`` (the n-th match),
shell-quoted where a value holds a space. Without ``row:`` lines every row of ``file`` is shown, in its order. A
selector that matches no row, or more than one without ``nth=``, is an error that names the section.

Columns: ``label``, ``recipe``, ``model``, ``batch``, ``gpus``, ``gpu``, ``commit``, ``img/s``, ``step ms`` (median
[p20-p80]), ``reserved`` and ``allocated`` (peak GiB), ``steady`` (seconds to steady speed, with the caches' state),
``vs RECIPE`` (img/s over that recipe's first row in the same file for the same model; quoted where it holds a space)
and ``scaling`` (img/s over the processes times the one-process row's); ``as`` names a column's header.

A result file that holds a plain list of records renders as it is: ``<!-- table`` with ``file:``, ``rows:`` (the key
of the list) and ``columns:`` (its records' keys; numbers to four significant digits). Tables whose evidence is no
such list (kernel timings, attention backends, CI durations, logs) stay in the source as Markdown, each citing its file.

    python benchmarks/results_md.py           # writes benchmarks/RESULTS.md
    python benchmarks/results_md.py --check   # exit status 1, naming the sections, where the committed file differs
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
SOURCES = BENCHMARKS / "results_sections"
RESULTS = BENCHMARKS / "results"
INDEX = BENCHMARKS / "results.jsonl"
OUTPUT = BENCHMARKS / "RESULTS.md"

SECTIONS = (  # the sources in the order RESULTS.md shows them; _head.md is the title and contents
    "_head", "head", "swin", "sd15-recipes", "sd15-memory", "memory-plan", "peer-layout", "sd15-compile-time", "kernels",
    "ema", "attention", "refactor-check", "resnet50", "optimization-ladder", "two-gpus", "your-model", "dreambooth",
    "peer", "sd15-levers", "sd15-gn-by-batch", "bench-h100", "cpu-avx512-transpose", "cpu-gallery", "ci")
GENERATED = ("<!-- Written by python benchmarks/results_md.py from benchmarks/results_sections/ and\n"
             "     benchmarks/results.jsonl: edit those, then run it. -->\n")
PLACEHOLDER = re.compile(r"<!-- (runs|table)\n(.*?)\n-->", re.S)
HEADERS = {"label": "run", "recipe": "recipe", "model": "model", "batch": "batch", "gpus": "GPUs", "gpu": "GPU",
           "commit": "commit", "img/s": "img/s", "step ms": "step ms: median [p20-p80]",
           "reserved": "peak reserved GiB", "allocated": "peak allocated GiB", "steady": "to steady speed (s)",
           "scaling": "scaling over one process"}
SELECTOR_KEYS = ("file", "model", "recipe", "batch", "processes", "nth")


@dataclass
class Column:
    key: str
    header: str


@dataclass
class Row:
    label: str
    run: dict[str, Any]


def render(index: list[dict[str, Any]]) -> str:
    """RESULTS.md: every section's source with its placeholders rendered."""
    return GENERATED + "\n".join(render_section(name, index) for name in SECTIONS)


def render_section(name: str, index: list[dict[str, Any]]) -> str:
    """``results_sections/<name>.md`` with its placeholders rendered; an error names the source."""
    text = (SOURCES / f"{name}.md").read_text(encoding="utf-8").rstrip("\n") + "\n"
    try:
        return PLACEHOLDER.sub(lambda match: _placeholder(match.group(1), match.group(2), index), text)
    except ValueError as error:
        raise ValueError(f"results_sections/{name}.md: {error}") from None


def _placeholder(kind: str, body: str, index: list[dict[str, Any]]) -> str:
    spec, rows = parse(body)
    if kind == "table":
        return file_table(spec)
    return runs_table(spec, rows, index)


def parse(body: str) -> tuple[dict[str, str], list[tuple[str, str, str | None]]]:
    """A placeholder's ``key: value`` lines, and its ``row: label | selector`` lines in order, each with the ``file:``
    given last before it."""
    spec, rows = {}, []
    for line in body.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"a placeholder line is not 'key: value': {line!r}")
        if key.strip() == "row":
            label, bar, selector = value.partition("|")
            if not bar:
                raise ValueError(f"a row line is not 'row: label | selector': {line!r}")
            rows.append((label.strip(), selector.strip(), spec.get("file")))
        else:
            spec[key.strip()] = value.strip()
    return spec, rows


def runs_table(spec: dict[str, str], selectors: list[tuple[str, str, str | None]],
               index: list[dict[str, Any]]) -> str:
    """A Markdown table of index rows: those the selectors name, or every row of ``spec["file"]``."""
    columns = _columns(spec.get("columns", "label | img/s | step ms | reserved"))
    if selectors:
        rows = [Row(label, select(index, selector, file)) for label, selector, file in selectors]
    else:
        rows = [Row("", run) for run in index if run["file"] == spec.get("file")]
        if not rows:
            raise ValueError(f"no index row comes from {spec.get('file')!r}")
    lines = ["| " + " | ".join(column.header for column in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(column.key, row, index) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def _columns(text: str, known: bool = True) -> list[Column]:
    """``key as header | key | ...``: a runs table's keys are ``HEADERS``' and ``vs RECIPE`` (``known``)."""
    columns = []
    for entry in text.split("|"):
        key, _, header = (part.strip() for part in entry.partition(" as "))
        if known and key not in HEADERS and not key.startswith("vs "):
            raise ValueError(f"unknown column {key!r}")
        columns.append(Column(key, header or (HEADERS.get(key, key) if known else key)))
    return columns


def select(index: list[dict[str, Any]], selector: str, default_file: str | None) -> dict[str, Any]:
    """The one index row that ``selector`` (``recipe=peer batch=32 nth=2 ...``, shell-quoted) names in its file."""
    words = shlex.split(selector)
    wanted = dict(word.split("=", 1) for word in words if "=" in word)
    unknown = set(wanted) - set(SELECTOR_KEYS)
    if unknown or len(wanted) < len(words) or "file" not in wanted and default_file is None:
        raise ValueError(f"selector {selector!r}: keys are {', '.join(SELECTOR_KEYS)}, and a file is needed")
    wanted.setdefault("file", default_file)
    nth = int(wanted.pop("nth", 0))
    fields = {"batch": "batch_size"}
    matches = [run for run in index
               if all(str(run.get(fields.get(key, key))) == value for key, value in wanted.items())]
    if not matches or len(matches) > 1 and not nth or nth > len(matches):
        raise ValueError(f"selector {selector!r} matches {len(matches)} rows of {wanted['file']} "
                         f"({'add nth=' if matches else 'see benchmarks/results.jsonl'})")
    return matches[nth - 1 if nth else 0]


def cell(key: str, row: Row, index: list[dict[str, Any]]) -> str:
    """One table cell: ``row``'s value for the column ``key``, empty where the run did not record it."""
    run = row.run
    if key == "label":
        return row.label or f"`{run['recipe']}`"
    if key.startswith("vs "):
        return _ratio(run, index, key[3:].strip().strip('"'))  # a recipe with spaces is quoted
    if key == "scaling":
        return _scaling(run, index)
    values = {"recipe": f"`{run['recipe']}`", "model": run["model"], "batch": run["batch_size"],
              "gpus": run["processes"], "gpu": _gpu(run["gpu"]), "commit": run["commit"],
              "img/s": _number(run["samples_per_s"], 1), "step ms": _step(run),
              "reserved": _number(run["peak_reserved_gib"], 2), "allocated": _number(run["peak_allocated_gib"], 2),
              "steady": _steady(run)}
    value = values[key]
    return "" if value is None else str(value)


def _ratio(run: dict[str, Any], index: list[dict[str, Any]], recipe: str) -> str:
    """``run``'s img/s over the first row of ``recipe`` in its file for its model: empty for that recipe's rows."""
    reference = next((other for other in index if other["file"] == run["file"] and other["recipe"] == recipe
                      and other["model"] == run["model"]), None)
    if reference is None or run["recipe"] == recipe:
        return ""
    return f"{run['samples_per_s'] / reference['samples_per_s']:.3f}x"


def _scaling(run: dict[str, Any], index: list[dict[str, Any]]) -> str:
    """Throughput over ``processes`` times that of the same recipe's one-process row in the same file: empty for
    one process, or where the file has no such row."""
    if not run["processes"] or run["processes"] == 1:
        return ""
    one = next((other for other in index if other["file"] == run["file"] and other["recipe"] == run["recipe"]
                and other["batch_size"] == run["batch_size"] and other["processes"] == 1), None)
    return "" if one is None else f"{run['samples_per_s'] / (run['processes'] * one['samples_per_s']):.1%}"


def _number(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:,.{digits}f}"


def _step(run: dict[str, Any]) -> str | None:
    if run["step_ms_p50"] is None:
        return None
    spread = (f" [{run['step_ms_p20']:.1f}-{run['step_ms_p80']:.1f}]"
              if run["step_ms_p20"] is not None and run["step_ms_p80"] is not None else "")
    return f"{run['step_ms_p50']:.1f}{spread}"


def _steady(run: dict[str, Any]) -> str | None:
    if run["to_steady_s"] is None:
        return None
    return f"{run['to_steady_s']:.1f}" + (f" ({run['compile_caches']})" if run["compile_caches"] else "")


def _gpu(name: str | None) -> str | None:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    return None if name is None else name.replace("NVIDIA ", "").split(" ")[0]


def file_table(spec: dict[str, str]) -> str:
    """A Markdown table of a result file's list of records (``spec["rows"]``, its key), one column per named key."""
    path = RESULTS / spec["file"]
    records = json.loads(path.read_text(encoding="utf-8")).get(spec.get("rows", "rows"))
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        raise ValueError(f"{spec['file']} holds no list of records under {spec.get('rows', 'rows')!r}")
    columns = _columns(spec["columns"], known=False)
    lines = ["| " + " | ".join(column.header for column in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_value(record.get(column.key)) for column in columns) + " |" for record in records]
    return "\n".join(lines)


def _value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}"  # four significant digits: 1,469 MB, 20.76 GiB, 8.592
    return f"{value:,}" if isinstance(value, int) else str(value)


def read_index(path: Path = INDEX) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def differing_sections(committed: str, rendered: str) -> list[str]:
    """The anchors of the ``##`` sections (``head`` for the text before the first) where the two texts differ."""
    old, new = _sections(committed), _sections(rendered)
    return [name for name in dict.fromkeys([*new, *old]) if old.get(name) != new.get(name)]


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r'(?=^<a id="[^"]+"></a>\n## )', text, flags=re.M)
    sections = {"head": parts[0]}
    for part in parts[1:]:
        sections[re.match(r'<a id="([^"]+)">', part).group(1)] = part
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    stray = sorted(path.stem for path in SOURCES.glob("*.md") if path.stem not in SECTIONS)
    if stray:
        print(f"results_sections/ holds sources RESULTS.md does not show: {', '.join(stray)} (add them to SECTIONS)",
              file=sys.stderr)
        return 1
    text = render(read_index())
    if not args.check:
        OUTPUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUTPUT} ({text.count(chr(10))} lines)")
        return 0
    committed = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
    if committed == text:
        return 0
    names = ", ".join(f"#{name}" for name in differing_sections(committed, text))
    print(f"{OUTPUT} differs from its sources in {names}: run python benchmarks/results_md.py and commit it",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
