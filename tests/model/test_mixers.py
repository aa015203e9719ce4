"""Gated DeltaNet ("gdn") and SimpleGDN ("simple_gdn") as per-layer mixers of GLM5ForCausalLM:
causal, chunked == recurrent through the whole model (fp32 tolerance, conftest), counted exactly
by the ledger, covered by the optimizer table, saved and loaded, built from a GQA model's weights;
bad configs refused by name. Cached decoding: tests/model/test_gdn_cache.py."""

import pytest
import torch

from glm5lab import ConfigError, GLM5ForCausalLM, ModelConfig, ledger
from glm5lab.optim.groups import build_optimizer
from tests.conftest import assert_close

MIXED = dict(attention_types=["mla", "mla", "gqa", "gqa"], mixer_types=["full", "gdn", "full", "simple_gdn"],
             num_key_value_heads=2)


def _model(**overrides) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(**{**MIXED, **overrides})).eval()


def test_mixed_model_is_causal_and_chunked_equals_recurrent():
    m = _model()
    ids = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(1))  # > one 64-token chunk
    with torch.no_grad():
        chunked = m(ids).logits
        assert_close(m(ids, attn_impl="naive").logits, chunked)  # GDN layers: recurrent under "naive"
        changed = ids.clone()
        changed[:, 40] = (ids[:, 40] + 1) % 512
        after = m(changed).logits
    assert torch.equal(after[:, :40], chunked[:, :40])
    assert (after[:, 40:] - chunked[:, 40:]).abs().max() > 1e-4


@pytest.mark.parametrize("overrides", [{}, dict(simple_gdn_decay="constant", attention_bias=True),
                                       dict(linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=12)])
def test_ledger_counts_gdn_mixers_exactly_and_optimizer_covers_them(overrides):
    m = _model(**overrides)
    n_main = sum(p.numel() for n, p in m.named_parameters() if "mtp_layers" not in n)
    assert ledger.count(m.config, embeddings=True, mtp=False) == n_main
    cfg = m.config  # layer 0 MLA with its indexer, layer 2 GQA; the GDN layers hold no per-token state
    assert ledger.state(cfg)["main"]["values"] == cfg.mla_cache_width + cfg.index_head_dim + cfg.gqa_cache_width
    build_optimizer(m, "muon-split", lr=1e-3)  # every parameter falls in exactly one group


def test_simple_gdn_starts_from_a_gqa_models_weights(tmp_path):
    gqa = _model(mixer_types=["full"] * 4)
    sgdn = GLM5ForCausalLM(gqa.config.replace(mixer_types=["full", "full", "full", "simple_gdn"]))
    result = sgdn.load_state_dict(gqa.state_dict(), strict=False)
    assert sorted(result.missing_keys) == [f"model.layers.3.self_attn.{k}" for k in
                                           ("A_log", "a_proj.weight", "b_bias", "b_proj.weight", "dt_bias")]
    assert result.unexpected_keys == []
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(sgdn.model.layers[3].self_attn, name).weight,
                           getattr(gqa.model.layers[3].self_attn, name).weight)
    sgdn.save_pretrained(tmp_path)
    again = GLM5ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, sgdn(ids).logits)


def test_bad_configs_are_refused_by_name():
    tiny = ModelConfig.from_preset("tiny")
    with pytest.raises(ConfigError, match=r"mixer_types\[2\].*only on GQA layers"):
        tiny.replace(mixer_types=["full", "full", "simple_gdn", "full"])
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        tiny.replace(mixer_types=["full", "gdn", "full", "full"], linear_num_key_heads=3)
    with pytest.raises(ConfigError, match="simple_gdn_decay"):
        tiny.replace(simple_gdn_decay="sometimes")
