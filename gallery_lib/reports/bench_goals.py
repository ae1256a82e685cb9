"""The speed goals each family declares (``ModelFamily.speed_goals``), judged from the rows of one ``gallery bench``
run: each met, not met, or not measured.

Every verdict carries the numbers it was judged from, and a goal whose rows the run did not measure (another model,
another batch size, a CPU's tiny configs) says so instead of judging from other numbers. The goals are for an H100 or
H200 (a speedup over the peer at a family's batch); the result file names the GPU the rows were measured on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from gallery_lib.config import families
from gallery_lib.config.family import SpeedGoal
from gallery_lib.reports.bench import REFERENCE, Row, find_row, ratio_over_peer

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"


@dataclass(frozen=True)
class GoalResult:
    goal: str
    status: str
    """``met``, ``not met`` or ``not measured`` (in this run)."""
    numbers: str
    """What the verdict was judged from, or which rows were missing."""

    def line(self) -> str:
        return f"[{self.status}] {self.goal}: {self.numbers}"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def check_goals(rows: Sequence[Row], goals: Iterable[SpeedGoal] | None = None) -> list[GoalResult]:
    """Each goal (by default every registered family's, in the registry's order) judged from ``rows``."""
    if goals is None:
        goals = [goal for family in families.FAMILIES.values() for goal in family.speed_goals]
    return [_CHECKS[goal.check](rows, goal.model, **goal.limits) for goal in goals]


def speedup_goal(rows: Sequence[Row], model: str, batch_size: int, *, min_ratio: float,
                 max_spread: float | None = None, min_samples_per_s: float | None = None) -> GoalResult:
    """``accelerated`` at least ``min_ratio`` times ``peer`` at ``batch_size``; with ``max_spread``, its steps steady
    too (p80/p20 at most that); with ``min_samples_per_s``, at least that fast."""
    goal = (f"{model}: accelerated >= {min_ratio:.2f}x {REFERENCE} at batch {batch_size}"
            f"{limits_beyond_ratio(max_spread, min_samples_per_s)}")
    fast, peer = find_row(rows, model, "accelerated", batch_size), find_row(rows, model, REFERENCE, batch_size)
    missing = [name for name, row in (("accelerated", fast), (REFERENCE, peer)) if row is None]
    if missing:
        return GoalResult(goal, NOT_MEASURED, f"no {' and no '.join(missing)} row at batch {batch_size}")
    if "error" in peer:
        return GoalResult(goal, NOT_MEASURED, f"{REFERENCE} failed: {peer['error']}")
    if "error" in fast:
        return GoalResult(goal, NOT_MET, f"accelerated failed: {fast['error']}")
    ratio = ratio_over_peer(rows, fast)
    spread = fast["p80_step_ms"] / fast["p20_step_ms"]
    numbers = (f"{fast['samples_per_s']:,.1f} against {peer['samples_per_s']:,.1f} samples/s = "
               f"{ratio_text(ratio, min_ratio)}; "
               f"accelerated p20-p80 {fast['p20_step_ms']:.1f}-{fast['p80_step_ms']:.1f} ms (p80/p20 {spread:.3f})")
    met = (ratio >= min_ratio and (max_spread is None or spread <= max_spread)
           and (min_samples_per_s is None or fast["samples_per_s"] >= min_samples_per_s))
    return GoalResult(goal, MET if met else NOT_MET, numbers)


def limits_beyond_ratio(max_spread: float | None = None, min_samples_per_s: float | None = None, **_: object) -> str:
    """A speedup goal's limits beyond its ratio (it takes the goal's whole ``limits``), as its verdict and README's
    table say them: ``, p80/p20 <= 1.05, >= 6,000 samples/s``, or nothing."""
    text = f", p80/p20 <= {max_spread:.2f}" if max_spread else ""
    return text + (f", >= {min_samples_per_s:,.0f} samples/s" if min_samples_per_s else "")


def ratio_text(ratio: float, goal: float | None) -> str:
    """``ratio`` to two decimals, or to as many more (up to four) as keep it on its side of ``goal`` (if any): 1.295
    against 1.3 reads 1.295x, not 1.30x beside "not met"."""
    digits = 2
    while goal is not None and digits < 4 and (round(ratio, digits) >= goal) != (ratio >= goal):
        digits += 1
    return f"{ratio:.{digits}f}x"


def throughput_goal(rows: Sequence[Row], model: str, *, min_samples_per_s: float) -> GoalResult:
    """``accelerated`` reaches ``min_samples_per_s`` at the best batch size this run measured."""
    goal = f"{model}: accelerated >= {min_samples_per_s:g} samples/s at its best batch"
    tried = [r for r in rows if (r["model"], r["recipe"]) == (model, "accelerated")]
    ran = [r for r in tried if "error" not in r]
    if not ran:
        failed = "; ".join(f"batch {r['batch_size']}: {r['error']}" for r in tried)
        return GoalResult(goal, NOT_MEASURED, f"no finished accelerated row{' (' + failed + ')' if failed else ''}")
    best = max(ran, key=lambda r: r["samples_per_s"])
    mfu = f", MFU {best['mfu']:.1%}" if best.get("mfu") is not None else ""
    others = ", ".join(f"{r['batch_size']}" + (f" ({r['error']})" if "error" in r else "") for r in tried)
    numbers = f"best {best['samples_per_s']:,.1f} samples/s at batch {best['batch_size']}{mfu}; batches run: {others}"
    return GoalResult(goal, MET if best["samples_per_s"] >= min_samples_per_s else NOT_MET, numbers)


def ema_cost_goal(rows: Sequence[Row], model: str, *, max_cost: float) -> GoalResult:
    """The ``accelerated`` step with its EMA at most ``max_cost`` slower than the same run with ``ema=off``
    (``--recipes accelerated,accelerated+ema=off``), at every batch size that has both."""
    goal = f"{model}: the accelerated step with EMA on at most {max_cost:.0%} slower than with it off"
    pairs = []
    for on in rows:
        if (on["model"], on["recipe"]) != (model, "accelerated") or "error" in on or on.get("ema") == "off":
            continue
        off = next((r for r in rows if r["model"] == model and r["batch_size"] == on["batch_size"]
                    and r["recipe"].split("+")[0] == "accelerated" and r.get("ema") == "off" and "error" not in r),
                   None)
        if off is not None:
            pairs.append((on, off))
    if not pairs:
        return GoalResult(goal, NOT_MEASURED, "no batch size with both an EMA-on and an EMA-off accelerated row "
                                              "(add accelerated+ema=off to --recipes)")
    costs = [(on["batch_size"], off["samples_per_s"] / on["samples_per_s"] - 1, on, off) for on, off in pairs]
    numbers = "; ".join(f"batch {b}: {on['samples_per_s']:,.1f} (EMA {on['ema']}) against {off['samples_per_s']:,.1f} "
                        f"samples/s (off): EMA costs {cost:.1%}" for b, cost, on, off in costs)
    return GoalResult(goal, MET if all(cost <= max_cost for _, cost, _, _ in costs) else NOT_MET, numbers)


def compile_time_goal(rows: Sequence[Row], model: str, caches: str, *, max_s: float) -> GoalResult:
    """Every ``accelerated`` row whose run found the compile caches ``caches`` (``cold``: it compiled a graph;
    ``warm``: it loaded them all, a second run on the machine) reached steady speed within ``max_s`` seconds:
    precompilation plus the slow warm-up steps (``to_steady_s``)."""
    goal = f"{model}: accelerated at steady speed within {max_s:g} s with {caches} compile caches"
    found = [r for r in rows if (r["model"], r["recipe"]) == (model, "accelerated") and "error" not in r
             and r.get("compile_caches") == caches and r.get("to_steady_s") is not None]
    if not found:
        how = "a second run of the recipe in the same call" if caches == "warm" else "a fresh cache directory"
        return GoalResult(goal, NOT_MEASURED, f"no accelerated row with {caches} caches ({how} measures it)")
    numbers = "; ".join(f"batch {r['batch_size']}: {r['to_steady_s']:.1f} s" for r in found)
    return GoalResult(goal, MET if all(r["to_steady_s"] <= max_s for r in found) else NOT_MET, numbers)


_CHECKS = {"speedup": speedup_goal, "throughput": throughput_goal, "ema_cost": ema_cost_goal,
           "compile_time": compile_time_goal}


def describe_goals(rows: Sequence[Row], device: str | None) -> str:
    """The verdicts as printed lines, under a header naming where the rows were measured."""
    results = check_goals(rows)
    head = f"The speed goals (for an H100 or H200), from this run's own numbers on {device or 'this machine'}:"
    return "\n".join([head, *(f"  {result.line()}" for result in results)])
