"""The ablation verdict arithmetic against hand-computed cases: t-intervals, paired
differences, the reproduced / opposite / inconclusive rule, and the seeds-needed estimate.

Tolerance: 1e-6 absolute (quantiles from scipy; hand values to 6+ digits)."""

import math

import pytest

from glm5lab.ablate.stats import compare_equivalent, compare_text, interval, paired_difference, seeds_needed, verdict

T_975_DOF2 = 4.302653  # Student t quantile 0.975, 2 degrees of freedom (tables)
T_975_DOF3 = 3.182446
T_95_DOF2 = 2.919986  # 0.95 quantile, 2 dof: the 90% two-sided interval of two one-sided tests


def test_t_interval_by_hand():
    """[1, 2, 3]: mean 2, sd 1, half-width t(0.975, 2) / sqrt(3) = 2.484138."""
    iv = interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.sd, iv.n, iv.method) == (2.0, 1.0, 3, "t")
    half = T_975_DOF2 / math.sqrt(3)
    assert iv.low == pytest.approx(2 - half, abs=1e-6) and iv.high == pytest.approx(2 + half, abs=1e-6)
    assert iv.text() == "2.000 ± 1.000 [-0.484, 4.484]"
    one = interval([3.5])
    assert (one.low, one.high, one.sd) == (None, None, 0.0) and one.text() == "3.500"


def test_paired_difference_pairs_by_seed():
    """Seeds share data: a - b = [0.10, 0.12, 0.08, 0.10] (mean 0.10, sd 0.016330) although the
    arms alone spread 100x wider; half-width t(0.975, 3) sd / 2 = 0.025984."""
    a, b = [3.30, 3.52, 3.18, 3.60], [3.20, 3.40, 3.10, 3.50]
    d = paired_difference(a, b)
    assert d.method == "paired t" and d.n == 4
    assert d.mean == pytest.approx(0.10, abs=1e-9) and d.sd == pytest.approx(0.0163299, abs=1e-6)
    assert d.low == pytest.approx(0.10 - T_975_DOF3 * 0.0163299 / 2, abs=1e-6)
    assert verdict(d, +1) == "reproduced" and verdict(d, -1) == "opposite"
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_difference(a, b[:3])


def test_verdict_rule_inconclusive_and_opposite_cases():
    inconclusive = interval([0.02, -0.01, 0.03])   # mean 0.0133, contains 0
    assert verdict(inconclusive, +1) == "inconclusive at 3 seeds" == verdict(inconclusive, -1)
    opposite = interval([-0.30, -0.25, -0.35])      # excludes 0 below: report said +
    assert verdict(opposite, +1) == "opposite" and verdict(opposite, -1) == "reproduced"
    assert verdict(interval([0.5]), +1) == "inconclusive at 1 seed"
    with pytest.raises(ValueError, match="report_sign must be"):
        verdict(opposite, 0)


def test_seeds_needed_by_hand():
    """sd 1, mean 0.5: the smallest n with (t_{0.975, n-1} + t_{0.8, n-1}) / sqrt(n) <= 0.5:
    n = 33: (2.036933 + 0.853087) / 5.744563 = 0.50307 > 0.5; n = 34: (2.034515 + 0.852971) /
    5.830952 = 0.49514 -> 34 seeds (the normal approximation says 32); never below 2; a
    difference ~0 for its spread reads "more than 1000" (1001)."""
    iv = interval([0.5 - 1, 0.5, 0.5 + 1])          # mean 0.5, sd 1
    assert seeds_needed(iv) == 34
    assert seeds_needed(interval([1.0, 1.1, 0.9])) == 2
    assert seeds_needed(interval([1.0])) is None and seeds_needed(interval([0.0, 0.0])) is None
    assert seeds_needed(interval([-1.0, 1.0])) == 1001  # mean 0, sd 1.41: no realistic seed count


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="no values"):
        interval([])
    with pytest.raises(ValueError, match="non-finite"):
        interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence must be in"):
        interval([1.0, 2.0], confidence=1.5)


def test_compare_pairs_shared_seeds_and_says_what_is_needed():
    from glm5lab.ablate.stats import compare, compare_text

    a = {"0": 3.30, "1": 3.52, "2": 3.18, "3": 9.99}
    b = {"0": 3.20, "1": 3.40, "2": 3.10}
    c = compare(a, b, -1)  # seeds 0-2 only; the report found a - b negative
    assert c["diff"].n == 3 and c["diff"].mean == pytest.approx((0.10 + 0.12 + 0.08) / 3)
    assert c["verdict"] == "opposite" and compare_text(c).endswith(": opposite")
    noisy = compare({"0": 1.0, "1": 1.2, "2": 0.9}, {"0": 1.05, "1": 1.0, "2": 1.0}, +1)
    assert noisy["verdict"] == "inconclusive at 3 seeds" and "needed)" in compare_text(noisy)
    with pytest.raises(ValueError, match="share no seed"):
        compare({"0": 1.0}, {"1": 1.0}, +1)


def test_mla_study_verdicts_from_seeds():
    """Hand-made per-seed scores: GQA-8 worse than MLA in every seed (the report: better) ->
    opposite; MLA + Muon Split better in every seed (as the report) -> reproduced; MLA-256 +
    Muon Split scattered around MLA -> inconclusive."""
    from glm5lab.ablate import study_mla

    mla = {"0": 3.35, "1": 3.36, "2": 3.34}
    loss = {"MLA": mla, "GQA-8": {s: v + 0.05 + 0.001 * i for i, (s, v) in enumerate(mla.items())},
            "MLA + Muon Split": {s: v - 0.04 - 0.002 * i for i, (s, v) in enumerate(mla.items())},
            "MLA-256 + Muon Split": {"0": 3.37, "1": 3.33, "2": 3.35}}
    raw = {row: {s: {"val_loss": v, "mqar_accuracy": 0.27} for s, v in by_seed.items()} for row, by_seed in loss.items()}
    cmps = study_mla.comparisons(raw)
    assert cmps["GQA-8"]["loss"]["verdict"] == "opposite"
    assert cmps["MLA + Muon Split"]["loss"]["verdict"] == "reproduced"
    assert cmps["MLA-256 + Muon Split"]["loss"]["verdict"] == "inconclusive at 3 seeds"
    assert cmps["GQA-8"]["mqar"]["verdict"] == "inconclusive at 3 seeds"  # equal accuracies: a zero interval


def test_dsa_study_verdicts_from_seeds():
    """Per-seed MQAR at the longest length (lists in seed order): warm-up only below dense in
    every seed (the report: -7.86) -> reproduced; full adaptation above dense in every seed (the
    report: -0.35, i.e. the sign it found is negative) -> opposite."""
    from glm5lab.ablate import study_dsa

    lengths = [64, 128]
    raw = {"dense": {"64": [50.0, 52.0, 51.0], "128": [30.0, 32.0, 31.0]},
           "warm-up only": {"64": [40.0, 41.0, 42.0], "128": [20.0, 23.0, 21.0]},
           "full adaptation": {"64": [55.0, 56.0, 57.0], "128": [35.0, 36.0, 35.5]}}
    assert study_dsa.comparison(raw, "warm-up only", lengths)["verdict"] == "reproduced"
    assert study_dsa.comparison(raw, "full adaptation", lengths)["verdict"] == "opposite"


def test_mtp_study_verdict_from_seeds():
    """Acceptance at k=4: depth 3 above depth 1 in every seed, as the report (GLM-5 2.76 >
    DeepSeek-V3.2 2.55) -> reproduced; greedy scattered -> inconclusive."""
    from glm5lab.ablate import study_mtp

    def run(greedy: float, sampled: float) -> dict:
        return {"acceptance_length": {"greedy": {"4": greedy}, "T=1": {"4": sampled}}}

    raw = {"0": {"1": run(2.0, 2.1), "3": run(2.1, 2.5)}, "1": {"1": run(2.2, 2.0), "3": run(2.1, 2.45)},
           "2": {"1": run(2.1, 2.2), "3": run(2.15, 2.6)}}
    assert study_mtp.comparison(raw, "T=1")["verdict"] == "reproduced"
    assert study_mtp.comparison(raw, "greedy")["verdict"] == "inconclusive at 3 seeds"


def test_swa_study_verdict_from_seeds():
    """1:1 SWA below full beyond the window in every seed (the report: far below) -> reproduced."""
    from glm5lab.ablate import study_swa

    def cell(score: float) -> dict:
        return {"score": score, "mqar": score / 100, "niah": score / 100}

    raw = {"full": {"0": {"64": cell(80.0), "128": cell(60.0)}, "1": {"64": cell(82.0), "128": cell(58.0)},
                    "2": {"64": cell(81.0), "128": cell(59.0)}},
           "1:1 SWA": {"0": {"64": cell(80.0), "128": cell(20.0)}, "1": {"64": cell(81.0), "128": cell(25.0)},
                       "2": {"64": cell(80.0), "128": cell(22.0)}}}
    c = study_swa.comparison(raw, "1:1 SWA", [128], [0, 1, 2])
    assert c["report"] < 0 and c["diff"].mean == pytest.approx(-36.666667) and c["verdict"] == "reproduced"
    two = study_swa.comparison(raw, "1:1 SWA", [128], [0, 1])  # -40, -33: t(0.975, 1) = 12.7 keeps 0 inside
    assert two["verdict"] == "inconclusive at 2 seeds"


def test_equivalence_by_hand():
    """Paired differences a - b = 0.1, -0.1, 0.0 (mean 0, sd 0.1, n 3): the 90% interval is
    +-2.919986 x 0.1 / sqrt(3) = +-0.168586, inside +-0.5 -> reproduced; not inside +-0.15, and
    the 95% one (+-0.248414) is not wholly outside it -> inconclusive, with the smallest n where
    (t_{0.95, n-1} + t_{0.8, n-1}) x 0.1 / sqrt(n) <= 0.15: n = 4: (2.353363 + 0.978472) x 0.1 / 2
    = 0.1666 > 0.15; n = 5: (2.131847 + 0.940965) x 0.1 / 2.236068 = 0.1374 -> 5 seeds. Differences
    3.0, 3.2, 2.8 at margin 1: 95% interval 3 +- 0.496828 lies above +1 -> opposite."""
    a, b = {0: 1.1, 1: 0.9, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}
    c = compare_equivalent(a, b, 0.5)
    assert c["verdict"] == "reproduced" and c["margin"] == 0.5
    assert c["tost"].high == pytest.approx(T_95_DOF2 * 0.1 / math.sqrt(3), abs=1e-6)
    assert c["diff"].high == pytest.approx(T_975_DOF2 * 0.1 / math.sqrt(3), abs=1e-6)
    tight = compare_equivalent(a, b, 0.15)
    assert tight["verdict"] == "inconclusive at 3 seeds" and tight["seeds_needed"] == 5
    assert compare_text(tight, 2) == "+0.00 [-0.17, +0.17] (90%, margin +-0.15): inconclusive at 3 seeds (~5 needed)"
    far = compare_equivalent({0: 3.0, 1: 3.2, 2: 2.8}, dict.fromkeys(range(3), 0.0), 1.0)
    assert far["verdict"] == "opposite" and far["diff"].low == pytest.approx(3 - T_975_DOF2 * 0.2 / math.sqrt(3), abs=1e-6)
    assert far["seeds_needed"] == 1001  # |mean| beyond the margin: more seeds cannot show equivalence
    assert compare_text(far, 1).endswith("(90%, margin +-1): opposite")
    beyond = compare_equivalent({0: 3.0, 1: 3.2}, {0: 0.0, 1: 0.0}, 2.0)  # 90% [2.47, 3.73]: t(0.95, 1) = 6.31
    assert compare_text(beyond, 1) == "+3.1 [+2.5, +3.7] (90%, margin +-2): inconclusive at 2 seeds (the difference is beyond the margin)"
    assert compare_equivalent({0: 1.0}, {0: 1.0}, 0.5)["verdict"] == "inconclusive at 1 seed"
    with pytest.raises(ValueError, match="margin = 0"):
        compare_equivalent(a, b, 0)
    with pytest.raises(ValueError, match="share no seed"):
        compare_equivalent({0: 1.0}, {1: 1.0}, 0.5)


def test_dsa_recovery_is_judged_as_equivalence():
    """Full adaptation within 0.5 points of dense in every seed: the report's "recovers dense"
    (-0.35 at 128K) is reproduced by the equivalence test (margin 2 points), where the
    sign rule would have called it inconclusive."""
    from glm5lab.ablate import study_dsa

    raw = {"dense": {"128": [30.0, 32.0, 31.0]}, "warm-up only": {"128": [29.0, 33.0, 30.0]},
           "full adaptation": {"128": [30.2, 31.6, 31.1]}}
    c = study_dsa.comparison(raw, "full adaptation", [128])
    assert c["margin"] == study_dsa.RECOVERY_MARGIN == 2.0 and c["verdict"] == "reproduced"
    assert study_dsa.comparison(raw, "warm-up only", [128])["verdict"] == "inconclusive at 3 seeds"


def test_zero_spread_is_not_certainty():
    """Two seeds whose differences are identical (quantised MQAR scores) give a zero-width
    interval: inconclusive, not reproduced; the same under the equivalence test."""
    from glm5lab.ablate.stats import compare

    c = compare({0: 50.0, 1: 60.0}, {0: 49.21875, 1: 59.21875}, 1)
    assert c["diff"].low == c["diff"].high and c["verdict"] == "inconclusive at 2 seeds (no spread observed)"
    assert compare_text(c, 2) == "+0.78 [+0.78, +0.78]: inconclusive at 2 seeds (no spread observed)"
    e = compare_equivalent({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0}, 0.5)
    assert e["verdict"] == "inconclusive at 2 seeds (no spread observed)"
