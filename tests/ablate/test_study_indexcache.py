"""`glm5lab ablate indexcache --quick`: the folder, every retention x method row, raw numbers."""

import json
import math

import pytest
import torch

from glm5lab.ablate import study_indexcache
from glm5lab.ablate.fit import dsa_stages
from tests.ablate.conftest import run_quick


@pytest.fixture(scope="module")
def quick(tmp_path_factory, study_corpus):
    return run_quick(tmp_path_factory, "indexcache", study_corpus)


def test_quick_writes_table_results_and_plot(quick):
    out, text = quick
    assert (out / "table.md").read_text() == text
    assert (out / "indexcache.png").stat().st_size > 1000
    info = json.loads((out / "results.json").read_text())
    assert info["study"] == "indexcache" and info["seeds"] == [0]
    assert info["settings"]["model"]["use_dsa"] is True


def test_table_has_every_row_and_says_the_report_has_no_figures(quick):
    _, text = quick
    for r in ("1", "0.5", "0.25"):
        for m in study_indexcache.METHODS:
            assert f"| {r} | {m} |" in text
    assert "INDEXCACHE is None" in text and "1.5-2x" in text


def test_raw_rows_are_finite_and_in_range(quick):
    out, _ = quick
    per_seed = json.loads((out / "results.json").read_text())["raw"]["per_seed"]["0"]
    rows = per_seed["rows"]
    layers = study_indexcache.SIZES["quick"]["layers"]
    assert [(x["retention"], x["method"]) for x in rows] == [(r, m) for r in study_indexcache.RETENTIONS
                                                            for m in study_indexcache.METHODS]
    for x in rows:
        assert x["full_layers"] == max(1, round(x["retention"] * layers)) == x["pattern"].count("F")
        assert x["pattern"][0] == "F"
        assert all(math.isfinite(x[k]) and x[k] > 0 for k in ("calib_loss", "heldout_loss", "attn_ms_T",
                                                              "attn_ms_long", "speedup_long"))
        assert 0 <= x["mqar_T"] <= 100 and 0 <= x["mqar_4T"] <= 100
    assert rows[0]["pattern"] == "F" * layers and rows[0]["speedup_long"] == 1.0
    assert per_seed["dense_attn_ms_long"] > 0


def test_attention_ms_times_every_model_and_restores_threads():
    from glm5lab import GLM5ForCausalLM

    s = study_indexcache.SIZES["quick"]
    torch.manual_seed(0)
    model = GLM5ForCausalLM(study_indexcache.config(s)).eval()
    threads = torch.get_num_threads()
    ms = study_indexcache.attention_ms([model, model], torch.randint(0, 400, (1, 2 * s["T"])), 2)
    assert len(ms) == 2 and all(math.isfinite(v) and v > 0 for v in ms)
    assert torch.get_num_threads() == threads


def test_stages_end_with_sparse_adaptation():
    st = dsa_stages(study_indexcache.SIZES["cpu"])
    assert [x.name for x in st] == ["dense", "indexer_warmup", "sparse_adaptation"]
    assert st[1].trainable == "indexer" and st[2].use_dsa and st[2].indexer_weight == 1
