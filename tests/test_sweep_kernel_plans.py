"""benchmarks/sweep_kernel_plans.py on CPU: plan grids, knob restore and best-plan choice with a fake GPU timer."""

import sys
from pathlib import Path

import pytest
import torch
from script_testing import load_script

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_BENCH))  # the sweep imports bench_kernels as a sibling module, as when run as a script
sweep = load_script("benchmarks/sweep_kernel_plans.py")

ln_mod = sweep.ln_mod


def test_plans_cover_the_grid():
    grid = {"A": (1, 2), "B": (None, 4, 8)}
    got = sweep.plans(grid)
    assert len(got) == 6 and {"A": 2, "B": None} in got and {"A": 1, "B": 8} in got


def test_knobs_are_restored_after_an_error():
    before = ln_mod.BWD_TILE
    with pytest.raises(RuntimeError):
        with sweep.knobs(ln_mod, BWD_TILE=123):
            assert ln_mod.BWD_TILE == 123
            raise RuntimeError("boom")
    assert ln_mod.BWD_TILE == before


def test_sweep_picks_the_fastest_plan_and_records_failures():
    """The fake timer runs every built call and reports a time set by the knobs in force: the sweep must report the
    plan with the smallest time, keep the failed plan as an error row, and leave the module's knobs unchanged."""
    grids = {("layer_norm", "forward"): (ln_mod, {"FWD_TILE": (1024, 2048, 8192)}),
             ("layer_norm", "backward"): (ln_mod, {"BWD_PROGRAMS_PER_SM": (2, 8)})}
    defaults = (ln_mod.FWD_TILE, ln_mod.BWD_PROGRAMS_PER_SM)

    def timer(build, n_sets):
        for call in build(n_sets):
            call()
        if ln_mod.FWD_TILE == 8192:
            raise RuntimeError("out of resources")
        return {1024: 3.0, 2048: 1.0}.get(ln_mod.FWD_TILE, 2.0) + ln_mod.BWD_PROGRAMS_PER_SM / 100

    case = sweep.bk._ln_case(6, 8, torch.float32)
    rows = sweep.sweep_case(case, torch.float32, timer, l2_bytes=1 << 10, copy_gbs=1000.0, device="cpu",
                            compile_fn=lambda fn: fn, grids=grids)
    fwd, bwd = rows
    assert fwd["best_plan"] == {"FWD_TILE": 2048} and fwd["best_ms"] == pytest.approx(1.0 + defaults[1] / 100)
    assert [p.get("error", "").startswith("RuntimeError") for p in fwd["plans"]] == [False, False, True]
    assert bwd["best_plan"] == {"BWD_PROGRAMS_PER_SM": 2}
    assert fwd["best_vs_compiled"] == pytest.approx(fwd["best_ms"] / fwd["compiled_ms"])
    assert (ln_mod.FWD_TILE, ln_mod.BWD_PROGRAMS_PER_SM) == defaults
