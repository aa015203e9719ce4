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
    (dict(hidden_size=64.0), "hidden_size", "an integer >= 1 (write 64, not 64.0)"),
    (dict(n_group=None), "n_group", "an integer >= 0"),
    (dict(rope_theta=0.0), "rope_theta", "a finite number > 0"),
    (dict(rope_theta=float("inf")), "rope_theta", "a finite number > 0"),
    (dict(rope_theta="1e4"), "rope_theta", "a finite number > 0"),
    (dict(rms_norm_eps=0), "rms_norm_eps", "a finite number > 0"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor", "a finite number > 0"),
    (dict(routed_scaling_factor=-1.0), "routed_scaling_factor", "a finite number > 0"),
    (dict(initializer_range=-0.02), "initializer_range", "a finite number >= 0"),
    (dict(use_dsa="no"), "use_dsa", "True or False"),
    (dict(norm_topk_prob=1), "norm_topk_prob", "True or False"),
    (dict(tie_word_embeddings=None), "tie_word_embeddings", "True or False"),
    (dict(attention_bias="false"), "attention_bias", "True or False"),
    (dict(rope_interleave=0), "rope_interleave", "True or False"),
    (dict(indexer_rope_interleave="yes"), "indexer_rope_interleave", "True or False"),
    (dict(use_qk_norm=1.0), "use_qk_norm", "True or False"),
    (dict(bos_token_id="0"), "bos_token_id", "an integer >= 0 or None"),
    (dict(pad_token_id=1.0), "pad_token_id", "an integer >= 0 or None"),
    (dict(eos_token_id=[1, True]), "eos_token_id", "or a list of integers >= 0"),
    (dict(eos_token_id=-1), "eos_token_id", "an integer >= 0 or None"),
    (dict(hf_extra=["ep_size"]), "hf_extra", "a dict"),
    (dict(first_k_dense_replace=5), "first_k_dense_replace", "at most num_hidden_layers=4"),
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

    ours = ModelConfig.from_preset("tiny", num_hidden_layers=5).to_hf()
    d = {**{k: v for k, v in ours.items() if k not in ("indexer_types", "index_topk_pattern")}, **keys}
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


def test_ints_may_be_none_or_lists_where_allowed():
    cfg = ModelConfig.from_preset("tiny", bos_token_id=None, pad_token_id=3, eos_token_id=(1, 2))
    assert cfg.eos_token_id == [1, 2] and cfg.bos_token_id is None
    assert isinstance(ModelConfig.from_preset("tiny", rope_theta=10000).rope_theta, float)


def test_unknown_fields_are_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown config fields \['hiden_size'\]"):
        ModelConfig.from_preset("tiny", hiden_size=64)


def test_first_k_dense_replace_rederives_mlp_layer_types():
    cfg = ModelConfig.from_preset("tiny", first_k_dense_replace=3)
    assert cfg.mlp_layer_types == ["dense"] * 3 + ["sparse"] and cfg.first_k_dense_replace == 3
    cfg = cfg.replace(first_k_dense_replace=0)
    assert cfg.mlp_layer_types == ["sparse"] * 4 and cfg.first_k_dense_replace == 0
    assert cfg.replace(num_hidden_layers=6).mlp_layer_types == ["sparse"] * 6


def test_mlp_layer_types_alone_sets_first_k_dense_replace():
    pattern = ["dense", "sparse", "dense", "sparse"]
    cfg = ModelConfig.from_preset("tiny").replace(mlp_layer_types=pattern)
    assert cfg.mlp_layer_types == pattern and cfg.first_k_dense_replace == 1
    assert ModelConfig.from_preset("tiny", mlp_layer_types=["dense"] * 4).first_k_dense_replace == 4
    d = {**ModelConfig.from_preset("tiny").to_hf(), "mlp_layer_types": pattern}
    del d["first_k_dense_replace"]
    from_hf = ModelConfig.from_hf(d)
    assert from_hf.mlp_layer_types == pattern and from_hf.first_k_dense_replace == 1
    assert ModelConfig.from_hf(from_hf.to_hf()) == from_hf  # to_hf writes both, in agreement
    d = {**ModelConfig.from_preset("tiny").to_hf(), "first_k_dense_replace": 3}
    del d["mlp_layer_types"]
    assert ModelConfig.from_hf(d).mlp_layer_types == ["dense"] * 3 + ["sparse"]
    assert ModelConfig(num_hidden_layers=5).mlp_layer_types == ["dense"] * 3 + ["sparse"] * 2  # GLM-5's 3


def test_first_k_dense_replace_beside_another_mlp_layer_types_is_refused_naming_both():
    """Both given: they must agree (first_k_dense_replace = the list's leading dense layers); a conflict was
    accepted before, the list winning without a word (issue 36, fault 5)."""
    both = ModelConfig.from_preset("tiny", first_k_dense_replace=2, mlp_layer_types=["dense"] * 2 + ["sparse"] * 2)
    assert both.first_k_dense_replace == 2
    message = (r"config field `first_k_dense_replace` = 3 is not allowed: 2 with mlp_layer_types = \['dense', "
               r"'dense', 'sparse', 'sparse'\] \(its leading dense layers\): .*give one of them, or both in agreement")
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_preset("tiny", first_k_dense_replace=3, mlp_layer_types=["dense"] * 2 + ["sparse"] * 2)
    d = {**ModelConfig.from_preset("tiny").to_hf(), "first_k_dense_replace": 3,
         "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}
    with pytest.raises(ConfigError, match=r"`first_k_dense_replace` = 3 is not allowed: 1 with mlp_layer_types"):
        ModelConfig.from_hf(d)
    with pytest.raises(ConfigError, match=r"`first_k_dense_replace` = 0 is not allowed: 1 with"):
        ModelConfig(num_hidden_layers=2, first_k_dense_replace=0, mlp_layer_types=["dense", "sparse"])


def test_glm5_config_with_both_fields_in_agreement_loads(tmp_path):
    """GLM-5's config.json as transformers writes it (`GlmMoeDsaConfig.to_dict()` carries first_k_dense_replace
    and the mlp_layer_types it derived) loads as the glm5 preset."""
    from transformers import GlmMoeDsaConfig

    hub = {**_glm5_hub_config(), "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75}
    (tmp_path / "config.json").write_text(json.dumps(hub))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_preset("glm5", pad_token_id=154820, hf_extra={"ep_size": 1})
    theirs = GlmMoeDsaConfig(**{k: v for k, v in _glm5_hub_config().items() if k != "model_type"}).to_dict()
    assert theirs["first_k_dense_replace"] == 3 and theirs["mlp_layer_types"][:4] == ["dense"] * 3 + ["sparse"]
    cfg = ModelConfig.from_hf(theirs)
    assert cfg.mlp_layer_types == ModelConfig.from_preset("glm5").mlp_layer_types and cfg.first_k_dense_replace == 3


@pytest.mark.parametrize("changes, match", [
    (dict(rope_parameters={"rope_theta": "abc", "rope_type": "default"}), r"`rope_parameters.rope_theta` = 'abc'"),
    (dict(rope_parameters={"rope_theta": -1, "rope_type": "default"}), r"`rope_parameters.rope_theta` = -1"),
    (dict(rope_parameters=None, rope_theta="abc"), r"`rope_theta` = 'abc'"),
    (dict(rope_parameters=None, rope_theta=None), r"`rope_theta` = None"),
    (dict(rope_theta=5.0), r"`rope_parameters.rope_theta` = 10000.0 and `rope_theta` = 5.0 disagree"),
    (dict(hidden_size=64.0), r"`hidden_size` = 64.0 .*write 64"),
    (dict(rms_norm_eps=None), r"`rms_norm_eps` = None"),
    (dict(use_dsa=None), r"`use_dsa` = None"),
    (dict(use_dsa="no"), r"`use_dsa` = 'no'"),
    (dict(hidden_act=None), r"`hidden_act` = None"),
    (dict(mtp_depth=None), r"`mtp_depth` = None"),
    (dict(num_experts=4), r"`num_experts` = 4 and `n_routed_experts` = 8 disagree"),
    (dict(index_topk_freq=2.5), r"`index_topk_freq` = 2.5 .*an integer >= 1"),
    (dict(index_topk_freq=0), r"`index_topk_freq` = 0 .*an integer >= 1"),
    (dict(index_topk_freq="2"), r"`index_topk_freq` = '2'"),
    (dict(index_skip_topk_offset=1.7), r"`index_skip_topk_offset` = 1.7 .*an integer >= 0"),
    (dict(index_skip_topk_offset=-1), r"`index_skip_topk_offset` = -1"),
])
def test_hf_config_type_refusals_name_the_field(changes, match):
    d = {**ModelConfig.from_preset("tiny").to_hf(), **changes}
    if any(k.startswith("index_") for k in changes):
        del d["indexer_types"]
        if "index_topk_pattern" not in changes:
            del d["index_topk_pattern"]
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(d)


def test_hf_config_num_experts_alias_and_nulls_that_mean_default():
    d = {**ModelConfig.from_preset("tiny").to_hf(), "num_experts": 8, "pad_token_id": None, "bos_token_id": None}
    cfg = ModelConfig.from_hf(d)
    assert cfg.n_routed_experts == 8 and cfg.pad_token_id is None and cfg.bos_token_id is None
    del d["n_routed_experts"]
    assert ModelConfig.from_hf({**d, "num_experts": 4, "num_experts_per_tok": 2}).n_routed_experts == 4


def _deepseek_v3_keys() -> dict:
    """The keys of the published DeepSeek-V3 / V3.2-Exp config.json that GLM-5's does not carry."""
    return {"aux_loss_alpha": 0.001, "seq_aux": True, "pretraining_tp": 1, "ep_size": 1,
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}


@pytest.mark.parametrize("typo, meant", [("num_expert_per_tok", "num_experts_per_tok"),
                                         ("index_top_k", "index_topk"),
                                         ("routed_scale_factor", "routed_scaling_factor"),
                                         ("kv_lora_rnak", "kv_lora_rank")])
def test_a_misspelt_hf_field_is_refused_naming_the_closest_one(tmp_path, typo, meant):
    """A misspelt key used to be kept in hf_extra and its field's default used (top-8 of 8 experts
    for `num_expert_per_tok`); now it is one error naming the key and the field it is closest to."""
    d = {**ModelConfig.from_preset("tiny").to_hf(), typo: 2}
    with pytest.raises(ConfigError, match=rf"config field `{typo}` is unknown \(did you mean `{meant}`\?\)"):
        ModelConfig.from_hf(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=typo):
        ModelConfig.from_hf(tmp_path)


def test_every_key_transformers_writes_or_a_published_config_carries_is_accepted():
    """GlmMoeDsaConfig's own to_dict (every key transformers writes for this model type), the
    GLM-5 hub config.json and DeepSeek-V3's extras all load; the keys glm5lab does not interpret
    are kept (hf_extra) and written back."""
    from transformers import GlmMoeDsaConfig

    theirs = GlmMoeDsaConfig(**{k: v for k, v in ModelConfig.from_preset("tiny").to_hf().items()
                                if k != "model_type"})
    d = json.loads(theirs.to_json_string(use_diff=False))
    assert ModelConfig.from_hf(d) == ModelConfig.from_preset("tiny", hf_extra=ModelConfig.from_hf(d).hf_extra)
    cfg = ModelConfig.from_hf({**_glm5_hub_config(), **_deepseek_v3_keys()})
    assert cfg.hf_extra == _deepseek_v3_keys() and cfg.to_hf()["seq_aux"] is True
    glm5_2 = {"index_share_for_mtp_iteration": True, "expert_dtype": "fp4"}  # GLM-5.2 and its FP4 releases
    assert ModelConfig.from_hf({**_glm5_hub_config(), **glm5_2}).hf_extra == {"ep_size": 1, **glm5_2}


def test_the_hint_searches_every_accepted_key():
    d = ModelConfig.from_preset("tiny").to_hf()
    with pytest.raises(ConfigError, match=r"`tokenizer_clas` is unknown \(did you mean `tokenizer_class`\?\)"):
        ModelConfig.from_hf({**d, "tokenizer_clas": "X"})
    with pytest.raises(ConfigError, match="`hf_extra` is unknown"):  # glm5lab's own field, not a config.json key
        ModelConfig.from_hf({**d, "hf_extra": {}})


def test_a_misspelt_field_in_a_checkpoint_folder_is_refused(tmp_path):
    from glm5lab import GLM5ForCausalLM

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    GLM5ForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, "num_expert_per_tok": 2}))
    with pytest.raises(ConfigError, match="`num_expert_per_tok` is unknown.*`num_experts_per_tok`"):
        GLM5ForCausalLM.from_pretrained(tmp_path)
