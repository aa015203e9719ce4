"""`glm5lab ablate baseline --quick`: the files, the three arms and their seeds, bits per byte
recomputed from the raw numbers, the dense GPT's activated parameters against small's (counted on
the meta device, not by the ledger), identical batches for every arm, the README row; and (slow)
the gpu shapes end to end."""

import json
import math

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.ablate import study_baseline as sb
from glm5lab.ablate.runner import StudyArgs, run_study

ARMS = (sb.GLM5, sb.ADAMW, sb.MUON)


@pytest.fixture(scope="module")
def quick(tmp_path_factory, study_corpus):
    out = tmp_path_factory.mktemp("baseline")
    _, text = run_study(StudyArgs("baseline", quick=True, out=str(out), progress=False, data=str(study_corpus)))
    return out, text, json.loads((out / "results.json").read_text())


def test_quick_run_writes_every_arm_and_seed(quick):
    out, text, info = quick
    assert (out / "table.md").is_file() and (out / "baseline.png").stat().st_size > 1000
    assert info["study"] == "baseline" and info["quick"] and info["seeds"] == [0, 1]
    assert set(info["raw"]) == set(ARMS) and all(set(info["raw"][a]) == {"0", "1"} for a in ARMS)
    for arm in ARMS:
        assert any(line.startswith(f"| {arm} |") for line in text.splitlines())
    assert "GLM-5 small vs dense GPT + AdamW" in text and "GLM-5 small vs dense GPT + Muon" in text
    assert "BLiMP accuracy, 1 pairs/paradigm [95% t]" in text  # --quick: the first pair of each of 67 paradigms
    assert all(r["blimp"] * 67 == pytest.approx(round(r["blimp"] * 67)) for a in ARMS for r in info["raw"][a].values())
    s = info["settings"]
    assert s["optimizers"] == {sb.GLM5: "muon-split", sb.ADAMW: "adamw", sb.MUON: "muon"}
    assert s["eval"]["glm5_use_dsa"] is True and s["threads"] >= 1 and s["device"] == "cpu"
    assert [st["name"] for st in s["stages"][sb.GLM5]] == ["dense", "indexer_warmup", "sparse_adaptation"]
    steps = sum(st["steps"] for st in s["stages"][sb.GLM5])
    assert all(s["stages"][a] and s["stages"][a][0]["steps"] == steps for a in (sb.ADAMW, sb.MUON))
    dense = s["models"][sb.ADAMW]
    assert dense["num_key_value_heads"] == dense["num_attention_heads"] and dense["num_nextn_predict_layers"] == 0


def test_bits_per_byte_is_the_loss_over_the_bytes(quick):
    _, _, info = quick
    bytes_seen = set()
    for arm in ARMS:
        for r in info["raw"][arm].values():
            assert math.isfinite(r["val_bpb"]) and 0 < r["val_bpb"] < 20
            assert r["val_bpb"] == pytest.approx(r["val_loss"] * r["val_tokens"] / (r["val_bytes"] * math.log(2)),
                                                  rel=1e-12)
            assert r["tokens_per_s"] == pytest.approx(r["train_tokens"] / r["train_seconds"])
            bytes_seen.add((r["val_tokens"], r["val_bytes"]))
    assert len(bytes_seen) == 1  # the same validation windows for every arm and seed


def _activated_on_meta(cfg) -> int:
    """Parameters one token passes through, main model, no embedding/output: routed experts at top-k / E."""
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg)
    total = 0
    for name, p in model.named_parameters():
        if name.startswith(("model.embed_tokens", "lm_head", "model.mtp_layers")):
            continue
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".mlp.experts." in name else 1
        total += p.numel() * share
    return round(total)


@pytest.mark.parametrize("size", ["cpu", "gpu"])
def test_dense_gpt_matches_the_activated_parameters(size):
    glm5 = sb.glm5_config(sb.SIZES[size])
    dense = sb.dense_gpt_config(glm5)
    assert abs(_activated_on_meta(dense) / _activated_on_meta(glm5) - 1) < 0.05
    assert _activated_on_meta(glm5) == sb.activated(glm5) and _activated_on_meta(dense) == sb.activated(dense)
    assert set(dense.attention_types) == {"gqa"} and set(dense.mlp_layer_types) == {"dense"}
    assert not dense.use_dsa and not dense.has_indexer_weights and dense.num_nextn_predict_layers == 0
    assert (dense.vocab_size, dense.hidden_size, dense.tie_word_embeddings) == \
        (glm5.vocab_size, glm5.hidden_size, glm5.tie_word_embeddings)
    if size == "cpu":
        assert glm5 == ModelConfig.from_preset("small") and (dense.num_hidden_layers, dense.intermediate_size) == (4, 688)


def test_every_arm_sees_the_same_batches():
    windows = torch.arange(40 * 9).view(40, 9)
    plan = sb.plans(dict(model="small", T=8, batch=2, steps=12))
    glm5, dense = plan[sb.GLM5], plan[sb.ADAMW]
    assert sum(st.steps for st in glm5) == dense[0].steps
    by_stage = sb.text_batches(windows, 2, 3, glm5)
    flat = sb.text_batches(windows, 2, 3, dense)
    again = sb.text_batches(windows, 2, 3, plan[sb.MUON])
    k = 0
    for si, st in enumerate(glm5):
        for i in range(st.steps):
            ids, labels = by_stage(si, st, i)
            for other in (flat(0, dense[0], k), again(0, dense[0], k)):
                assert torch.equal(ids, other[0]) and torch.equal(labels, other[1])
            assert torch.equal(ids[:, 1:], labels[:, :-1])
            k += 1
    assert not torch.equal(sb.text_batches(windows, 2, 4, dense)(0, dense[0], 0)[0], flat(0, dense[0], 0)[0])


def test_stages_keep_train_s_proportions():
    plan = sb.plans(sb.SIZES["cpu"])
    assert [st.steps for st in plan[sb.GLM5]] == [120, 16, 32]
    lm = plan[sb.ADAMW][0]
    assert lm.steps == 168 and lm.mtp_weights == () and lm.lr_end == pytest.approx(lm.lr / 10)
    assert plan[sb.MUON][0].lr == plan[sb.GLM5][0].lr


def test_readme_row_reads_results_json(quick):
    out, _, _ = quick
    row = sb.readme_row(json.loads((out / "results.json").read_text()))
    assert set(row) == {"paper", "ours", "verdict"} and row["paper"].startswith("no paper figure")
    assert all(arm in row["ours"] for arm in ARMS) and "bits per byte" in row["ours"]
    assert "lower than dense GPT + AdamW (bpb): " in row["verdict"] and "\n" not in row["ours"] + row["verdict"]


@pytest.mark.slow
def test_gpu_shapes_run_end_to_end(tmp_path, study_corpus):
    run_study(StudyArgs("baseline", quick=True, scale="gpu", out=str(tmp_path), progress=False,
                        data=str(study_corpus)))
    info = json.loads((tmp_path / "results.json").read_text())
    assert info["settings"]["scale"] == "gpu-quick" and info["settings"]["models"][sb.GLM5]["hidden_size"] == 768
    assert all(math.isfinite(r["val_bpb"]) for arm in ARMS for r in info["raw"][arm].values())
