"""``benchmarks/RESULTS.md`` is written from its sections' sources and the results index (``benchmarks/results_md.py``),
and every section the project points at is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from script_testing import load_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"


def _results_md():
    return load_script("benchmarks/results_md.py")


def test_the_committed_results_md_is_what_its_sources_and_the_index_give(capsys):
    assert _results_md().main(["--check"]) == 0, capsys.readouterr().err


def test_a_number_edited_by_hand_is_caught_and_its_section_named(tmp_path, monkeypatch, capsys):
    module = _results_md()
    text = RESULTS_MD.read_text(encoding="utf-8")
    section = text.split('<a id="peer-layout"></a>', 1)[1].split("<a id=", 1)[0]
    edited = text.replace(section, section.replace("| 147.1 |", "| 149.9 |", 1))
    assert edited != text
    monkeypatch.setattr(module, "OUTPUT", tmp_path / "RESULTS.md")
    module.OUTPUT.write_text(edited, encoding="utf-8")
    assert module.main(["--check"]) == 1
    assert "#peer-layout" in capsys.readouterr().err
    assert module.differing_sections(text, edited) == ["peer-layout"]


def _runs(**fields):
    base = {"file": "a.json", "model": "sd15", "recipe": "peer", "batch_size": 32, "processes": 1, "gpu": "NVIDIA H200",
            "commit": "abc1234", "samples_per_s": 100.0, "step_ms_p20": 319.0, "step_ms_p50": 320.0,
            "step_ms_p80": 321.5, "peak_reserved_gib": 40.0, "peak_allocated_gib": 38.5, "to_steady_s": 61.25,
            "compile_caches": "cold"}
    return {**base, **fields}


def test_a_runs_table_shows_the_rows_its_selectors_name_with_ratios_to_their_call():
    module = _results_md()
    index = [_runs(), _runs(recipe="accelerated", samples_per_s=111.4, compile_caches=None),
             _runs(recipe="accelerated", samples_per_s=205.0, processes=2, to_steady_s=None),
             _runs(file="b.json", recipe="plain PyTorch", samples_per_s=50.0)]
    spec, rows = module.parse("file: a.json\ncolumns: label as run | gpus | img/s | vs peer | scaling | step ms | "
                               "reserved | steady\nrow: | recipe=peer\nrow: the recipe, 2 GPUs | recipe=accelerated "
                               "processes=2\nfile: b.json\nrow: plain | recipe=\"plain PyTorch\"")
    assert module.runs_table(spec, rows, index).splitlines() == [
        "| run | GPUs | img/s | vs peer | scaling over one process | step ms: median [p20-p80] | peak reserved GiB "
        "| to steady speed (s) |",
        "|---|---|---|---|---|---|---|---|",
        "| `peer` | 1 | 100.0 |  |  | 320.0 [319.0-321.5] | 40.00 | 61.2 (cold) |",
        "| the recipe, 2 GPUs | 2 | 205.0 | 2.050x | 92.0% | 320.0 [319.0-321.5] | 40.00 |  |",
        "| plain | 1 | 50.0 |  |  | 320.0 [319.0-321.5] | 40.00 | 61.2 (cold) |"]
    with pytest.raises(ValueError, match="matches 2 rows of a.json .add nth="):
        module.select(index, "recipe=accelerated", "a.json")
    with pytest.raises(ValueError, match="matches 0 rows"):
        module.select(index, "recipe=compiled", "a.json")
    assert module.select(index, "recipe=accelerated nth=2", "a.json")["processes"] == 2
    with pytest.raises(ValueError, match="unknown column"):
        module._columns("label | speedup")


def test_a_file_table_renders_a_result_files_list_of_records(tmp_path, monkeypatch):
    module = _results_md()
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    (tmp_path / "probe.json").write_text('{"rows": [{"ema": "gpu", "batch": 1, "checkpointing": false, '
                                         '"reserved": 17.1123, "peak_mb": 1468.94}]}')
    spec, _ = module.parse("file: probe.json\nrows: rows\ncolumns: ema as EMA | batch | checkpointing | reserved | "
                            "peak_mb as peak MB")
    assert module.file_table(spec).splitlines() == ["| EMA | batch | checkpointing | reserved | peak MB |",
                                                    "|---|---|---|---|---|", "| gpu | 1 | no | 17.11 | 1,469 |"]


def test_each_source_is_a_section_of_its_own_anchor_and_types_no_table_of_runs():
    """A source opens with its anchor and heading; a table with an img/s column is a table of training runs, which
    comes from the index (a ``<!-- runs`` placeholder), not typed by hand."""
    module = _results_md()
    assert sorted(path.stem for path in module.SOURCES.glob("*.md")) == sorted(module.SECTIONS)
    for name in module.SECTIONS[1:]:
        text = (module.SOURCES / f"{name}.md").read_text(encoding="utf-8")
        assert text.startswith(f'<a id="{name}"></a>\n## '), name
        lines = text.splitlines()
        headers = [line for line, below in zip(lines, lines[1:]) if line.startswith("|") and below.startswith("|---")]
        typed = [header for header in headers if "img/s" in header]
        assert not typed, f"{name}.md types a table of runs by hand: {typed[0]}"


def _cited_anchors() -> list[tuple[str, str]]:
    """Every ``RESULTS.md#<anchor>`` (or ``RESULTS#<anchor>``) that the project's code, docs, notebooks, scripts and
    result notes point at, with the ``#<anchor>`` cites that follow one (``RESULTS.md#peer, #resnet50``)."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "notebooks").glob("*.ipynb"),
             *(ROOT / "gallery_lib").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "ci").rglob("*.sh"),
             *(path for path in (ROOT / "benchmarks").rglob("*") if path.suffix in {".py", ".sh", ".md"})]
    cites = []
    for path in files:
        for match in re.finditer(r"RESULTS(?:\.md)?#([\w-]+)((?:,? #[\w-]+)*)", path.read_text(encoding="utf-8")):
            names = [match.group(1), *re.findall(r"#([\w-]+)", match.group(2))]
            cites += [(str(path.relative_to(ROOT)), name) for name in names]
    return cites


def test_every_anchor_the_project_cites_is_in_results_md():
    text = RESULTS_MD.read_text(encoding="utf-8")
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    cites = _cited_anchors() + [("benchmarks/RESULTS.md", name) for name in re.findall(r"\]\(#([\w-]+)\)", text)]
    assert len(cites) > 200 and len(anchors) > 40
    assert not [cite for cite in cites if cite[1] not in anchors]


def test_every_notes_file_results_md_links_exists():
    text = RESULTS_MD.read_text(encoding="utf-8")
    notes = set(re.findall(r"\]\((results/[\w./-]+\.md)\)", text))
    assert len(notes) > 20
    assert not [path for path in notes if not (ROOT / "benchmarks" / path).is_file()]
