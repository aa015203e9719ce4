"""`glm5lab ablate efficient --quick` writes its folder; the variants start from the base as
documented (SWA variants share all weights, SimpleGDN keeps the GQA q/k/v/o, GDN layers are new)."""

import json
import math

import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.ablate import report_figures as rf
from glm5lab.ablate.gqa_base import SIZES, base_config
from glm5lab.ablate.runner import StudyArgs, run_study
from glm5lab.ablate.study_efficient import VARIANTS, build_variants, layer_plan

QUICK = SIZES["quick"]


def test_efficient_quick_writes_changes_beside_the_report(tmp_path, study_corpus):
    path, table = run_study(StudyArgs("efficient", quick=True, out=str(tmp_path), progress=False,
                                      data=str(study_corpus)))
    assert (tmp_path / "efficient.png").stat().st_size > 0
    for v in VARIANTS:
        assert f"| {v} |" in table
    for v in VARIANTS[1:]:
        assert all(f"{x:+.2f}" in table for x in rf.EFFICIENT[v])
    assert "paired [95% t]: verdict" in table and "rank ours / paper" in table
    info = json.loads((tmp_path / "results.json").read_text())
    assert info["seeds"] == [0]
    assert info["settings"]["further_tokens"] > 0
    for v in VARIANTS:
        row = info["raw"][v]["0"]
        assert math.isfinite(row["val_loss"]) and 0 < row["val_loss"] < 10
        for n in info["settings"]["eval_lengths"]:
            assert 0 <= row[str(n)]["mqar"] <= 1 and 0 <= row[str(n)]["niah"] <= 1


def test_variants_load_the_base_as_documented():
    torch.manual_seed(0)
    base = GLM5ForCausalLM(base_config(QUICK)).eval()
    searched = ["swa", "swa"] + ["full"] * (QUICK["layers"] - 2)
    models = build_variants(base, QUICK, searched, seed=0)
    assert list(models) == list(VARIANTS)
    replaced = layer_plan(QUICK)
    assert replaced == [0, 2]
    ids = torch.randint(0, 400, (1, 12))
    with torch.no_grad():  # within the window SWA equals full attention
        ref = base(ids).logits
        assert torch.allclose(models["SWA interleave"](ids).logits, ref, atol=1e-5)
        assert torch.allclose(models["searched SWA"](ids).logits, ref, atol=1e-5)
    assert models["Gated DeltaNet"].config.mixer_types == ["gdn", "attention", "gdn", "attention"]
    assert models["SimpleGDN"].config.mixer_types == ["simple_gdn", "attention", "simple_gdn", "attention"]
    b, s, g = (m.model.layers for m in (base, models["SimpleGDN"], models["Gated DeltaNet"]))
    for i in replaced:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(s[i].self_attn, name).weight, getattr(b[i].self_attn, name).weight)
        assert g[i].self_attn.k_proj.weight.shape != b[i].self_attn.k_proj.weight.shape  # GDN: new, wider
    for i in range(QUICK["layers"]):  # everything else is copied, not shared
        assert torch.equal(g[i].mlp.gate_proj.weight, b[i].mlp.gate_proj.weight)
        assert g[i].mlp.gate_proj.weight.data_ptr() != b[i].mlp.gate_proj.weight.data_ptr()
