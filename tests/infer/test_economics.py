"""The byte model of speculative decoding (`glm5lab.infer.economics`) against hand-computed numbers on the
tiny preset, and its weight count against the instantiated model's parameters (the obvious reference).

tiny: D 64, V 512, 4 MLA layers (1 dense FFN, 3 MoE of E = 8 routed experts of 3 x 64 x 32 = 6144
parameters, K = 2), latent + RoPE key 32 + 8 = 40 values per token per layer, indexer "full"/"shared"
alternating (2 "own" layers caching 16-value index keys), index_topk 8. Integers and exact float sums:
compared exactly (or to 1e-12 relative where powers of 0.75 enter)."""

from __future__ import annotations

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.infer import economics as ec
from glm5lab.model.cache import KVCache


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_preset("tiny", **overrides)


def test_distinct_experts_hand_computed():
    assert ec.distinct_experts(8, 2, 0) == 0.0
    assert ec.distinct_experts(8, 2, 1) == 2.0
    assert ec.distinct_experts(8, 2, 2) == 3.5  # 8 (1 - 0.75^2)
    assert ec.distinct_experts(8, 2, 4) == pytest.approx(8 * (1 - 0.75**4), rel=1e-12)  # 5.46875
    assert ec.distinct_experts(8, 8, 1) == 8.0
    assert ec.distinct_experts(256, 8, 10_000) == pytest.approx(256.0, rel=1e-12)


@pytest.mark.parametrize("bad", [dict(n_experts=8, per_token=9, tokens=1), dict(n_experts=8, per_token=0, tokens=1),
                                 dict(n_experts=8, per_token=2, tokens=-1)])
def test_distinct_experts_refuses(bad):
    with pytest.raises(ValueError, match="is not allowed"):
        ec.distinct_experts(**bad)


def test_weight_bytes_one_more_token_hand_computed():
    """From 1 to 2 tokens: 3 MoE layers x 6144 x (3.5 - 2) more expert parameters, 1 more embedding row of 64."""
    cfg = tiny()
    assert ec.weight_bytes(cfg, 2) - ec.weight_bytes(cfg, 1) == pytest.approx((3 * 6144 * 1.5 + 64) * 4, rel=1e-12)
    assert ec.weight_bytes(cfg, 1) - ec.weight_bytes(cfg, 1, logits=False) == 512 * 64 * 4
    assert ec.weight_bytes(cfg, 1, bytes_per_param=1) * 4 == ec.weight_bytes(cfg, 1)


def _reference_weight_bytes(model, tokens: int, part: str, logits: bool) -> float:
    """The obvious count over the model's parameters (fp32): every parameter of `part` except the
    embedding (`tokens` rows) and routed experts (the distinct fraction), + lm_head when `logits`."""
    cfg, total = model.config, 0.0
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    for name, p in model.named_parameters():
        if name.startswith("lm_head."):
            total += p.numel() if logits else 0
        elif name.endswith("embed_tokens.weight"):
            total += tokens * p.shape[1]
        elif (".mtp_layers." in name) != (part == "mtp"):
            continue
        elif ".indexer." in name and not cfg.use_dsa:
            continue
        elif ".mlp.experts." in name:
            total += p.numel() * (1 - (1 - K / E) ** tokens)
        else:
            total += p.numel()
    return 4.0 * total


@pytest.mark.parametrize("use_dsa", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_weight_bytes_equal_the_model_parameters(use_dsa, tokens):
    cfg = tiny(use_dsa=use_dsa)
    model = GLM5ForCausalLM(cfg)
    assert any(".indexer." in n for n, _ in model.named_parameters())
    for part in ("main", "mtp"):
        for logits in (True, False):
            want = _reference_weight_bytes(model, tokens, part, logits)
            assert ec.weight_bytes(cfg, tokens, part=part, logits=logits) == pytest.approx(want, rel=1e-12)


def test_cache_reads_dense_vs_dsa_hand_computed():
    """B = 2 rows, L = 100 cached tokens, 4 queries per row (a verification of k = 3)."""
    dense = ec.cache_bytes(tiny(use_dsa=False), tiny(use_dsa=False).layers, batch=2, context=100, queries=4)
    assert dense == 2 * 4 * 100 * 40 * 4  # all L latents once per row, shared by the 4 queries: 128,000
    cfg = tiny()
    dsa = ec.cache_bytes(cfg, cfg.layers, batch=2, context=100, queries=4)
    assert dsa == 2 * (4 * 4 * 8 * 40 * 4 + 2 * 100 * 16 * 4)  # top-8 latents per query + index keys once: 66,560
    fp8 = ec.cache_bytes(cfg, cfg.layers, batch=2, context=100, queries=4, index_bytes_per_value=1)
    assert fp8 == 2 * (4 * 4 * 8 * 40 * 4 + 2 * 100 * 16 * 1)
    short = ec.cache_bytes(cfg, cfg.layers, batch=1, context=5, queries=1)
    assert short == 4 * 5 * 40 * 4 + 2 * 5 * 16 * 4  # L below index_topk: every key


def test_gated_deltanet_layers_read_their_fixed_state_once():
    """tiny with layers 0 and 2 Gated DeltaNet: their cache reads are their state bytes (fp32: H K V x 4 + the
    conv window), the same at any context; the two MLA layers read their latents as before."""
    cfg = ModelConfig.from_preset("tiny").replace(mixer_types=["gdn", "attention", "gdn", "attention"],
                                                  indexer_types=["full"] * 4, use_dsa=False)
    hv, hk, k, v = cfg.gdn_dims
    state = hv * k * v * 4 + (2 * hk * k + hv * v) * (cfg.linear_conv_kernel_dim - 1) * 4
    for L in (1, 100):
        got = ec.cache_bytes(cfg, cfg.layers, batch=3, context=L, queries=2)
        assert got == 3 * (2 * state + 2 * L * cfg.mla_cache_width * 4)


@pytest.mark.parametrize("use_dsa", [True, False])
def test_one_query_below_topk_reads_the_whole_cache(use_dsa):
    """Tied to the real cache: one query at L <= index_topk reads every byte `KVCache` holds per token."""
    cfg = tiny(use_dsa=use_dsa)
    model = GLM5ForCausalLM(cfg)
    per_token = KVCache.for_model(model, 1, 16).bytes_per_token()
    assert ec.cache_bytes(cfg, cfg.layers, batch=3, context=8, queries=1) == 3 * 8 * per_token
    mtp = KVCache.for_mtp(model, 1, 16).bytes_per_token()
    assert ec.cache_bytes(cfg, (cfg.mtp_layer,), batch=1, context=8, queries=1) == 8 * mtp


def test_round_is_the_sum_of_its_forwards():
    cfg, shape, k = tiny(), ec.Shape(batch=2, context=100), 3
    head = 512 * 64 * 4
    plain = ec.plain_step(cfg, shape)
    assert plain.forwards == 1 and plain.head == head
    assert plain.weights == ec.weight_bytes(cfg, 2) - head
    assert plain.cache == ec.cache_bytes(cfg, cfg.layers, batch=2, context=100, queries=1)
    ver = ec.verification(cfg, shape, k)
    assert ver.weights == ec.weight_bytes(cfg, 8) - head and ver.head == head
    assert ver.cache == 66_560  # the hand-computed DSA reads above
    dr = ec.drafts(cfg, shape, k)
    mtp_cache = ec.cache_bytes(cfg, (cfg.mtp_layer,), batch=2, context=100, queries=4) \
        + 2 * ec.cache_bytes(cfg, (cfg.mtp_layer,), batch=2, context=100, queries=1)
    assert dr.forwards == 0 and dr.draft_forwards == 3 and dr.head == 3 * head and dr.cache == mtp_cache
    assert dr.weights == pytest.approx(ec.weight_bytes(cfg, 8, part="mtp", logits=False)
                                       + 2 * (ec.weight_bytes(cfg, 2, part="mtp") - head), rel=1e-12)
    rnd = ec.speculative_round(cfg, shape, k)
    assert rnd.forwards == 1 and rnd.draft_forwards == 3 and rnd.bytes == pytest.approx(ver.bytes + dr.bytes, rel=1e-12)


def test_predicted_speedup_limits():
    """Overhead only: acceptance / (k + 1) forwards; bytes only: acceptance x plain bytes / round bytes."""
    cfg, shape = tiny(), ec.Shape(batch=1, context=64)
    assert ec.predicted_speedup(cfg, shape, k=3, acceptance_length=2.0, bandwidth=1e30, overhead=1e-3) \
        == pytest.approx(2.0 / 4, rel=1e-9)
    assert ec.predicted_speedup(cfg, shape, k=3, acceptance_length=2.0, bandwidth=1e30, overhead=1e-3,
                                draft_overhead=0.0) == pytest.approx(2.0, rel=1e-9)
    per_token = ec.predicted_speedup(cfg, shape, k=3, acceptance_length=2.0, bandwidth=1e30,
                                     overhead=lambda n: 1e-3 * n, draft_overhead=0.0)
    assert per_token == pytest.approx(2.0 * 1 / 4, rel=1e-9)  # the verification's 4 tokens cost 4 plain steps
    rnd = ec.speculative_round(cfg, ec.Shape(batch=2, context=64), 3)
    assert rnd.calls == (("mtp", 8), ("mtp", 2), ("mtp", 2), ("main", 8))
    ratio = ec.plain_step(cfg, shape).bytes / ec.speculative_round(cfg, shape, 3).bytes
    assert ec.predicted_speedup(cfg, shape, k=3, acceptance_length=2.5, bandwidth=1e9) == pytest.approx(2.5 * ratio)
    assert ec.plain_step(cfg, shape).seconds(1e9, 1e-3) == pytest.approx(ec.plain_step(cfg, shape).bytes / 1e9 + 1e-3)


def test_refusals_name_the_argument():
    cfg, shape = tiny(), ec.Shape(batch=1, context=64)
    with pytest.raises(ValueError, match="acceptance_length=5.0 is not allowed"):
        ec.predicted_speedup(cfg, shape, k=3, acceptance_length=5.0, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth = 0 is not allowed"):
        ec.predicted_speedup(cfg, shape, k=3, acceptance_length=2.0, bandwidth=0)
    with pytest.raises(ValueError, match="part = 'head' is not allowed: one of"):
        ec.weight_bytes(cfg, 1, part="head")
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        ec.weight_bytes(tiny(num_nextn_predict_layers=0), 1, part="mtp")


def test_glm5_shape_is_counted_from_the_config_alone():
    """GLM-5 (fp8 weights): a plain step reads about 40B activated parameters' worth less the unused experts'
    share; the verification of 4 tokens reads more experts than one token, never more than all of them."""
    cfg = ModelConfig.from_preset("glm5")
    shape = ec.Shape(batch=1, context=4096, weight_bytes=1, cache_bytes=2)
    one, four = ec.plain_step(cfg, shape), ec.verification(cfg, shape, 3)
    assert 30e9 < one.weights < 45e9
    assert one.weights < four.weights < ec.weight_bytes(cfg, 10**6, bytes_per_param=1)
    assert torch.isfinite(torch.tensor(ec.predicted_speedup(cfg, shape, k=3, acceptance_length=2.76, bandwidth=4.8e12)))
