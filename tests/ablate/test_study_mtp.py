"""`glm5lab ablate mtp --quick`: the files, rows depth 1 / depth 3 with k = 1..4 beside the report's
2.76 / 2.55, acceptance lengths within [1, k + 1], seeds recorded; and the study's helpers."""

import json
import math

import pytest

from glm5lab.ablate import study_mtp
from glm5lab.ablate.measure import val_prompts
from glm5lab.ablate.runner import StudyArgs, run_study


def test_quick_run_writes_acceptance_table_beside_the_report(tmp_path, study_corpus):
    path, text = run_study(StudyArgs("mtp", quick=True, out=str(tmp_path), progress=False, data=str(study_corpus)))
    assert path == tmp_path / "table.md"
    assert (tmp_path / "mtp.png").stat().st_size > 1000
    info = json.loads((tmp_path / "results.json").read_text())
    assert info["seeds"] == [0]
    for depth in (1, 3):
        for mode in ("greedy", "T=1"):
            line = next(ln for ln in text.splitlines() if ln.startswith(f"| depth {depth} | {mode} |"))
            assert "2.76" in line and "2.55" in line
        res = info["raw"]["0"][str(depth)]
        for mode in ("greedy", "T=1"):
            for k in (1, 2, 3, 4):
                assert 1.0 <= res["acceptance_length"][mode][str(k)] <= k + 1
        assert len(res["val_ce_by_depth"]) == 5 and all(math.isfinite(v) and v > 0 for v in res["val_ce_by_depth"])
    assert info["settings"]["stages"]["1"]["mtp_weights"] == [0.3]
    assert info["settings"]["stages"]["3"]["mtp_weights"] == [0.3, 0.3, 0.3]
    assert "extrapolation" in text


def test_stages_differ_only_in_unroll_depth():
    s = study_mtp.SIZES["quick"]
    one, three = study_mtp.stage(s, 1), study_mtp.stage(s, 3)
    assert (one.mtp_depth, three.mtp_depth) == (1, 3)
    assert (one.steps, one.seq_len, one.batch_size, one.lr) == (three.steps, three.seq_len, three.batch_size, three.lr)
    with pytest.raises(ValueError, match="depth = 2"):
        study_mtp.stage(s, 2)
    c1, c3 = study_mtp.config(s, 1), study_mtp.config(s, 3)
    assert c1.replace(mtp_depth=3) == c3 and c1.num_nextn_predict_layers == 1


def test_prompts_are_validation_text(bench):
    s = study_mtp.SIZES["quick"]
    rows = val_prompts(bench, s)
    assert len(rows) == s["prompts"] and all(len(r) == s["prompt_len"] for r in rows)
    assert rows[0] == bench.val_tokens[:s["prompt_len"]].tolist()
