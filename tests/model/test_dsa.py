"""DSA selection: deterministic top-k with ties by position; the indexer against
transformers' GlmMoeDsaIndexer; shared layers reuse the top-k."""

import pytest
import torch

from glm5lab import ModelConfig
from glm5lab.model.visibility import visible
from glm5lab.model.dsa import LightningIndexer
from glm5lab.model.topk import select_topk
from glm5lab.model.rope import rope_angles


def test_topk_ties_break_by_position_and_invalid_slots_are_marked():
    s = torch.tensor([[[1.0, -1, -1, -1, -1],
                       [2.0, 2.0, -1, -1, -1],
                       [0.0, 3.0, 0.0, -1, -1],
                       [0.0, 0.0, 0.0, 0.0, -1],
                       [5.0, 0.0, 5.0, 0.0, 5.0]]])
    s = s.masked_fill(~visible(0, 5, 5)[0], float("-inf"))
    topk = select_topk(s, 3)
    assert topk.idx_BTK[0, 1, :2].tolist() == [0, 1]
    assert topk.idx_BTK[0, 2].tolist() == [1, 0, 2]
    assert topk.idx_BTK[0, 3].tolist() == [0, 1, 2]
    assert topk.idx_BTK[0, 4].tolist() == [0, 2, 4]
    assert topk.valid_BTK[0].sum(-1).tolist() == [1, 2, 3, 3, 3]


def test_topk_is_min_k_and_s_and_refuses_k_below_one():
    s = torch.zeros(1, 2, 2).masked_fill(~visible(0, 2, 2)[0], float("-inf"))
    assert select_topk(s, 10).idx_BTK.shape == (1, 2, 2)
    with pytest.raises(ValueError, match="index_topk must be >= 1"):
        select_topk(s, 0)


@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_matches_transformers(interleaved):
    from transformers import GlmMoeDsaConfig
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

    cfg = ModelConfig.from_preset("tiny", indexer_rope_interleave=interleaved)
    hf_cfg = GlmMoeDsaConfig.from_dict(cfg.to_hf())
    torch.manual_seed(0)
    ours = LightningIndexer(cfg)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if interleaved:
        theirs = GlmMoeDsaIndexer(hf_cfg, 0)
    else:
        from transformers import DeepseekV32Config
        theirs = DeepseekV32Indexer(DeepseekV32Config(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"}), 0)
    theirs.load_state_dict(ours.state_dict())
    B, T = 2, 11
    x, q_lat = torch.randn(B, T, cfg.hidden_size), torch.randn(B, T, cfg.q_lora_rank)
    pos = torch.arange(T)
    cos, sin = rope_angles(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    scores = ours.scores(x, q_lat, ours.keys(x, cos, sin), cos, sin)
    ours_idx = select_topk(scores, cfg.index_topk)
    rope = GlmMoeDsaRotaryEmbedding(hf_cfg)
    mask = torch.where(visible(0, T, T)[0], 0.0, float("-inf"))[None].expand(B, T, T)
    their_idx = theirs(x, q_lat, rope(x, pos[None]), mask, pos[None])
    for b in range(B):
        for t in range(cfg.index_topk, T):  # rows with more causal keys than K: a real choice
            assert sorted(ours_idx.idx_BTK[b, t].tolist()) == sorted(their_idx[b, t].tolist())


def test_kl_to_indexer_hand_computed_and_zero_at_match():
    from glm5lab.model.mla import kl_to_indexer

    keep = torch.tensor([[[True, False, False], [True, True, False], [True, True, True]]])
    target = torch.tensor([[[1.0, 0, 0], [0.25, 0.75, 0], [0.5, 0.0, 0.5]]])
    scores = torch.tensor([[[3.0, 9, 9], [0.0, 0.0, 9], [0.0, 1.0, 2.0]]])
    q1 = torch.tensor([0.5, 0.5])
    q2 = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    expected = (0.0 + (0.25 * (0.25 / q1[0]).log() + 0.75 * (0.75 / q1[1]).log())
                + (0.5 * (0.5 / q2[0]).log() + 0.5 * (0.5 / q2[2]).log())) / 3
    assert torch.allclose(kl_to_indexer(target, scores, keep).mean(), expected, atol=1e-6)
    matched = torch.where(target > 0, target.log(), torch.full_like(target, -30.0))
    assert kl_to_indexer(target, matched, keep).abs().max() < 1e-6


def test_indexer_loss_trains_only_the_indexer():
    from glm5lab import GLM5ForCausalLM

    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
    ids = torch.randint(0, 256, (2, 20))
    for use_dsa, depth in ((False, 0), (True, 0), (False, 2)):  # warm-up (dense), sparse, with MTP
        model.zero_grad()
        out = model(ids, indexer_loss=True, use_dsa=use_dsa, mtp_depth=depth)
        assert out.indexer_loss.item() > 0
        out.indexer_loss.backward()
        for name, p in model.named_parameters():
            has_grad = p.grad is not None and p.grad.abs().sum() > 0
            assert has_grad == (".indexer." in name and (depth > 0 or not name.startswith("model.mtp_layers"))), name


def test_topk_is_the_stable_sort_prefix_on_tie_heavy_scores():
    """`select_topk` (torch.topk over int64 ranking keys) picks exactly what a stable descending
    sort picks: ties (including -0.0 vs +0.0, which compare equal) go to the earlier key, -inf
    last, extreme magnitudes ordered."""
    g = torch.Generator().manual_seed(0)
    vals = torch.tensor([0.0, -0.0, 1.5, -2.0, float("-inf"), 3.0, -1e-30, 1e-30, 7e30, -7e30])
    for trial in range(60):
        S = int(torch.randint(1, 300, (1,), generator=g))
        if trial % 2:
            scores = torch.randn(2, 5, S, generator=g).round(decimals=1)
        else:
            scores = vals[torch.randint(0, len(vals), (2, 5, S), generator=g)]
        k = int(torch.randint(1, 40, (1,), generator=g))
        ref = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :min(k, S)]
        assert torch.equal(select_topk(scores, k).idx_BTK, ref)
