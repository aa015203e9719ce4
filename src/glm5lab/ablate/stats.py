"""Seed statistics for the ablation studies: intervals, differences, and one verdict rule.

Every study runs each arm over a few seeds. A comparison between two arms is decided by the
95% interval of their difference, never by the sign of two means:

  reproduced             the interval excludes zero on the side the report found;
  opposite               it excludes zero on the other side;
  inconclusive at n      it contains zero: the seeds do not decide. `seeds_needed` says how many
                         seeds the observed spread would need for the interval to exclude zero at
                         the observed difference (a power estimate, 80%, with t quantiles).

A claim that two arms are the SAME (the report's "full adaptation recovers dense") is judged by an
equivalence test instead (`compare_equivalent`, two one-sided tests at a declared margin +-delta):
"reproduced" when the 90% interval of the difference lies inside (-delta, +delta), "opposite" when
the 95% interval lies wholly outside [-delta, +delta] (the arms differ by more than the margin),
"inconclusive at n seeds" otherwise.

Intervals are Student-t intervals (named "t" in what is reported): mean +- t_{0.975, n-1} s/sqrt(n)
for one arm; for two arms, which share their seeds (the same data order and initialisation per
seed), the t-interval of the per-seed differences ("paired t"). One seed gives no interval (its bounds are None) and is always inconclusive.

Source: standard small-sample inference (Student 1908); the power estimate is the usual approximation
n >= ((t_{1-a/2} + t_{power}) s / |d|)^2 with the t quantiles at n - 1 degrees of freedom; equivalence: Schuirmann
(1987), two one-sided tests, the same with t_{1-a} and delta - |d| in place of t_{1-a/2} and |d|.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as _scipy_stats

CONFIDENCE = 0.95
POWER = 0.8


@dataclass(frozen=True)
class Interval:
    """mean, sd (sample; 0.0 for one value), n, and the confidence interval [low, high] (None
    for n < 2); method names how it was computed ("t", "paired t")."""

    mean: float
    sd: float
    n: int
    low: float | None
    high: float | None
    method: str

    def text(self, digits: int = 3) -> str:
        """'m ± sd [lo, hi]' (mean, sample sd, the interval; 'm' alone when there is no interval)."""
        if self.low is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _values(values: Sequence[float], what: str) -> list[float]:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError(f"{what}: no values (one per seed needed)")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"{what}: non-finite value in {vals}")
    return vals


def interval(values: Sequence[float], *, confidence: float = CONFIDENCE) -> Interval:
    """Student-t interval of the mean of `values` (one per seed). Raises ValueError for no
    values or a non-finite one."""
    vals = _values(values, "interval")
    n, m = len(vals), statistics.fmean(vals)
    if n < 2:
        return Interval(m, 0.0, n, None, None, "t")
    sd = statistics.stdev(vals)
    half = _t(confidence, n - 1) * sd / math.sqrt(n)
    return Interval(m, sd, n, m - half, m + half, "t")


def paired_difference(a: Sequence[float], b: Sequence[float], *, confidence: float = CONFIDENCE) -> Interval:
    """Interval of mean(a - b) over seeds run by both arms, a[i] and b[i] from the same seed.
    Raises ValueError when the lengths differ."""
    a, b = _values(a, "paired_difference a"), _values(b, "paired_difference b")
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} values against {len(b)}: pair them by seed")
    d = interval([x - y for x, y in zip(a, b, strict=True)], confidence=confidence)
    return Interval(d.mean, d.sd, d.n, d.low, d.high, "paired t")


def verdict(diff: Interval, report_sign: int) -> str:
    """The rule: 'reproduced' when the interval excludes zero on the report's side (report_sign +1: the report
    found the difference positive, -1 negative), 'opposite' when it excludes zero on the other side, else
    'inconclusive at n seeds'; also inconclusive ('... (no spread observed)') when every seed gave the same
    nonzero difference: a zero-width interval is an artefact of few, quantised scores, not certainty. Raises
    ValueError for a report_sign other than +1 or -1."""
    if report_sign not in (1, -1):
        raise ValueError(f"report_sign must be +1 or -1 (the sign the report found), got {report_sign}")
    if diff.low is None or diff.low <= 0.0 <= diff.high:
        return f"inconclusive at {diff.n} seed{'s' if diff.n != 1 else ''}"
    if diff.sd == 0.0:  # a zero-width interval from identical per-seed differences (quantised scores)
        return f"inconclusive at {diff.n} seeds (no spread observed)"
    side = 1 if diff.low > 0.0 else -1
    return "reproduced" if side == report_sign else "opposite"


MAX_SEEDS = 1000
"""`seeds_needed` above this is reported as "more than 1000": the difference is ~0 for the spread."""


def seeds_needed(diff: Interval, *, confidence: float = CONFIDENCE, power: float = POWER) -> int | None:
    """Seeds for an interval that excludes zero at the observed difference with probability `power`, if the
    per-seed spread is the observed one: the smallest n >= 2 with (t_{1-a/2, n-1} + t_{power, n-1}) sd /
    sqrt(n) <= |mean| (Student-t quantiles, so a spread seen over 2-3 seeds is not trusted like a known one),
    MAX_SEEDS + 1 (read "more than MAX_SEEDS") when no n up to MAX_SEEDS does. None when it cannot be said
    (one seed, or no difference and no spread)."""
    if diff.n < 2 or (diff.mean == 0.0 and diff.sd == 0.0):
        return None
    return _smallest_n(abs(diff.mean), diff.sd, 1 - (1 - confidence) / 2, power)


def _smallest_n(effect: float, sd: float, q: float, power: float) -> int:
    """Smallest n in [2, MAX_SEEDS] with (t_{q, n-1} + t_{power, n-1}) sd / sqrt(n) <= effect
    (bisection: the left side falls with n), else MAX_SEEDS + 1."""
    def enough(n: int) -> bool:
        return (_scipy_stats.t.ppf(q, n - 1) + _scipy_stats.t.ppf(power, n - 1)) * sd / math.sqrt(n) <= effect

    if effect <= 0 or not enough(MAX_SEEDS):
        return MAX_SEEDS + 1
    lo, hi = 2, MAX_SEEDS
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid + 1, hi)
    return lo


def _t(confidence: float, dof: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return float(_scipy_stats.t.ppf(1 - (1 - confidence) / 2, dof))


def per_seed(runs: dict, key: str) -> dict:
    """{seed: run[key]} of one arm's raw numbers `runs` ({seed: {key: value, ...}}): what `compare` pairs."""
    return {seed: r[key] for seed, r in runs.items()}


def seed_values(runs: dict, key: str) -> list[float]:
    """[run[key] for each seed] of one arm's raw numbers `runs` ({seed: {key: value, ...}}), in seed order."""
    return [r[key] for r in runs.values()]


def seed_mean(runs: dict, key: str) -> float:
    """The mean over seeds of `seed_values(runs, key)`."""
    return statistics.fmean(seed_values(runs, key))


def compare(a_by_seed: dict, b_by_seed: dict, report_sign: int) -> dict:
    """Arm a against arm b over the seeds both ran (dict keys: seed -> value): the paired
    interval of a - b, its verdict against the report's sign (+1 / -1: the report found a - b
    positive / negative) and the seeds the spread would need. Returns {"diff": Interval,
    "verdict": str, "seeds_needed": int | None}. Raises ValueError when no seed is shared."""
    seeds = sorted(set(a_by_seed) & set(b_by_seed))
    if not seeds:
        raise ValueError(f"compare: the arms share no seed ({sorted(a_by_seed)} vs {sorted(b_by_seed)})")
    d = paired_difference([a_by_seed[s] for s in seeds], [b_by_seed[s] for s in seeds])
    return {"diff": d, "verdict": verdict(d, report_sign), "seeds_needed": seeds_needed(d)}


def compare_text(c: dict, digits: int = 3) -> str:
    """'+0.012 [-0.010, +0.034]: inconclusive at 3 seeds (~12 needed)' for a `compare` result (the
    95% interval); for a `compare_equivalent` result the 90% interval its verdict is decided by:
    '+0.6 [-0.6, +1.7] (90%, margin +-2): reproduced'."""
    d, v = c["diff"], c["verdict"]
    shown = c.get("tost", d)
    text = f"{d.mean:+.{digits}f}" + ("" if shown.low is None else f" [{shown.low:+.{digits}f}, {shown.high:+.{digits}f}]")
    if "margin" in c:
        text += f" (90%, margin +-{c['margin']:g})"
    need, more = c["seeds_needed"], ""
    if v.startswith("inconclusive") and need is not None and "no spread" not in v:
        if "margin" in c and abs(d.mean) >= c["margin"]:
            more = " (the difference is beyond the margin)"
        else:
            more = f" (more than {MAX_SEEDS} needed)" if need > MAX_SEEDS else f" (~{need} needed)"
    return f"{text}: {v}{more}"


def compare_equivalent(a_by_seed: dict, b_by_seed: dict, margin: float) -> dict:
    """An equivalence claim (the report found a ~ b) judged by two one-sided tests at +-margin,
    paired by seed: 'reproduced' when the 90% paired interval of a - b lies inside (-margin,
    +margin), 'opposite' when the 95% one lies wholly outside [-margin, +margin], else
    'inconclusive at n seeds'. Returns the keys of `compare` ("diff" is the 95% interval) plus "margin" and "tost"
    (the 90% interval). seeds_needed: the smallest n with (t_{0.95, n-1} + t_{power, n-1}) sd / sqrt(n) <= margin
    - |mean|, MAX_SEEDS + 1 when |mean| >= margin. Raises ValueError for margin <= 0 or no shared seed."""
    if not margin > 0:
        raise ValueError(f"margin = {margin} is not allowed: a positive equivalence margin")
    seeds = sorted(set(a_by_seed) & set(b_by_seed))
    if not seeds:
        raise ValueError(f"compare_equivalent: the arms share no seed ({sorted(a_by_seed)} vs {sorted(b_by_seed)})")
    a, b = [a_by_seed[s] for s in seeds], [b_by_seed[s] for s in seeds]
    d95, d90 = paired_difference(a, b), paired_difference(a, b, confidence=1 - 2 * (1 - CONFIDENCE))
    if d95.low is not None and d95.sd > 0 and (d95.high < -margin or d95.low > margin):
        v = "opposite"
    elif d90.low is not None and d90.sd > 0 and -margin < d90.low and d90.high < margin:
        v = "reproduced"
    else:
        v = f"inconclusive at {d95.n} seed{'s' if d95.n != 1 else ''}"
        v += " (no spread observed)" if d95.n > 1 and d95.sd == 0 else ""
    return {"diff": d95, "verdict": v, "seeds_needed": _equivalence_seeds(d95, margin), "margin": margin,
            "tost": d90}


def _equivalence_seeds(diff: Interval, margin: float) -> int | None:
    if diff.n < 2:
        return None
    return _smallest_n(margin - abs(diff.mean), diff.sd, CONFIDENCE, POWER)
