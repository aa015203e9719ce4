"""`glm5lab ablate optimizer --quick`: the files, both budgets for every arm, the lr sweep's choice, the
equal-compute step counts against the FLOP counts, the summary row; and the study's helpers by hand
(stage scaling, the compute scales, the lr choice, the optimizer clock, GLM-5-scale accounting)."""

import json
import math

import pytest
import torch

from glm5lab import ModelConfig
from glm5lab.ablate import study_optimizer as so
from glm5lab.ablate.fit import glm5_stages
from glm5lab.ablate.summary import summary_table
from tests.ablate.conftest import run_quick


@pytest.fixture(scope="module")
def quick(tmp_path_factory, study_corpus):
    out, text = run_quick(tmp_path_factory, "optimizer", study_corpus)
    return out, text, json.loads((out / "results.json").read_text())


def test_quick_run_writes_both_budgets_for_every_arm(quick):
    out, text, info = quick
    assert (out / "optimizer.png").stat().st_size > 1000 and info["seeds"] == [0] and info["quick"]
    for budget in so.BUDGETS:
        assert f"### {budget}" in text
        for arm, opt in so.ARMS.items():
            r = info["raw"][budget][arm]["0"]
            assert 0 < r["val_loss"] < 10 and 0 < r["val_bpb"] < 20 and 0 <= r["mqar_accuracy"] <= 1
            assert 1 <= r["acceptance_length"] <= so.DRAFT_STEPS + 1
            assert 0 < r["optimizer_seconds"] < r["train_seconds"]
            assert r["tokens"] == sum(st["steps"] * st["batch_size"] * st["seq_len"]
                                      for st in info["settings"]["plans"][budget][arm])
    for (a, b) in so.COMPARISONS:
        assert f"| {a} better than {b} |" in text
    assert "learning-rate sweep" in text and "GLM-5's shape" in text


def test_sweep_choice_is_the_lowest_sweep_loss_and_used_by_both_budgets(quick):
    _, _, info = quick
    s = info["settings"]
    for arm in so.ARMS:
        losses = s["sweep"][arm]
        grid = [repr(lr) for lr in s["size"]["lrs"]]
        assert list(losses)[:len(grid)] == grid and len(losses) <= len(grid) + so.SWEEP_EXTENSIONS
        for k in range(len(grid), len(losses)):  # each extension went past the edge where the best then was
            assert float(list(losses)[k]) == so.next_lr(dict(list(losses.items())[:k]))
        if len(losses) < len(grid) + so.SWEEP_EXTENSIONS:
            assert so.next_lr(losses) is None
        best = min(losses, key=losses.get)
        assert s["lrs"][arm] == float(best)
        for budget in so.BUDGETS:
            assert s["plans"][budget][arm][0]["lr"] == pytest.approx(s["lrs"][arm])


def test_equal_compute_matches_the_reference_flops(quick):
    _, _, info = quick
    raw, s = info["raw"], info["settings"]
    budget = raw["equal tokens"][so.REFERENCE]["0"]["flops"]["total"]
    ref = raw["equal compute"][so.REFERENCE]["0"]
    assert ref.get("reused") and ref["flops"]["total"] == budget
    assert raw["equal tokens"]["AdamW"]["0"]["flops"]["optimizer"] == 0
    adamw = raw["equal compute"]["AdamW"]["0"]
    assert adamw["steps"] > raw["equal tokens"]["AdamW"]["0"]["steps"] and not adamw.get("reused")
    assert s["compute_scales"]["AdamW"] > 1
    assert s["compute_scales"][so.REFERENCE] == 1.0
    for arm in so.ARMS:  # each stage rounds its steps, so FLOPs match up to one step per stage
        plan = s["plans"]["equal compute"][arm]
        per_step = max(m + o for m, o in zip(s["step_flops"]["model"], s["step_flops"]["optimizer"][arm],
                                             strict=True))
        assert abs(raw["equal compute"][arm]["0"]["flops"]["total"] - budget) <= len(plan) * per_step


def test_summary_row_from_results_json(quick):
    out, _, info = quick
    row = so.readme_row(info)
    assert "Muon Split lower than AdamW (equal tokens, bpb)" in row["verdict"]
    assert "equal compute: val bpb" in row["ours"]
    for part in row["verdict"].split("; "):
        assert part.split(": ", 1)[1] in (out / "table.md").read_text()
    table = summary_table({"optimizer": {**info, "path": str(out / "results.json")}})
    assert "| `optimizer` [1]" in table


def _s(**over):
    return {**so.SIZES["quick"], **over}


def test_stages_scale_lr_and_steps():
    s = _s(steps=40)
    base = so.stages(s, so.DEFAULT_DENSE_LR)
    double = so.stages(s, 2 * so.DEFAULT_DENSE_LR)
    longer = so.stages(s, so.DEFAULT_DENSE_LR, 1.5)
    assert [st.name for st in base] == ["dense", "indexer_warmup", "sparse_adaptation"]
    assert [st.steps for st in base] == [st.steps for st in glm5_stages(s)]
    for a, b, c in zip(base, double, longer, strict=True):
        assert b.lr == pytest.approx(2 * a.lr) and b.steps == a.steps
        assert b.lr_end == (None if a.lr_end is None else pytest.approx(2 * a.lr_end))
        assert c.steps == max(1, round(a.steps * 1.5)) and 0 <= c.warmup_steps < c.steps and c.lr == a.lr
    assert so.stages(s, so.DEFAULT_DENSE_LR) == base  # equal plans are recognised (equal compute reuses runs)


def test_compute_scales_by_hand():
    s = _s(steps=40)
    plan = so.stages(s, so.DEFAULT_DENSE_LR)
    costs = {"model": [10, 4, 12], "optimizer": {"AdamW": [0, 0, 0], "Muon": [10, 1, 10],
                                                  "Muon Split": [8, 1, 8], "Muon Split, K/V apart": [6, 1, 6]}}
    total = {arm: sum(st.steps * (m + o) for st, m, o in zip(plan, costs["model"], opt, strict=True))
             for arm, opt in costs["optimizer"].items()}
    scales = so.compute_scales(costs, s)
    for arm in so.ARMS:
        assert scales[arm] == pytest.approx(total["Muon Split"] / total[arm])
    assert so.run_flops(costs, "Muon", plan)["optimizer"] == sum(st.steps * o for st, o in zip(plan, [10, 1, 10]))


def test_next_lr_goes_past_the_edge_where_the_best_is():
    assert so.next_lr({"0.001": 3.0, "0.002": 2.5, "0.004": 2.7}) is None
    assert so.next_lr({"0.001": 3.0, "0.002": 2.5, "0.004": 2.4}) == 0.008
    assert so.next_lr({"0.001": 2.0, "0.002": 2.5, "0.004": math.inf}) == 0.0005


def test_a_diverging_sweep_run_scores_inf(monkeypatch, bench):
    from glm5lab.train.step import TrainingDiverged

    def train(cfg, bench, s, arm, plan, seed, device):
        raise TrainingDiverged("step 3: loss is not finite")
    monkeypatch.setattr(so, "train", train)
    s = _s(lrs=(1e-3, 2e-3))
    out = so.sweep(so.config(s, bench.vocab_size), bench, s, None, lambda m: None, "cpu")
    assert all(v == math.inf for arm in so.ARMS for v in out[arm].values())
    assert all(len(out[arm]) == 2 + so.SWEEP_EXTENSIONS for arm in so.ARMS)  # inf ties: the smaller lr, /2


def test_chosen_lr_is_the_argmin_and_the_smaller_on_ties():
    assert so.chosen_lr({"0.001": 3.0, "0.002": 2.5, "0.004": 2.7}) == 0.002
    assert so.chosen_lr({"0.004": 2.5, "0.002": 2.5}) == 0.002


def test_optimizer_clock_sums_step_time():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    clock = so.OptimizerClock(opt)
    assert clock.seconds == 0.0
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert 0 < clock.seconds < 1


def test_config_is_the_small_preset_at_its_own_width():
    s = {**so.SIZES["cpu"], "hidden": 256, "layers": 6}
    cfg = so.config(s, 4096)
    small = ModelConfig.from_preset("small")
    same = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "indexer_types", "num_nextn_predict_layers")
    assert all(getattr(cfg, f) == getattr(small, f) for f in same)


@pytest.mark.parametrize("size", list(so.SIZES))
def test_every_size_runs_dsa_and_fits_its_prompts(size):
    s = so.SIZES[size]
    cfg = so.config(s, 512)
    assert cfg.use_dsa and cfg.index_topk < s["T"] and cfg.num_nextn_predict_layers == 1
    assert cfg.max_position_embeddings >= max(s["T"], s["prompt_len"] + s["max_new"])
    assert cfg.n_routed_experts > 1 and cfg.first_k_dense_replace < cfg.num_hidden_layers  # MoE layers present


def test_at_glm5_scale_by_its_formula():
    g = so.at_scale()
    ns = g["ns_flops_per_step"]
    assert ns["muon"] > ns["muon-split"] > ns["muon-split-kv"] > 0
    for opt, n in ns.items():
        tokens = g["tokens_per_step_at_share"][opt]
        assert n / (n + tokens * g["train_flops_per_token"]) == pytest.approx(g["share"])
    assert math.isfinite(g["train_flops_per_token"]) and g["train_flops_per_token"] > 1e11
