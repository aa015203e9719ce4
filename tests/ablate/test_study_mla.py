"""`glm5lab ablate mla --quick`: the files, every variant row beside the report's figures, finite
scores in range, seeds recorded; and the study's helpers (GQA-8 gets no Muon Split, cache widths,
rank correlation)."""

import json
import math

from glm5lab.ablate import study_mla
from glm5lab.ablate.models import study_config, variant_config
from glm5lab.ablate.report_figures import MLA, mean
from glm5lab.ablate.runner import StudyArgs, run_study


def test_quick_run_writes_table_with_report_figures_and_every_variant(tmp_path, study_corpus):
    path, text = run_study(StudyArgs("mla", quick=True, out=str(tmp_path), progress=False, data=str(study_corpus)))
    assert path == tmp_path / "table.md"
    assert (tmp_path / "mla.png").stat().st_size > 1000
    info = json.loads((tmp_path / "results.json").read_text())
    assert info["seeds"] == [0] and info["quick"]
    for row, figures in MLA.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row} |"))
        assert all(f"{v:.1f}" in line for v in figures) and f"{mean(figures):.2f}" in line
        scores = info["raw"][row]["0"]
        assert 0 < scores["val_loss"] < 10 and 0 <= scores["mqar_accuracy"] <= 1
        assert all(math.isfinite(v) for v in scores.values())
    assert "Report ordering" in text and "Spearman" in text
    s = info["settings"]
    assert s["optimizers"]["GQA-8"] == "muon" and s["optimizers"]["MLA + Muon Split"] == "muon-split"
    assert s["gqa_muon_split_equals_muon"] is True
    assert set(s["models"]) == set(MLA) and s["tokens_per_variant"] == s["steps"] * s["size"]["batch"] * s["size"]["T"]


def test_muon_split_changes_mla_groups_but_not_gqa():
    base = study_config(hidden_size=32, num_hidden_layers=1, num_nextn_predict_layers=0)
    assert study_mla.same_groups_for_gqa(variant_config(base, "gqa-8"))
    assert not study_mla.same_groups_for_gqa(variant_config(base, "mla"))


def test_cache_values_per_token_per_layer():
    base = study_config(hidden_size=32, num_hidden_layers=1, num_nextn_predict_layers=0)
    gqa, mla = variant_config(base, "gqa-8"), variant_config(base, "mla")
    assert study_mla.cache_values(gqa) == 2 * (16 + 8 + 16)         # 2 KV heads x (QK 24 + V 16)
    assert study_mla.cache_values(mla) == 32 + 8                    # latent + shared RoPE key


def test_spearman_and_ranking():
    ref = ["a", "b", "c", "d"]
    assert study_mla.spearman(ref, ref) == 1.0
    assert study_mla.spearman(ref[::-1], ref) == -1.0
    assert study_mla.ranking({"a": 2.0, "b": 1.0}, higher_is_better=False) == ["b", "a"]
