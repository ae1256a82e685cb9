"""README's numbers are rendered from the result files that hold them (``benchmarks/readme_numbers.py``)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from script_testing import load_script

ROOT = Path(__file__).resolve().parents[1]


def _numbers():
    return load_script("benchmarks/readme_numbers.py")


def test_readme_numbers_are_those_of_their_result_files():
    readme = (ROOT / "README.md").read_text()
    assert _numbers().render(readme) == readme, "run python benchmarks/readme_numbers.py"


def _headline_cell(line: str, column: str) -> str:
    return line.split(" | ")[_numbers().HEADLINE_COLUMNS.index(column)]


def test_a_number_edited_by_hand_is_caught():
    numbers = _numbers()
    readme = (ROOT / "README.md").read_text()
    speedup = _headline_cell(numbers.headline_table().splitlines()[2], "speedup: median [range]")  # 1.42x [1.42-1.42]
    edited = readme.replace(speedup, "1.99x [1.99-1.99]", 1)
    assert edited != readme and numbers.render(edited) == readme
    with pytest.raises(ValueError, match="numbers:headline"):
        numbers.render(readme.replace("<!-- numbers:headline -->", ""))


def _calls(model: str, batch: int) -> list[tuple[dict, dict]]:
    """(peer, accelerated) from each headline call that ran ``model`` at ``batch``, read here from the files."""
    import json

    from gallery_lib.reports.bench import find_row

    numbers = _numbers()
    found = []
    for path in numbers.HEADLINE_CALLS:
        rows = json.loads((numbers.RESULTS / path).read_text())["rows"]
        peer, fast = find_row(rows, model, "peer", batch, 1), find_row(rows, model, "accelerated", batch, 1)
        if peer and fast:
            found.append((peer, fast))
    return found


def test_a_speedup_keeps_the_side_of_its_goal_it_is_on():
    """A headline speedup is the median of its calls' ratios, read against its family's goal: one just under it is
    not rounded onto it."""
    numbers = _numbers()
    table = numbers.headline_table().splitlines()[2:]
    for (label, model, batch), line in zip(numbers.HEADLINE, table, strict=True):
        goal = numbers._speedup_goal(model, batch)["min_ratio"]
        exact = statistics.median(fast["samples_per_s"] / peer["samples_per_s"] for peer, fast in _calls(model, batch))
        shown = float(_headline_cell(line, "speedup: median [range]").split("x")[0])
        assert (shown >= goal) == (exact >= goal), f"{label}: {shown}x shown for {exact:.4f} against {goal}"


def test_the_headline_is_one_commit_with_two_calls_or_more_per_row(monkeypatch):
    """Every headline row reads two calls or more of one commit, with the recipes named as they ship; a call from
    another commit, or a row with one call, is refused when README is rendered."""
    import json

    numbers = _numbers()
    records = [json.loads((numbers.RESULTS / path).read_text()) for path in numbers.HEADLINE_CALLS]
    assert len({record["commit"] for record in records}) == 1
    for label, model, batch in numbers.HEADLINE:
        assert len(_calls(model, batch)) >= 2, label
    assert all(f" | {len(_calls(model, batch))} | " in line
               for (_, model, batch), line in zip(numbers.HEADLINE, numbers.headline_table().splitlines()[2:]))
    older = "peer_layout_h200/bench_sd_b32_cl.json"  # d766383's SD-1.5 call
    monkeypatch.setattr(numbers, "HEADLINE_CALLS", (*numbers.HEADLINE_CALLS, older))
    with pytest.raises(ValueError, match="2 commits"):
        numbers.headline_table()
    monkeypatch.setattr(numbers, "HEADLINE_CALLS", numbers.HEADLINE_CALLS[:1])
    with pytest.raises(ValueError, match="1 call"):
        numbers.headline_table()


FIRST_SCREEN_LINES = 40


def _first_screen() -> str:
    """README up to its first ``##`` heading: what a reader sees before any section's body."""
    lines = (ROOT / "README.md").read_text().splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    return "\n".join(lines[:end])


def test_readme_keeps_the_two_commands_on_its_first_screen():
    """The gallery's command, the test command (``.ci/run`` runs it as README gives it) and the headline table come
    first, before any section, within the first screen."""
    first_screen = _first_screen()
    assert len(first_screen.splitlines()) <= FIRST_SCREEN_LINES, "README's first screen grew: move text below it"
    gallery, tests = "```bash\nbash ci/gallery.sh\n```", "```bash\nbash ci/test.sh\n```"
    assert gallery in first_screen and tests in first_screen
    assert first_screen.index(gallery) < first_screen.index(tests)
    assert "<!-- numbers:headline -->" in first_screen and "<!-- /numbers:headline -->" in first_screen


def test_readme_names_the_rows_that_miss_their_speed_goal():
    """The sentence under the headline table ("missed by ...; met by ...") names the rows whose median speedup over
    their calls (with the accelerated step's p80/p20 and throughput, where the goal sets them) misses their family's
    ``speed_goals``, as the result files have them."""
    import re

    numbers = _numbers()
    missed, met = [], []
    for label, model, batch in numbers.HEADLINE:
        goal = numbers._speedup_goal(model, batch)
        calls = _calls(model, batch)
        ratio = statistics.median(fast["samples_per_s"] / peer["samples_per_s"] for peer, fast in calls)
        ok = (ratio >= goal["min_ratio"]
              and statistics.median(fast["p80_step_ms"] / fast["p20_step_ms"] for _, fast in calls)
              <= goal.get("max_spread", float("inf"))
              and statistics.median(fast["samples_per_s"] for _, fast in calls) >= goal.get("min_samples_per_s", 0.0))
        (met if ok else missed).append(label.split(",")[0])
    sentence = re.search(r"missed by (.*?); met by (.*?)\. ", " ".join(_first_screen().split()))
    assert sentence, "README's first screen says which speed goals the headline rows miss: 'missed by ...; met by ...'"
    said = [[] if part == "none" else part.split(", ") for part in sentence.groups()]
    assert said == [missed, met], f"README says missed {said[0]}, met {said[1]}; the files: {missed}, {met}"
    verdicts = [_headline_cell(line, "goal").rsplit(": ", 1)[1] for line in numbers.headline_table().splitlines()[2:]]
    assert verdicts == ["met" if label.split(",")[0] in met else "missed" for label, _, _ in numbers.HEADLINE]


def _github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_glossary_link_in_readme_names_a_heading_it_has():
    import re

    glossary = (ROOT / "docs" / "glossary.md").read_text()
    anchors: set[str] = set(re.findall(r'<a id="([^"]+)"></a>', glossary))
    for heading in re.findall(r"^#{1,6} (.+)$", glossary, re.M):
        anchor, n = _github_anchor(heading), 1
        while anchor in anchors:  # GitHub numbers a repeated heading's anchor: name-1, name-2
            anchor, n = f"{_github_anchor(heading)}-{n}", n + 1
        anchors.add(anchor)
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"docs/glossary\.md#([^)\s]+)\)", readme)
    inner = re.findall(r"\]\(#([^)\s]+)\)", glossary)  # the glossary's own index
    assert len(links) > 20, "README's first uses of its terms link to docs/glossary.md"
    assert not [name for name in links + inner if name not in anchors]
    assert _github_anchor("torch.compile") == "torchcompile" and _github_anchor("AMP O1 and O2") == "amp-o1-and-o2"


def test_no_user_facing_text_or_code_points_at_an_issue_number():
    import re

    pattern = re.compile(r"\bissues? #?\d+", re.I)
    files = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "gallery_lib").rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in files
             for match in pattern.finditer(path.read_text())]
    assert len(files) > 80 and not found, found


def test_every_pointer_into_results_names_a_section_it_has():
    """Code, docs and notebooks keep one line per decision pointing at ``benchmarks/RESULTS.md#<section>``: each such
    section must exist, as must the targets of RESULTS.md's own ``(#section)`` links."""
    import re

    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = set(re.findall(r'<a id="([^"]+)"></a>', results))
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "notebooks").glob("*.ipynb"),
             *(ROOT / "gallery_lib").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.sh"), *(ROOT / "tests").glob("*.py")]
    pointers = [(path.relative_to(ROOT), name) for path in files
                for name in re.findall(r"RESULTS\.md#([\w-]+)", path.read_text())]
    pointers += [("benchmarks/RESULTS.md", name) for name in re.findall(r"\]\(#([\w-]+)\)", results)]
    assert len(pointers) > 50 and len(sections) > 20
    assert not [pointer for pointer in pointers if pointer[1] not in sections]


def test_results_lists_every_section_in_its_contents():
    import re

    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    contents = results.split("<a id=", 1)[0]
    sections = re.findall(r'<a id="([^"]+)"></a>\n## ', results)
    assert len(sections) > 15 and not [name for name in sections if f"(#{name})" not in contents]


def test_readme_rows_come_from_the_code_their_commits_name():
    """A headline row's result file that records the hash of the code that ran (``source_sha256``) must match the
    code of the commit it names (``provenance.verify_source``); the rows measured before the hash was recorded say
    ``no hash``."""
    import json

    from gallery_lib.reports.provenance import verify_source

    numbers = _numbers()
    statuses = {path: verify_source(json.loads((numbers.RESULTS / path).read_text()), numbers.ROOT)
                for path in numbers.HEADLINE_CALLS}
    assert set(statuses.values()) <= {"verified", "no hash"}, statuses


def test_each_notebook_run_whole_shows_what_each_recipe_ran_and_a_stop(monkeypatch, tmp_path):
    """A table per notebook, a row per card class: the setting each recipe ran (the plan's, with the settings that
    gave way counted), a stopped recipe as stopped, a class with no record as not run; the ladder's rungs counted."""
    import json

    numbers = _numbers()
    plan = {"budget_gib": 16.0, "source": "gpu_memory_gib",  # as a run records its plan
            "chosen": {"batch_size": 8, "accumulation": 2, "checkpointing": True, "uncompiled": False},
            "ema_offloaded": True, "gave_way": ["batch 8, gradient checkpointing"]}
    ran = {"samples_per_s": 20.0, "peak_reserved_mb": 15360.0, "memory_plan": plan, "global_batch_size": 16}
    records = {"notebook_sd.json": {"notebook": "stable_diffusion", "cap_gib": 16, "gpu": "NVIDIA H100", "wall_s": 125,
                                    "date": "2026-12-06 04:00:00",
                                    "exit_code": 1, "params": {"steps": 12}, "runs": {
                                        "baseline": ran, "peer": {**ran, "samples_per_s": 10.0},
                                        "accelerated": {**ran, "samples_per_s": 15.0}, "stable_diffusion": {},
                                        "compiled": {"failure": {"reason": "out of memory at step 3"}}}},
               "notebook_sd_before.json": {"notebook": "stable_diffusion", "cap_gib": 16, "gpu": "NVIDIA H200",
                                           "wall_s": 99, "date": "2026-12-05 04:00:00", "exit_code": 0,
                                           "params": {"steps": 12}, "runs": {"peer": ran}},  # replaced by the newer
               "notebook_ladder.json": {"notebook": "optimization_ladder", "cap_gib": 22, "gpu": "NVIDIA H100",
                                        "date": "2026-12-05 04:00:00", "footprints_from": "an_earlier_run.json",
                                        "wall_s": 60, "exit_code": 0, "params": {"rungs": ["tf32", "batch"]},
                                        "runs": {
                                            "ladder-00-tf32": ran, "ladder-05-batch": {"failure": {}},
                                            "ladder-11-cuda_graphs": {"failure": {"kind": "does_not_fit"}}}},
               "notebook_ladder_b.json": {"notebook": "optimization_ladder", "cap_gib": 22, "gpu": "NVIDIA H200",
                                          "date": "2026-12-06 04:00:00", "wall_s": 600, "exit_code": 124,
                                          "params": {"rungs": ["tf32", "batch"]}, "runs": {  # a later part
                                              "ladder-00-tf32": {"failure": {"kind": "out_of_memory",
                                                                             "reason": "out of memory at step 5"}},
                                              "ladder-05-batch": {"failure": {"kind": "error"}}}},
               "notebook_ladder_38.json": {"notebook": "optimization_ladder", "cap_gib": 38, "gpu": "NVIDIA H100",
                                           "date": "2026-12-06 05:00:00", "wall_s": 30, "exit_code": 0,
                                           "params": {"rungs": ["tf32"]}, "runs": {
                                               "ladder-00-tf32": {"failure": {"kind": "out_of_memory",
                                                                              "reason": "out of memory at step 5 "
                                                                                        "with 21.0 GiB reserved"}}}}}
    (tmp_path / "notebooks_caps_x").mkdir()
    for name, record in records.items():
        (tmp_path / "notebooks_caps_x" / name).write_text(json.dumps(record))
    monkeypatch.setattr(numbers, "RESULTS", tmp_path)
    text = numbers.notebook_times()
    sd = text.split("**Stable Diffusion**")[1].split("**")[0]
    assert "H200" not in sd and "1 min 39 s" not in sd  # the same notebook and cap run again: the newer record only
    assert ("| 16 GB (16 GiB) | H100 | 12 | 2 min 5 s (stopped, exit 1) | 8 x 2, checkpointing, EMA on the CPU "
            "(the 2nd tried): 20.0 img/s, 15.0 GiB | stopped: out of memory at step 3 |") in sd
    assert sd.rstrip().endswith("| 1.50x |\n| 24 GB (22 GiB) | not run whole yet | | | | | | | |\n"
                                "| 40 GB (38 GiB) | not run whole yet | | | | | | | |\n"
                                "| 80 GB (78 GiB) | not run whole yet | | | | | | | |")
    ladder = text.split("**the optimization ladder**")[1].split("**")[0]
    # a rung a row, a cap a column: a finished or refused run kept over a later stopped one, else the newest stop
    assert ("| ladder-00-tf32 | 8 x 2, checkpointing, EMA on the CPU (the 2nd tried): 20.0 img/s, 15.0 GiB | "
            "stopped: out of memory at step 5 |") in ladder
    assert "| ladder-05-batch | stopped by its call's time limit | - |" in ladder
    assert "| ladder-11-cuda_graphs | does not fit | - |" in ladder
    assert ("| its parts, first cell to last | 2 parts on H100, H200, 11 min 0 s, 1 of them stopped by the call's "
            "time limit | 1 part on H100, 0 min 30 s |") in ladder
    assert text.endswith("Not run whole under a cap yet: your model.")
