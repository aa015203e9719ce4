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


def test_table_has_every_row_and_the_papers_figures(quick):
    _, text = quick
    assert "| 1 | full | `FFFF` |" in text and "| 51.0 / 74.2 |" in text
    for r in ("0.5", "0.25"):
        for m in study_indexcache.METHODS:
            assert f"| {r} | {m} |" in text
    assert "| 0.5 | distillation | `FsFs` |" in text and text.count("51.6 / 74.5") == 1 and "49.8 / -" in text
    for claim in ("distillation below warm-up", "distillation recovers full DSA"):
        assert f"| 0.5 | {claim} |" in text and f"| 0.25 | {claim} |" in text
    assert "margin +-0.01" in text and "1.5-2x" in text


def test_raw_rows_are_finite_and_in_range(quick):
    out, _ = quick
    info = json.loads((out / "results.json").read_text())
    per_seed = info["raw"]["per_seed"]["0"]
    rows = per_seed["rows"]
    layers = study_indexcache.SIZES["quick"]["layers"]
    assert [(x["retention"], x["method"]) for x in rows] == [(1.0, "full")] + [
        (r, m) for r in study_indexcache.RETENTIONS for m in study_indexcache.METHODS]
    for x in rows:
        assert x["full_layers"] == max(1, round(x["retention"] * layers)) == x["pattern"].count("F")
        assert x["pattern"][0] == "F"
        assert all(math.isfinite(x[k]) and x[k] > 0 for k in ("heldout_loss", "heldout_bpb", "attn_ms_long",
                                                              "prefill_ms_long", "decode_ms_long", "speedup_long"))
        assert all(0 <= x[k] <= 100 for k in ("mqar_T", "mqar_4T", "niah_T"))
    by = {(x["retention"], x["method"]): x for x in rows}
    for r in study_indexcache.RETENTIONS:  # the trained arms take the uniform pattern
        assert by[(r, "warm-up")]["pattern"] == by[(r, "distillation")]["pattern"] == by[(r, "uniform")]["pattern"]
        assert by[(r, "warm-up")]["heldout_loss"] != by[(r, "distillation")]["heldout_loss"]
    assert rows[0]["pattern"] == "F" * layers and rows[0]["speedup_long"] == 1.0
    assert per_seed["dense_attn_ms_long"] > 0
    assert set(info["raw"]["last_losses"]["0"]) == {"full", "warm-up 0.5", "distillation 0.5", "warm-up 0.25",
                                                     "distillation 0.25"}
    assert info["settings"]["stages"]["served"][1]["indexer_target"] == "served"


def test_result_rebuilds_the_table_from_raw_and_settings(quick):
    out, text = quick
    info = json.loads((out / "results.json").read_text())
    again = study_indexcache.result(info["raw"], info["settings"], info["seeds"])
    assert again.table.rstrip() in text and again.notes == info["notes"]


def test_readme_row_names_the_papers_figures(quick):
    out, _ = quick
    row = study_indexcache.readme_row(json.loads((out / "results.json").read_text()))
    assert "training-aware 51.6 / 74.5 vs full DSA 51.0 / 74.2" in row["paper"] and "49.8" in row["paper"]
    assert "distillation below warm-up (1/2)" in row["verdict"] and "full DSA" in row["ours"]


def test_branch_continues_the_run_it_left(bench):
    """fit through the dense stage, then the rest from `start` with the same optimizer == one fit: the branches
    see the batches the whole run would have seen."""
    import copy

    from glm5lab.ablate.fit import STUDY_HYPER, fit
    from glm5lab.ablate.models import seeded_model

    s = {**study_indexcache.SIZES["quick"], "base_steps": 3, "W": 2, "A": 2}
    stages = dsa_stages(s)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=0)
    whole = seeded_model(study_indexcache.config(s), 0)
    fit(whole, stages, batches)
    part = seeded_model(study_indexcache.config(s), 0)
    opt = STUDY_HYPER.build_optimizer(part, stages[0].lr)
    fit(part, stages[:1], batches, optimizer=opt)
    part = copy.deepcopy(part)
    opt2 = STUDY_HYPER.build_optimizer(part, stages[0].lr)
    opt2.load_state_dict(opt.state_dict())
    fit(part, stages, batches, optimizer=opt2, start={"step": 3, "stage": 1, "in_stage": 0})
    for (name, a), b in zip(whole.state_dict().items(), part.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_time_models_times_every_model_and_restores_threads():
    from glm5lab import GLM5ForCausalLM

    s = study_indexcache.SIZES["quick"]
    torch.manual_seed(0)
    model = GLM5ForCausalLM(study_indexcache.config(s)).eval()
    threads = torch.get_num_threads()
    times = study_indexcache.time_models([model, model], torch.randint(0, 400, (1, 2 * s["T"])), 3, 2)
    assert len(times) == 2 and all(set(t) == {"attn_ms_long", "prefill_ms_long", "decode_ms_long"} for t in times)
    assert all(math.isfinite(v) and v > 0 for t in times for v in t.values())
    assert torch.get_num_threads() == threads


def test_stages_end_with_sparse_adaptation():
    st = dsa_stages(study_indexcache.SIZES["cpu"])
    assert [x.name for x in st] == ["dense", "indexer_warmup", "sparse_adaptation"]
    assert st[1].trainable == "indexer" and st[2].use_dsa and st[2].indexer_weight == 1
    assert {x.indexer_target for x in st} == {"own"}
    assert [x.indexer_target for x in dsa_stages(study_indexcache.SIZES["cpu"], "served")] == ["own", "served", "served"]


def test_heldout_score_is_the_last_targets_nll_and_its_bits_per_byte(bench):
    from glm5lab import GLM5ForCausalLM
    from glm5lab.evals.bpb import target_bytes, token_byte_lengths
    from glm5lab.evals.variants import mean_nll

    s = study_indexcache.SIZES["quick"]
    torch.manual_seed(0)
    model = GLM5ForCausalLM(study_indexcache.config(s)).eval()
    rows = bench.text_windows("val", s["T"])[:3]
    last = s["T"] - s["topk"]
    lengths = token_byte_lengths(bench.tokenizer, model.config.vocab_size)
    got = study_indexcache.heldout_score(model, rows, last, lengths)
    with torch.no_grad():
        want = mean_nll(model, rows, last)
    assert got["heldout_loss"] == pytest.approx(want, rel=1e-5)  # fp32 sums in another order
    nbytes = target_bytes(lengths, rows[:, -last:])
    assert got["heldout_bpb"] == pytest.approx(want * rows.shape[0] * last / (math.log(2) * nbytes), rel=1e-5)
