"""`glm5lab ablate dsa --quick`: the folder, the table beside the report, raw numbers, seeds."""

import json
import math

import pytest

from glm5lab.ablate import study_dsa
from glm5lab.ablate.report_figures import DSA, DSA_128K
from tests.ablate.conftest import run_quick


@pytest.fixture(scope="module")
def quick(tmp_path_factory, study_corpus):
    return run_quick(tmp_path_factory, "dsa", study_corpus)


def test_quick_writes_table_results_and_plot(quick):
    out, text = quick
    assert (out / "table.md").read_text() == text
    assert (out / "dsa.png").stat().st_size > 1000
    info = json.loads((out / "results.json").read_text())
    assert info["study"] == "dsa" and info["quick"] and info["seeds"] == [0]
    assert info["settings"]["model"]["index_topk"] == study_dsa.SIZES["quick"]["topk"]


def test_table_holds_every_arm_and_the_report_figures(quick):
    _, text = quick
    for arm in (*study_dsa.ARMS, "base (before)"):
        assert f"| {arm} |" in text
    for arm, figures in DSA.items():
        line = next(row for row in text.splitlines() if row.startswith(f"| {arm} |"))
        assert all(f"{v:.3f}" in line for v in figures)
    assert f"{DSA_128K['DSA'][1]:.3f}" in text and "paired [95% t]: verdict" in text
    lengths = [study_dsa.SIZES["quick"]["T"] * k for k in study_dsa.SIZES["quick"]["scales"]]
    assert all(f"T={n}" in text for n in lengths)


def test_raw_accuracies_are_percentages_per_arm_length_and_seed(quick):
    out, _ = quick
    raw = json.loads((out / "results.json").read_text())["raw"]["mqar_accuracy_pct"]
    assert set(raw) == set(study_dsa.EVAL_DSA)
    for by_length in raw.values():
        assert len(by_length) == len(study_dsa.SIZES["quick"]["scales"])
        for values in by_length.values():
            assert len(values) == 1 and all(math.isfinite(v) and 0 <= v <= 100 for v in values)


def test_stages_follow_the_report_recipe_with_matched_further_steps():
    s = study_dsa.SIZES["cpu"]
    plan = study_dsa.stages(s)
    warm = plan["warm-up only"][0]
    assert warm.trainable == "indexer" and warm.lm_weight == 0 and warm.indexer_weight == 1 and not warm.use_dsa
    adapt = plan["full adaptation"][-1]
    assert adapt.use_dsa and adapt.trainable == "all" and adapt.indexer_weight == 1
    assert not any(st.use_dsa for st in plan["base"] + plan["dense"])
    further = {arm: sum(st.steps for st in plan[arm]) for arm in study_dsa.ARMS}
    assert set(further.values()) == {s["W"] + s["A"]}


def test_config_selects_at_the_training_length_and_reaches_the_longest():
    for s in study_dsa.SIZES.values():
        cfg = study_dsa.config(s)
        assert cfg.index_topk < s["T"] and cfg.max_position_embeddings == s["T"] * max(s["scales"])
        assert cfg.indexer_types == ["full"] * s["layers"] and not cfg.use_dsa
