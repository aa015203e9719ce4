"""`--scale gpu`: every study's gpu size builds models of about 50-100M parameters at lengths
where DSA and SWA matter (training length >= 2K tokens, index_topk and the window below it), and
`--scale gpu --quick` runs each study end to end on the CPU (`pytest -m slow`)."""

import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.ablate import (gqa_base, study_baseline, study_dsa, study_efficient, study_indexcache, study_mla,
                            study_mtp, study_optimizer)
from glm5lab.ablate.runner import SIZE_KEYS, StudyArgs, run_study


def _params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GLM5ForCausalLM(cfg).parameters())


def gpu_configs(size: str = "gpu") -> dict:
    """study -> (its model configs at `size`, training length, longest length it feeds a model)."""
    mla, dsa, mtp, ic = (m.SIZES[size] for m in (study_mla, study_dsa, study_mtp, study_indexcache))
    fz, op = study_efficient.SIZES[size], study_optimizer.SIZES[size]
    swa = fz["base"]
    return {"mla": (list(study_mla.configs(mla).values()), mla["T"], mla["T"]),
            "dsa": ([study_dsa.config(dsa)], dsa["T"], dsa["T"] * max(dsa["scales"])),
            "swa": ([gqa_base.base_config(swa)], swa["seq_len"], max(*swa["lengths"], 2 * fz["seq_len"])),
            "mtp": ([study_mtp.config(mtp, d) for d in study_mtp.DEPTHS], mtp["T"],
                    max(mtp["T"], mtp["prompt_len"] + mtp["max_new"])),
            "indexcache": ([study_indexcache.config(ic)], ic["T"], ic["T"] * max(4, ic["long"])),
            "optimizer": ([study_optimizer.config(op, 512)], op["T"], max(op["T"], op["prompt_len"] + op["max_new"]))}


@pytest.mark.parametrize("study", ["mla", "dsa", "swa", "mtp", "indexcache", "optimizer"])
def test_gpu_sizes_are_50_to_100m_params_at_2k_tokens(study):
    cfgs, T, _ = gpu_configs()[study]
    assert T >= 2048
    for cfg in cfgs:
        assert 50e6 <= _params(cfg) <= 100e6, (study, _params(cfg))
        if cfg.use_dsa or study in ("dsa", "indexcache"):
            assert cfg.index_topk < T


def test_swa_and_efficient_gpu_lengths():
    fz = study_efficient.SIZES["gpu"]
    sz = fz["base"]
    assert sz == gqa_base.SIZES["gpu"] and sz["window"] < sz["seq_len"] and max(sz["lengths"]) >= 4 * sz["window"]
    assert 2 * fz["seq_len"] <= gqa_base.base_config(sz).max_position_embeddings


@pytest.mark.parametrize("size", ["quick", "cpu", "gpu", "gpu-quick"])
@pytest.mark.parametrize("study", ["mla", "dsa", "swa", "mtp", "indexcache", "optimizer"])
def test_positions_cover_every_length_a_study_feeds(study, size):
    cfgs, _, longest = gpu_configs(size)[study]
    assert all(cfg.max_position_embeddings >= longest for cfg in cfgs), (study, size, longest)


@pytest.mark.parametrize("module", [study_mla, study_dsa, study_mtp, study_indexcache, study_efficient, study_baseline,
                                    study_optimizer])
def test_every_study_has_every_size(module):
    assert set(module.SIZES) == set(SIZE_KEYS)


@pytest.mark.slow
@pytest.mark.parametrize("study", ["mla", "dsa", "swa", "efficient", "mtp", "indexcache", "optimizer"])
def test_gpu_quick_runs_on_cpu(study, tmp_path, study_corpus):
    _, table = run_study(StudyArgs(study, quick=True, scale="gpu", out=str(tmp_path), progress=False,
                                   data=str(study_corpus)))
    info = json.loads((tmp_path / "results.json").read_text())
    assert info["settings"]["scale"] == "gpu-quick" and info["settings"]["device"] in ("cpu", "cuda")
    assert "verdict" in table or "inconclusive" in table
