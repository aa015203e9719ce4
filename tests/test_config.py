"""ModelConfig: presets, validation messages, HF config.json round trip and aliases."""

import json

import pytest

from glm5lab import ConfigError, ModelConfig
from glm5lab.presets import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip_through_hf(name):
    cfg = ModelConfig.from_preset(name)
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_glm5_preset_is_the_published_shape():
    c = ModelConfig.from_preset("glm5")
    assert (c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.num_nextn_predict_layers) == (6144, 78, 3, 1)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (256, 8, 1, 2048)
    assert (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (64, 192, 64, 256)
    assert (c.q_lora_rank, c.kv_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk) == (2048, 512, 32, 128, 2048)
    assert c.vocab_size == 154880 and c.mla_cache_width == 576
    assert c.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]


def test_small_presets_exercise_every_lever():
    for name, seq_len in (("tiny", 32), ("small", 256)):
        c = ModelConfig.from_preset(name)
        assert c.index_topk < seq_len and c.use_dsa
        assert {"full", "shared"} <= set(c.indexer_types)
        assert "sparse" in c.mlp_layer_types and c.n_shared_experts == 1 and c.num_nextn_predict_layers == 1


@pytest.mark.parametrize("changes, field, allowed", [
    (dict(num_key_value_heads=3), "num_key_value_heads", "divisor of num_attention_heads=4"),
    (dict(index_topk=0), "index_topk", ">= 1"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok", "at most n_routed_experts=8"),
    (dict(indexer_types=["full", "sparse", "full", "full"]), "indexer_types[1]", "one of ('full', 'shared')"),
    (dict(indexer_types=["shared", "full", "full", "full"]), "indexer_types[0]", "'full' for the first MLA layer"),
    (dict(indexer_types=["full"]), "indexer_types", "a list of 4 entries"),
    (dict(n_group=3), "n_group", "divisor of n_routed_experts=8"),
    (dict(topk_group=2), "topk_group", "at most n_group=1"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim", "even"),
    (dict(attention_types=["mla", "gqa", "swa", "mla"]), "attention_types[2]", "one of ('mla', 'gqa')"),
    (dict(hidden_act="gelu"), "hidden_act", "('silu',)"),
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers", "0 or 1"),
    (dict(index_n_heads=0), "use_dsa", "index_n_heads is 0"),
    (dict(hidden_size=0), "hidden_size", ">= 1"),
])
def test_bad_values_name_field_value_and_rule(changes, field, allowed):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_preset("tiny", **changes)
    msg = str(e.value)
    assert f"`{field}`" in msg and allowed in msg
    assert repr(next(iter(changes.values()))) in msg or field.endswith("]")


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown preset 'glm6'.*glm5.*tiny"):
        ModelConfig.from_preset("glm6")


def _glm5_hub_config() -> dict:
    """A config.json with the keys of the public zai-org/GLM-5 release, including its
    DeepSeek-style extras (scoring_func, topk_method, indexer_rope_interleave, ...)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "pad_token_id": 154820, "eos_token_id": [154820, 154827, 154829], "hidden_act": "silu",
        "head_dim": 64, "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
        "indexer_rope_interleave": True, "initializer_range": 0.02, "intermediate_size": 12288,
        "kv_lora_rank": 512, "max_position_embeddings": 202752, "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "model_type": "glm_moe_dsa", "n_group": 1, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1,
        "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05, "rope_interleave": True, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "noaux_tc", "dtype": "bfloat16", "transformers_version": "5.0.2.dev0",
        "use_cache": True, "v_head_dim": 256, "vocab_size": 154880, "first_k_dense_replace": 3,
        "ep_size": 1,
    }


def test_glm5_hub_config_loads_unchanged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_glm5_hub_config()))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg == ModelConfig.from_preset("glm5", pad_token_id=154820, hf_extra={"ep_size": 1})
    assert cfg.to_hf()["ep_size"] == 1 and cfg.to_hf()["head_dim"] == 64


@pytest.mark.parametrize("keys, expected", [
    (dict(index_topk_freq=2, index_skip_topk_offset=1), ["full", "shared", "full", "shared", "full"]),
    (dict(index_topk_freq=3), ["full", "full", "shared", "shared", "full"]),
    (dict(index_topk_pattern="FSSFS"), ["full", "shared", "shared", "full", "shared"]),
])
def test_indexer_type_aliases_match_transformers(keys, expected):
    from transformers import GlmMoeDsaConfig

    d = {**ModelConfig.from_preset("tiny", num_hidden_layers=5).to_hf(), **keys}
    del d["indexer_types"]
    assert ModelConfig.from_hf(d).indexer_types == expected
    assert GlmMoeDsaConfig(**{k: v for k, v in d.items() if k != "model_type"}).indexer_types == expected


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="deepseek_v3"), "`model_type` = 'deepseek_v3'.*'glm_moe_dsa'"),
    (dict(scoring_func="softmax"), "`scoring_func` = 'softmax'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}), "rope_type.*'yarn'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config.*not supported"),
    (dict(index_topk_pattern="FXS"), "index_topk_pattern"),
])
def test_hf_config_refusals(changes, match):
    d = {**ModelConfig.from_preset("tiny").to_hf(), **changes}
    if "index_topk_pattern" in changes:
        del d["indexer_types"]
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(d)


def test_missing_and_corrupt_config_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


def test_transformers_reads_our_config():
    from transformers import GlmMoeDsaConfig

    ours = ModelConfig.from_preset("tiny")
    theirs = GlmMoeDsaConfig.from_dict(ours.to_hf())
    for name in ("hidden_size", "q_lora_rank", "kv_lora_rank", "index_topk", "indexer_types", "mlp_layer_types",
                 "n_routed_experts", "routed_scaling_factor", "first_k_dense_replace"):
        assert getattr(theirs, name) == getattr(ours, name), name
    assert theirs.rope_parameters["rope_theta"] == ours.rope_theta


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"model_type": "glm_moe_dsa", "num_hidden_layers": null}', "`num_hidden_layers` = None"),
    ('{"model_type": "glm_moe_dsa", "rope_parameters": 5}', "`rope_parameters` = 5"),
    ('{"model_type": "glm_moe_dsa", "hidden_size": "big"}', "`hidden_size` = 'big'"),
    ('{"model_type": "glm_moe_dsa", "indexer_types": 3}', "indexer_types"),
])
def test_malformed_config_json_is_a_config_error(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
