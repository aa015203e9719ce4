"""The ledger against the model it describes.

Parameters: every component equals what the instantiated `GLM5ForCausalLM` holds (parameter
names mapped to components by module path), for the tiny presets and variants that switch each
term on and off, and for the full-size presets built on the meta device. FLOPs: equal to
torch's `FlopCounterMode` on a forward of the tiny model (the reference kernels compute the full
T x S square, or T x K gathered keys, so the expectation is assembled from the ledger's
per-token and per-key terms). Report figures: GLM-5 744B / 9.95B MTP / 40B, GLM-4.5 355B / 32B.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab import ledger as lg


def tiny_gqa(**overrides) -> ModelConfig:
    return ModelConfig.from_preset("tiny", attention_types=["gqa"] * 4, index_n_heads=0, index_head_dim=0,
                                   use_dsa=False, q_lora_rank=0, kv_lora_rank=0, **overrides)


SMALL_CONFIGS = {
    "tiny": lambda: ModelConfig.from_preset("tiny"),
    "small": lambda: ModelConfig.from_preset("small"),
    "tiny-gqa": tiny_gqa,
    "tiny-gqa-bias-qknorm-tied": lambda: tiny_gqa(attention_bias=True, use_qk_norm=True, tie_word_embeddings=True),
    "tiny-mla-bias-no-mtp": lambda: ModelConfig.from_preset("tiny", attention_bias=True, num_nextn_predict_layers=0),
    "tiny-mla-gqa-mixed-no-shared-expert": lambda: ModelConfig.from_preset(
        "tiny", attention_types=["mla", "gqa", "mla", "gqa"], n_shared_experts=0),
    "tiny-all-dense": lambda: ModelConfig.from_preset("tiny", mlp_layer_types=["dense"] * 4),
}


def component_of(name: str) -> str:
    """The ledger component a parameter of `GLM5ForCausalLM` belongs to, by module path."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "output"
    for marker, component in ((".self_attn.indexer.", "indexer"), (".self_attn.", "attention"),
                              (".mlp.gate.", "router"), (".mlp.experts.", "routed_experts"),
                              (".mlp.shared_experts.", "shared_experts"), (".mlp.", "dense_ffn"),
                              (".eh_proj.", "eh_proj")):
        if marker in name:
            return component
    if name.endswith("norm.weight"):
        return "norms"
    raise AssertionError(f"parameter {name} maps to no ledger component")


def held(model: GLM5ForCausalLM) -> dict[str, dict[str, int]]:
    """Parameter elements the model holds, by component, for the main model and the MTP layer."""
    out = {"main": Counter(dict.fromkeys(lg.COMPONENTS, 0)), "mtp": Counter(dict.fromkeys(lg.COMPONENTS, 0))}
    for name, p in model.named_parameters():
        out["mtp" if name.startswith("model.mtp_layers.") else "main"][component_of(name)] += p.numel()
    return {k: dict(v) for k, v in out.items()}


def activated_held(model: GLM5ForCausalLM) -> int:
    """Every parameter except the routed experts, plus top-k / E of each expert bank."""
    cfg = model.config
    n = 0
    for name, p in model.named_parameters():
        routed = component_of(name) == "routed_experts"
        n += p.numel() * cfg.num_experts_per_tok // cfg.n_routed_experts if routed else p.numel()
    return n


def check_counts(cfg: ModelConfig, model: GLM5ForCausalLM) -> None:
    h = held(model)
    assert lg.main_params(cfg) == h["main"]
    assert lg.mtp_params(cfg) == h["mtp"]
    everything = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.model.mtp_layers.parameters())
    emb_out = h["main"]["embedding"] + h["main"]["output"]
    conv = lg.conventions(cfg)
    assert conv["with_embeddings_with_mtp"]["total"] == everything
    assert conv["with_embeddings_without_mtp"]["total"] == everything - mtp
    assert conv["without_embeddings_with_mtp"]["total"] == everything - emb_out
    assert conv["without_embeddings_without_mtp"]["total"] == everything - mtp - emb_out
    assert conv["with_embeddings_with_mtp"]["activated"] == activated_held(model)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert sum(lg.router_bias_elements(cfg).values()) == bias


@pytest.mark.parametrize("name", SMALL_CONFIGS)
def test_counts_equal_the_instantiated_model(name):
    cfg = SMALL_CONFIGS[name]()
    check_counts(cfg, GLM5ForCausalLM(cfg))


@pytest.fixture(scope="module", params=["glm5", "glm4.5"])
def full_size(request):
    cfg = ModelConfig.from_preset(request.param)
    with torch.device("meta"):
        return cfg, GLM5ForCausalLM(cfg)


def test_counts_equal_the_full_size_model_on_meta(full_size):
    check_counts(*full_size)


def test_glm5_report_figures():
    conv = lg.conventions(ModelConfig.from_preset("glm5"))
    assert conv["with_embeddings_without_mtp"]["total"] == 743_911_199_232  # transformers' count
    assert conv["without_embeddings_with_mtp"]["total"] == 751_960_954_112  # the report's stated convention
    assert sum(lg.mtp_params(ModelConfig.from_preset("glm5")).values()) == 9_952_920_320
    assert conv["without_embeddings_without_mtp"]["activated"] == 39_881_544_192
    assert conv["without_embeddings_with_mtp"]["activated"] == 40_472_777_984
    assert conv["with_embeddings_without_mtp"]["activated"] == 41_784_709_632
    assert conv["with_embeddings_with_mtp"]["activated"] == 42_375_943_424


def test_glm4_5_report_figures_fit_the_stated_convention():
    conv = lg.conventions(ModelConfig.from_preset("glm4.5"))["without_embeddings_with_mtp"]
    assert round(conv["total"] / 1e9) == 355 and round(conv["activated"] / 1e9) == 32
    assert conv == {"total": 355_233_991_936, "activated": 32_482_299_136}


def test_state_widths_and_bytes():
    glm5 = lg.state(ModelConfig.from_preset("glm5"), context=1000)
    assert glm5["per_layer_values"] == {"mla": 576, "indexer": 128}  # no GQA layer: no gqa entry
    assert glm5["main"]["values"] == 78 * (576 + 128) and glm5["mtp"]["values"] == 576 + 128
    assert glm5["main"]["bytes_per_token"] == 78 * 704 * 2
    assert glm5["main"]["bytes_for_context"] == 78 * 704 * 2 * 1000
    gqa8 = lg.state(ModelConfig.from_preset("gqa-8"), dtype="fp8")
    assert gqa8["per_layer_values"] == {"gqa": 2048, "indexer": 0}
    assert gqa8["main"] == {"attention_values": 78 * 2048, "indexer_values": 0, "values": 78 * 2048,
                            "window_values": 0, "window_tokens": 0, "window_bytes": 0, "recurrent_bytes": 0,
                            "fixed_bytes": 0, "indexer_bytes_per_token": 0, "bytes_per_token": 78 * 2048,
                            "bytes_for_context": 78 * 2048 * 202752}
    tiny = lg.state(ModelConfig.from_preset("tiny"), dtype="fp32")
    assert tiny["main"]["values"] == 4 * (32 + 8) + 2 * 16  # indexer keys on the 2 full layers only
    assert tiny["main"]["bytes_per_token"] == 4 * tiny["main"]["values"]
    assert lg.state(ModelConfig.from_preset("tiny", use_dsa=False))["main"]["indexer_values"] == 0


def test_state_fp8_index_keys_count_a_byte_per_value_and_a_scale_per_token():
    """index_dtype="fp8": per index-cache layer J fp8 values + a 4-byte fp32 scale per token (GLM-5: 128 + 4 = 132
    B against 256 in bf16, 512 in fp32); the default index_dtype is dtype, so dtype="fp8" counts the scales too."""
    glm5 = ModelConfig.from_preset("glm5")
    s = lg.state(glm5, dtype="bf16", index_dtype="fp8", context=1000)
    assert s["index_dtype"] == "fp8" and s["index_bytes_per_value"] == 1 and s["index_scale_bytes"] == 4
    assert s["main"]["indexer_bytes_per_token"] == 78 * (128 + 4) and s["mtp"]["indexer_bytes_per_token"] == 132
    assert s["main"]["bytes_per_token"] == 78 * (576 * 2 + 132)
    assert s["main"]["bytes_for_context"] == 78 * (576 * 2 + 132) * 1000
    fp32 = lg.state(glm5, dtype="fp32", context=1000)
    assert fp32["index_dtype"] == "fp32" and fp32["main"]["indexer_bytes_per_token"] == 78 * 512
    assert fp32["main"]["indexer_bytes_per_token"] / s["main"]["indexer_bytes_per_token"] == 512 / 132
    assert lg.state(glm5, dtype="fp8")["main"]["bytes_per_token"] == 78 * (576 + 132)
    assert lg.state(glm5, dtype="fp8", index_dtype="bf16")["main"]["bytes_per_token"] == 78 * (576 + 256)
    tiny = lg.state(ModelConfig.from_preset("tiny"), dtype="fp32", index_dtype="fp8")
    assert tiny["main"]["bytes_per_token"] == 4 * (4 * (32 + 8)) + 2 * (16 + 4)
    gqa8 = lg.state(ModelConfig.from_preset("gqa-8"), dtype="bf16", index_dtype="fp8")  # no indexer keys: no scales
    assert gqa8["main"]["indexer_bytes_per_token"] == 0 and gqa8["main"]["bytes_per_token"] == 78 * 2048 * 2
    assert lg.ledger(glm5, index_dtype="fp8")["state"]["main"]["indexer_bytes_per_token"] == 78 * 132


@pytest.mark.parametrize("bad", ["int8", "e4m3", 1])
def test_state_refuses_an_unknown_index_dtype_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^index_dtype = .* is not allowed: None \(= dtype\) or one of fp32, bf16"):
        lg.state(ModelConfig.from_preset("tiny"), index_dtype=bad)


@pytest.mark.parametrize("L", [1, 2, 7, 8, 9, 50])
@pytest.mark.parametrize("topk", [None, 8])
def test_mean_keys_is_the_average_over_prefill_positions(L, topk):
    keys = [min(t, topk) if topk else t for t in range(1, L + 1)]
    assert lg.mean_keys(L, topk, prefill=True) == pytest.approx(sum(keys) / L, rel=1e-12)
    assert lg.mean_keys(L, topk, prefill=False) == keys[-1]


def test_glm5_flops_by_hand():
    cfg = ModelConfig.from_preset("glm5")
    L = cfg.max_position_embeddings
    d = lg.flops(cfg)["decode"]
    assert d["core_attention"] == 78 * 2 * 64 * (512 + 64 + 512) * 2048
    assert d["indexer_scoring"] == 78 * 2 * 32 * (128 + 1) * L
    assert d["lm_head"] == 2 * 154880 * 6144
    assert d["moe"] == 75 * 2 * (256 * 6144 + 9 * 3 * 6144 * 2048)
    assert lg.flops(cfg, context=4096)["decode"]["core_attention"] == d["core_attention"]  # DSA: flat past top-k
    dense = lg.flops(ModelConfig.from_preset("mla-256"))["decode"]
    assert dense["core_attention"] == 78 * 2 * 64 * 1088 * L and dense["indexer_scoring"] == 0


def _cpu_flash_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of CPU SDPA (`aten._scaled_dot_product_flash_attention_for_cpu`, which torch 2.13's
    FlopCounterMode does not count): the same formula as its CUDA flash op."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def counted_flops(model, T: int, **kw) -> int:
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_sdpa}
    with FlopCounterMode(display=False, custom_mapping=mapping) as fc, torch.no_grad():
        model(ids, moe_impl="loop", **kw)
    return fc.get_total_flops()


@pytest.mark.parametrize("name", ["tiny-dense-attention", "tiny-gqa-bias-qknorm"])
def test_prefill_flops_equal_the_flop_counter(name):
    """Naive attention scores the full T x T square: T^2 keys where the ledger averages (T+1)/2."""
    cfg = (ModelConfig.from_preset("tiny", use_dsa=False) if name == "tiny-dense-attention"
           else tiny_gqa(attention_bias=True, use_qk_norm=True))
    model, T = GLM5ForCausalLM(cfg), 5
    f, per_key = lg.flops(cfg, context=T), lg.flops(cfg, context=1)
    for mode, tokens, depth in (("prefill", T, 0), ("mtp_prefill", T - 1, 1)):
        expected = tokens * (f[mode]["total"] - f[mode]["core_attention"]) + tokens**2 * per_key[mode]["core_attention"]
        base = counted_flops(model, T, attn_impl="naive") if depth else 0
        assert counted_flops(model, T, attn_impl="naive", mtp_depth=depth) - base == expected


def test_decode_flops_equal_the_flop_counter_absorbed_and_sparse():
    """Absorbed MLA (the decode path) with DSA: indexer over the T x T square, core attention over
    T x index_topk gathered keys. The gathered kernel's SDPA reads the whole (C + R)-wide latent
    as value and drops the last R output columns (the fused CPU kernel wants equal widths), so
    as run it multiplies 2 H R more per key and layer than the ledger's 2 H ((C + R) + C)."""
    cfg = ModelConfig.from_preset("tiny")
    model, T = GLM5ForCausalLM(cfg), 12
    d, per_key = lg.flops(cfg, context=T)["decode"], lg.flops(cfg, context=1)["decode"]
    expected = (T * (d["total"] - d["core_attention"] - d["indexer_scoring"])
                + T * T * per_key["indexer_scoring"] + T * cfg.index_topk * per_key["core_attention"])
    sparse_layers = sum(spec.indexer != "none" for spec in cfg.layers)
    dropped_value_columns = sparse_layers * T * cfg.index_topk * 2 * cfg.num_attention_heads * cfg.qk_rope_head_dim
    assert T > cfg.index_topk
    assert counted_flops(model, T, attn_impl="absorbed") == expected + dropped_value_columns


def test_ledger_dict_is_json_and_render_states_the_convention():
    d = lg.ledger(ModelConfig.from_preset("glm5"), name="glm5", context=4096)
    assert json.loads(json.dumps(d)) == d
    assert d["total_params"] == 753_864_119_552 and d["activated_params"] == 42_375_943_424
    assert set(lg.CONVENTIONS) <= set(d)
    text = lg.render(d)
    assert "743,911,199,232" in text and "751,960,954,112" in text
    assert "Convention that matches the report" in text
    assert "744B = incl. embedding+output, excl. MTP" in " ".join(text.split())


@pytest.mark.parametrize("kw, match", [({"dtype": "int4"}, "dtype = 'int4' is not allowed: one of fp32, bf16, fp16, fp8"), ({"context": 0}, "context 0"),
                                       ({"context": 2049}, "max_position_embeddings=2048")])
def test_bad_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        lg.ledger(ModelConfig.from_preset("tiny"), **kw)


@pytest.mark.parametrize("name, specific", [("glm5", True), ("glm4.5", True), ("tiny", False),
                                            ("gqa-8", False), ("mla-256", False)])
def test_report_note_only_for_the_report_shapes(name, specific):
    cfg = ModelConfig.from_preset(name)
    d = lg.ledger(cfg, name=name)
    text = " ".join(lg.render(d).split())
    assert ("Convention that matches the report" in text) is specific
    assert ("752B for GLM-5" in text) is specific
    assert d["report_note"] == (lg.REPORT_NOTE if specific else lg.GENERAL_NOTE)
    assert " ".join(d["report_note"].split()) in text
    assert d["report_stated_convention"] == "without_embeddings_with_mtp"
    # the GLM-5 checkpoint's own config.json (pad token, extra keys) is still the GLM-5 shape
    if name == "glm5":
        assert lg.report_note(cfg.replace(pad_token_id=154820, hf_extra={"ep_size": 1})) == lg.REPORT_NOTE


def test_per_layer_values_list_only_the_attention_kinds_present():
    mixed = ModelConfig.from_preset("tiny", attention_types=["mla", "gqa", "mla", "mla"])
    assert lg.state(mixed)["per_layer_values"] == {"mla": 40, "gqa": 4 * (24 + 16), "indexer": 16}
    assert lg.state(tiny_gqa())["per_layer_values"] == {"gqa": 4 * (24 + 16), "indexer": 0}
    for name in ("glm5", "tiny", "gqa-8"):
        d = lg.ledger(ModelConfig.from_preset(name))
        assert {"total_params", "activated_params", *lg.CONVENTIONS} <= set(d)
