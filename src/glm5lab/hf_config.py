"""HF `config.json` (model_type `glm_moe_dsa`) <-> `ModelConfig`.

Reference: transformers' `GlmMoeDsaConfig` (>= 5.24), including its derivation of `indexer_types` from
`index_topk_pattern` or `index_topk_freq`/`index_skip_topk_offset`, and the public GLM-5 config.json (which
also carries DeepSeek-style keys such as `scoring_func`, `topk_method`, `indexer_rope_interleave`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from glm5lab.validate import ConfigError, finite, int_at_least

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
GLM5LAB_ARCHITECTURE = "Glm5LabForCausalLM"
"""Written instead when the config uses a switch GLM-5 lacks (GQA layers, sliding-window or Gated
DeltaNet mixers): serving stacks pick the model class from `architectures`, so they refuse such a
folder instead of silently serving it as plain GLM-5 (transformers reads `model_type` only)."""
_ABSENT = object()

# Keys that HF derives from others or that only concern HF's runtime: read and dropped.
_DERIVED_OR_RUNTIME = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "head_dim",
    "qk_head_dim", "layer_types", "output_router_logits", "attention_dropout", "mlp_bias",
    "model_type", "rope_parameters", "rope_scaling", "num_experts", "index_topk_freq",
    "index_skip_topk_offset", "index_topk_pattern", "_name_or_path",
}
# Keys whose value changes the math: only the value GLM-5 uses is accepted.
_MUST_EQUAL = {
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    "moe_layer_freq": (1,),
    "mlp_bias": (False,),
    "attention_dropout": (0, 0.0),
}
_UNSUPPORTED = {
    "quantization_config": "quantised checkpoints (e.g. GLM-5-FP8) are not supported; use the bf16 one",
}
# Keys glm5lab does not interpret but accepts (kept in `hf_extra` and written back): what
# transformers' PreTrainedConfig writes or reads for every model (fine-tuning and output
# switches, tokenizer ids, remote-code pointers, the generation defaults older releases stored in
# config.json), and what the published GLM-5 and DeepSeek-V3 / V3.2 config.json files carry.
# Any other key is refused: a misspelt field would otherwise be ignored and its default used.
_HF_COMMON = {
    "chunk_size_feed_forward", "id2label", "label2id", "num_labels", "is_encoder_decoder", "is_decoder",
    "output_attentions", "output_hidden_states", "return_dict", "problem_type", "auto_map", "tokenizer_class",
    "task_specific_params", "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "torchscript", "use_bfloat16",
    "pruned_heads", "tf_legacy_loss", "_attn_implementation", "attn_implementation", "_commit_hash",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
}
_PUBLISHED = {"ep_size", "aux_loss_alpha", "seq_aux", "pretraining_tp", "partial_rotary_factor",
              "index_share_for_mtp_iteration", "expert_dtype"}
"""DeepSeek-V3's extras, GLM-4.5's `partial_rotary_factor`, GLM-5.2's `index_share_for_mtp_iteration`
(the MTP layer reuses the main model's top-k in its serving stacks) and the FP4 releases'
`expert_dtype`: accepted, kept, not interpreted."""


def _read(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _rope_theta(d: dict, default: float) -> float:
    """`rope_parameters.rope_theta` (or `rope_scaling.`, or top-level `rope_theta`; they must agree)."""
    key = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    params = d.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config field `{key}` = {params!r} is not allowed: an object "
                          "with `rope_theta` and `rope_type`")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config field `{key}.rope_type` = {rope_type!r} is not allowed: "
                          "'default' (GLM-5 uses plain RoPE; YaRN and others are not implemented)")
    found = {name: v for name, v in ((f"{key}.rope_theta", params.get("rope_theta", _ABSENT)),
                                     ("rope_theta", d.get("rope_theta", _ABSENT))) if v is not _ABSENT}
    for name, theta in found.items():
        finite(f"config field `{name}`", theta, positive=True, error=ConfigError)
    if len(set(found.values())) > 1:
        raise ConfigError(f"config fields {' and '.join(f'`{k}` = {v!r}' for k, v in found.items())} disagree")
    return float(next(iter(found.values()), default))


def _hf_int(d: dict, key: str, default: int, lo: int) -> int:
    return int_at_least(f"config field `{key}`", d.get(key, default), lo, error=ConfigError)


def _indexer_types(d: dict, n_layers: int) -> list[str] | None:
    """Same derivation as transformers' GlmMoeDsaConfig.__post_init__."""
    if d.get("indexer_types") is not None:
        return d["indexer_types"]  # validated by ModelConfig
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise ConfigError(f"config field `index_topk_pattern` = {pattern!r} is not allowed: "
                                  "a string of 'F' (full) and 'S' (shared)")
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    if "index_topk_freq" not in d and "index_skip_topk_offset" not in d:
        return None
    freq = _hf_int(d, "index_topk_freq", 1, 1)
    offset = _hf_int(d, "index_skip_topk_offset", 2, 0)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]


_INTERPRETED = _DERIVED_OR_RUNTIME | set(_MUST_EQUAL) | set(_UNSUPPORTED)


def check_known_keys(d: dict, names: set[str]) -> None:
    """Refuse a config.json key that is neither a `ModelConfig` field (`names`), nor one transformers'
    `GlmMoeDsaConfig` writes or reads, nor one the published GLM-5 / DeepSeek config.json files
    carry. Raises ConfigError naming the key and the closest known field."""
    import difflib

    known = names | _INTERPRETED | _HF_COMMON | _PUBLISHED
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known - {"hf_extra"}), n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else "see `glm5lab.ModelConfig` for the fields"
        more = f" (and {len(unknown) - 1} more unknown: {unknown[1:6]})" if len(unknown) > 1 else ""
        raise ConfigError(f"config field `{key}` is unknown ({hint}){more}: refused rather than ignored, "
                          "which would use the field's default")


def fields_from_hf(path_or_dict, defaults: dict) -> dict:
    """The `ModelConfig` fields of an HF config.json (path, folder or dict), `defaults` being
    ModelConfig's field defaults ({name: default}); `ModelConfig.from_hf` builds the config.

    Raises ConfigError for another model_type, a quantised checkpoint, a setting whose math
    glm5lab does not implement, or an unknown key (`check_known_keys`: a misspelt field is not
    ignored); FileNotFoundError when the file is missing."""
    d = _read(path_or_dict)
    model_type = d.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConfigError(f"config field `model_type` = {model_type!r} is not allowed: {MODEL_TYPE!r} "
                          "(glm5lab reads GLM-5 / GlmMoeDsa checkpoints)")
    for key, why in _UNSUPPORTED.items():
        if d.get(key) is not None:
            raise ConfigError(f"config field `{key}` is set: {why}")
    for key, allowed in _MUST_EQUAL.items():
        if key in d and d[key] not in allowed:
            raise ConfigError(f"config field `{key}` = {d[key]!r} is not allowed: one of {allowed}")
    if d.get("num_experts") is not None:
        d.setdefault("n_routed_experts", d["num_experts"])
        if d["n_routed_experts"] != d["num_experts"]:
            raise ConfigError(f"config fields `num_experts` = {d['num_experts']!r} and `n_routed_experts` = "
                              f"{d['n_routed_experts']!r} disagree (both name the routed expert count)")
    names = set(defaults) - {"hf_extra"}
    check_known_keys(d, names)
    kwargs = {k: d[k] for k in names if k in d}
    kwargs["rope_theta"] = _rope_theta(d, defaults["rope_theta"])
    n_layers = _hf_int(d, "num_hidden_layers", defaults["num_hidden_layers"], 1)
    indexer_types = _indexer_types(d, n_layers)
    if indexer_types is not None:
        kwargs["indexer_types"] = indexer_types
    kwargs["hf_extra"] = {k: v for k, v in d.items() if k not in names | _INTERPRETED}
    return kwargs


def config_to_hf(cfg) -> dict:
    """The config.json dict transformers' `GlmMoeDsaConfig` reads (plus glm5lab's switches), with
    the IndexCache schedule also as `index_topk_pattern` ("F"/"S" per layer, what vLLM and SGLang
    read) and `architectures` naming glm5lab's own class when GLM-5 cannot run the config."""
    plain = all(a == "mla" for a in cfg.attention_types) and all(m == "attention" for m in cfg.mixer_types)
    d = {"architectures": [ARCHITECTURE if plain else GLM5LAB_ARCHITECTURE], "model_type": MODEL_TYPE}
    d.update(cfg.hf_extra)
    for f in dataclasses.fields(cfg):
        if f.name in ("hf_extra", "rope_theta"):
            continue
        value = getattr(cfg, f.name)
        d[f.name] = list(value) if isinstance(value, list) else value
    d["rope_parameters"] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    d["head_dim"] = cfg.qk_rope_head_dim  # HF's convention: its rotary embedding reads head_dim
    d["qk_head_dim"] = cfg.qk_head_dim
    d["layer_types"] = ["indexed_attention"] * cfg.num_hidden_layers
    # the IndexCache schedule in the key vLLM / SGLang read (transformers reads indexer_types)
    d["index_topk_pattern"] = "".join("F" if t == "full" else "S" for t in cfg.indexer_types)
    return d


def save_config(cfg, folder: Path) -> None:
    """Write `folder/config.json` atomically."""
    from glm5lab.io_utils import atomic_write_text

    atomic_write_text(Path(folder) / "config.json", json.dumps(config_to_hf(cfg), indent=2) + "\n")
