"""The model ledger: parameters, per-token state bytes and FLOPs from a `ModelConfig` alone.

Pure arithmetic on config fields: no torch, no model build, so the 744B GLM-5 is counted in
milliseconds. `tests/test_ledger.py` pins every parameter figure to what `GLM5ForCausalLM`
holds (module for module) and the full-size totals to the model built on the meta device.
Derivations and the printed figures for GLM-5 / GLM-4.5: `docs/ledger.md`.

Units: parameters are element counts; state in cached values and bytes; FLOPs per token with
2 FLOPs per multiply-add (biases, norms, softmax and activations are not counted).

Counting conventions (`CONVENTIONS`): {with, without} the embedding + output head x {with, without} the MTP
layer. "Activated" = the parameters one token passes through: every non-expert parameter (the whole embedding
matrix included, as DeepSeek and GLM count it), the router and the shared expert, and `num_experts_per_tok`
routed experts per MoE layer. The GLM-5 report says its 744B / 40B include MTP and exclude embedding and
output; that convention gives 752B / 40.5B. 744B is the count with embedding and output and without MTP (=
transformers' `GlmMoeDsaForCausalLM`, whose MTP layer is not built).

Expert-parallel all-to-all bytes (`a2a_bytes`, `a2a_per_token`) live in `glm5lab.parallel.alltoall`; bytes per
GPU for a training or serving layout in `glm5lab.deployment`; the activation bytes of a training step in
`glm5lab.activations`.

Sources: the GLM-5 report's appendix table; transformers' `GlmMoeDsaForCausalLM` (module structure, mirrored
by `glm5lab.model`); DeepSeek-V2 section 2.1 (MLA, absorbed decode); DeepSeek-V3.2 (DSA lightning indexer).
"""

from __future__ import annotations

import textwrap

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.validate import DTYPES, TORCH_NAMES, dtype_bytes, dtype_name, refuse

COMPONENTS = ("embedding", "attention", "indexer", "dense_ffn", "routed_experts", "shared_experts",
              "router", "norms", "eh_proj", "output")
CONVENTIONS = {
    "with_embeddings_with_mtp": "incl. emb+output, incl. MTP (all the model holds)",
    "with_embeddings_without_mtp": "incl. emb+output, excl. MTP (transformers' count)",
    "without_embeddings_with_mtp": "excl. emb+output, incl. MTP (report's stated)",
    "without_embeddings_without_mtp": "excl. emb+output, excl. MTP",
}
REPORT_NOTE = (
    "Convention that matches the report: it states 'incl. MTP, excl. embedding and output', which "
    "gives 752B for GLM-5, not its 744B; 744B = incl. embedding+output, excl. MTP (transformers' "
    "GlmMoeDsaForCausalLM). GLM-5's 40B activated and GLM-4.5's 355B / 32B fit the stated "
    "convention (excl. embedding+output).")
GENERAL_NOTE = (
    "The GLM-5 and GLM-4.5 reports state their counts 'incl. MTP, excl. embedding and output' (the "
    "row marked \"report's stated\"); transformers counts incl. embedding+output, excl. MTP.")
REPORT_SHAPES = ("glm5", "glm4.5")
"""Presets whose published figures `REPORT_NOTE` discusses; it is printed for these shapes only."""
FLOP_TERMS = ("projections", "indexer_scoring", "core_attention", "moe", "dense_ffn", "lm_head")


def attention_weights(cfg: ModelConfig, attention_type: str) -> dict[str, int]:
    """Elements of each weight matrix of one attention layer ("mla" or "gqa"); names as in
    `glm5lab.model.mla` / `gqa`. Norms and biases are in `attention_params`."""
    D, H, X, V = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    if attention_type == "gdn":
        hv, hk, k, v = cfg.gdn_dims
        return {"q_proj": D * hk * k, "k_proj": D * hk * k, "v_proj": D * hv * v, "z_proj": D * hv * v,
                "a_proj": D * hv, "b_proj": D * hv, "o_proj": hv * v * D}
    if attention_type == "simple_gdn":
        gates = {"a_proj": D * H, "b_proj": D * H} if cfg.simple_gdn_decay == "learned" else {}
        return {**attention_weights(cfg, "gqa"), **gates}
    if attention_type == "mla":
        Q, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        return {"q_a_proj": D * Q, "q_b_proj": Q * H * X, "kv_a_proj_with_mqa": D * (C + R),
                "kv_b_proj": C * H * (cfg.qk_nope_head_dim + V), "o_proj": H * V * D}
    G = cfg.num_key_value_heads
    return {"q_proj": D * H * X, "k_proj": D * G * X, "v_proj": D * G * V, "o_proj": H * V * D}


def attention_params(cfg: ModelConfig, attention_type: str) -> int:
    """Parameters of one attention layer: weights + biases (`attention_bias`) + inner norms.

    MLA: q_a_layernorm (q_lora_rank) and kv_a_layernorm (kv_lora_rank); biases on q_a_proj,
    kv_a_proj_with_mqa and o_proj. GQA: biases on q/k/v only (o_proj has none, as GLM-4.5);
    q_norm and k_norm (qk_head_dim each) when `use_qk_norm`."""
    weights = sum(attention_weights(cfg, attention_type).values())
    if attention_type == "gdn":  # + depthwise conv over [q|k|v], A_log, dt_bias, gated-norm weight
        hv, hk, k, v = cfg.gdn_dims
        return weights + (2 * hk * k + hv * v) * cfg.linear_conv_kernel_dim + 2 * hv + v
    if attention_type == "simple_gdn":  # + A_log, dt_bias, b_bias per head; q/k/v biases as GQA
        G, X = cfg.num_key_value_heads, cfg.qk_head_dim
        biases = cfg.num_attention_heads * X + G * X + G * cfg.v_head_dim if cfg.attention_bias else 0
        return weights + 3 * cfg.num_attention_heads + biases
    if attention_type == "mla":
        C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        norms = cfg.q_lora_rank + C
        biases = cfg.q_lora_rank + C + R + cfg.hidden_size
    else:
        H, G, X = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.qk_head_dim
        norms = 2 * X if cfg.use_qk_norm else 0
        biases = H * X + G * X + G * cfg.v_head_dim
    return weights + norms + (biases if cfg.attention_bias else 0)


def indexer_weights(cfg: ModelConfig) -> int:
    """Elements of the lightning indexer's matrices: wq_b [I*J, Q], wk [J, D], weights_proj [I, D]."""
    I, J = cfg.index_n_heads, cfg.index_head_dim
    return cfg.q_lora_rank * I * J + cfg.hidden_size * J + cfg.hidden_size * I


def indexer_params(cfg: ModelConfig) -> int:
    """Parameters of one lightning indexer: its matrices + k_norm (LayerNorm: weight and bias, J each)."""
    return indexer_weights(cfg) + 2 * cfg.index_head_dim


def mixer_kind(spec: LayerSpec) -> str:
    """The ledger's name for a layer's token mixer: "gdn" / "simple_gdn" for Gated DeltaNet
    layers, else the attention kind ("mla" / "gqa"; an "swa" layer has its attention's weights)."""
    return spec.mixer if spec.recurrent else spec.attention


def _blocks(cfg: ModelConfig, *, mtp: bool) -> tuple[LayerSpec, ...]:
    """The main layers' specs, or the MTP layer's (empty without one)."""
    if not mtp:
        return cfg.layers
    return (cfg.mtp_layer,) if cfg.num_nextn_predict_layers else ()


def block_params(cfg: ModelConfig, spec: LayerSpec, *, active: bool = False) -> dict[str, int]:
    """Parameters of one decoder block (`LayerSpec`) by component. active=True counts `num_experts_per_tok`
    routed experts instead of all (router and shared expert are always active). An indexer counts where the
    layer holds its weights (`has_indexer_weights`, SWA layers included), whether or not it runs."""
    D = cfg.hidden_size
    c = dict.fromkeys(COMPONENTS, 0)
    c["attention"] = attention_params(cfg, mixer_kind(spec))
    c["indexer"] = indexer_params(cfg) if spec.has_indexer_weights else 0
    c["norms"] = 2 * D
    if spec.mlp == "dense":
        c["dense_ffn"] = 3 * D * cfg.intermediate_size
    else:
        expert = 3 * D * cfg.moe_intermediate_size
        c["routed_experts"] = (cfg.num_experts_per_tok if active else cfg.n_routed_experts) * expert
        c["shared_experts"] = cfg.n_shared_experts * expert
        c["router"] = cfg.n_routed_experts * D
    return c


def main_params(cfg: ModelConfig, *, active: bool = False) -> dict[str, int]:
    """Main model (no MTP) by component: blocks + embedding + final norm + lm_head (0 if tied)."""
    c = dict.fromkeys(COMPONENTS, 0)
    for spec in cfg.layers:
        for k, v in block_params(cfg, spec, active=active).items():
            c[k] += v
    V, D = cfg.vocab_size, cfg.hidden_size
    c["embedding"] = V * D
    c["norms"] += D
    c["output"] = 0 if cfg.tie_word_embeddings else V * D
    return c


def mtp_params(cfg: ModelConfig, *, active: bool = False) -> dict[str, int]:
    """The MTP layer by component: its block (with its indexer) + enorm, hnorm, shared_head.norm
    (in "norms") + eh_proj [D, 2D]. Embedding and lm_head are shared with the main model: 0 here."""
    if cfg.num_nextn_predict_layers == 0:
        return dict.fromkeys(COMPONENTS, 0)
    c = block_params(cfg, cfg.mtp_layer, active=active)
    c["norms"] += 3 * cfg.hidden_size
    c["eh_proj"] = 2 * cfg.hidden_size**2
    return c


def count(cfg: ModelConfig, *, embeddings: bool, mtp: bool, active: bool = False) -> int:
    """Parameters under one convention (see the module docstring)."""
    main = main_params(cfg, active=active)
    n = sum(main.values()) + (sum(mtp_params(cfg, active=active).values()) if mtp else 0)
    return n if embeddings else n - main["embedding"] - main["output"]


def conventions(cfg: ModelConfig) -> dict[str, dict[str, int]]:
    """{convention: {"total", "activated"}} for the four conventions of `CONVENTIONS`."""
    out = {}
    for name in CONVENTIONS:
        emb, mtp = name.startswith("with_"), name.endswith("_with_mtp")
        out[name] = {"total": count(cfg, embeddings=emb, mtp=mtp),
                     "activated": count(cfg, embeddings=emb, mtp=mtp, active=True)}
    return out


def router_bias_elements(cfg: ModelConfig) -> dict[str, int]:
    """Elements of `e_score_correction_bias` (a buffer, E per MoE layer): main layers and MTP."""
    E = cfg.n_routed_experts
    main, mtp = (sum(E for spec in _blocks(cfg, mtp=m) if spec.mlp == "sparse") for m in (False, True))
    return {"main": main, "mtp": mtp}


INDEX_SCALE_BYTES = 4
"""Bytes of the fp32 scale stored per token beside fp8 indexer keys (`glm5lab.model.fp8_keys`)."""


def _state_of(cfg: ModelConfig, specs, nbytes: int, L: int) -> dict[str, int]:
    """The caches of `specs` as `KVCache` allocates them for a row of L tokens: per-token values of the
    attention layers (`index_cache` indexer keys included), the rings of the sliding-window layers
    (min(window, L) tokens each) and the recurrent states of the Gated DeltaNet layers, in bytes."""
    widths = {"mla": cfg.mla_cache_width, "gqa": cfg.gqa_cache_width}
    attn = sum(widths[spec.attention] for spec in specs if spec.mixer == "attention")
    index = sum(cfg.index_head_dim for spec in specs if spec.index_cache)
    window = sum(widths[spec.attention] for spec in specs if spec.mixer == "swa")
    window_tokens = min(cfg.sliding_window, L) if window else 0
    recurrent = sum(recurrent_state_bytes(cfg, spec, nbytes) for spec in specs if spec.recurrent)
    return {"attention_values": attn, "indexer_values": index, "values": attn + index,
            "index_layers": sum(1 for spec in specs if spec.index_cache),
            "window_values": window, "window_tokens": window_tokens, "window_bytes": window * window_tokens * nbytes,
            "recurrent_bytes": recurrent, "fixed_bytes": window * window_tokens * nbytes + recurrent}


def recurrent_state_bytes(cfg: ModelConfig, spec: LayerSpec, nbytes: int) -> int:
    """Bytes per row of one Gated DeltaNet / SimpleGDN layer's decode state (`RecurrentState`): the
    fp32 matrix per head [H, K, V] and, for Gated DeltaNet, its conv window [2 Hk K + H V, kernel - 1]
    at `nbytes` per value (the cache dtype)."""
    if spec.mixer == "gdn":
        hv, hk, k, v = cfg.gdn_dims
        return hv * k * v * 4 + (2 * hk * k + hv * v) * (cfg.linear_conv_kernel_dim - 1) * nbytes
    return cfg.num_attention_heads * cfg.qk_head_dim * cfg.v_head_dim * 4


def state(cfg: ModelConfig, *, dtype: str = "bf16", context: int | None = None, index_dtype: str | None = None) -> dict:
    """Inference state per token and for `context` tokens (default `max_position_embeddings`).

    Per MLA layer `mla_cache_width` values (latent + shared RoPE key: 576 in GLM-5); per GQA layer
    `gqa_cache_width` (K and V of every KV head: 2048 in GQA-8), each listed in "per_layer_values" only when
    the model has such a layer; plus `index_head_dim` indexer-key values (128) per full-indexer layer when
    `use_dsa`. The attention values in `dtype`; the indexer keys in `index_dtype` (default: `dtype`), and when
    that is "fp8" (float8_e4m3fn, as DeepSeek-V3.2 serves them: `KVCache(index_cache_dtype="fp8")`) 1 byte per
    value plus a 4-byte fp32 scale per token per index-cache layer (`INDEX_SCALE_BYTES`). Per part:
    "indexer_bytes_per_token" (keys and scales) and "bytes_per_token" (everything), which equals
    `KVCache.bytes_per_token()` for the same dtypes. A sliding-window ("swa") layer holds its width for
    min(sliding_window, context) tokens only (a ring, `glm5lab.model.window_ring`: "window_bytes"), a Gated
    DeltaNet / SimpleGDN layer a fixed state ("recurrent_bytes", its matrices in fp32); neither is in
    "bytes_per_token", both are in "fixed_bytes" and "bytes_for_context" = bytes_per_token x context +
    fixed_bytes (per sequence). The MTP layer is reported apart (it holds a cache only when
    used as a draft head). Raises ValueError for an unknown dtype or a context outside
    1..max_position_embeddings."""
    nbytes, L = dtype_bytes(dtype), _context(cfg, context)
    index_dtype = dtype if index_dtype is None else index_dtype
    if index_dtype not in DTYPES and index_dtype not in TORCH_NAMES:
        refuse("index_dtype", index_dtype, f"None (= dtype) or one of {', '.join(DTYPES)}")
    ibytes = dtype_bytes(index_dtype)
    scale_bytes = INDEX_SCALE_BYTES if dtype_name(index_dtype) == "fp8" else 0
    every = _blocks(cfg, mtp=False) + _blocks(cfg, mtp=True)
    kinds = {mixer_kind(spec) for spec in every}
    widths = {"mla": cfg.mla_cache_width, "gqa": cfg.gqa_cache_width}
    out = {"dtype": dtype, "bytes_per_value": nbytes, "index_dtype": index_dtype, "index_bytes_per_value": ibytes,
           "index_scale_bytes": scale_bytes, "context": L,
           "per_layer_values": {**{a: w for a, w in widths.items() if a in kinds},
                                "indexer": cfg.index_head_dim if any(spec.index_cache for spec in every) else 0}}
    for part in ("main", "mtp"):
        s = _state_of(cfg, _blocks(cfg, mtp=part == "mtp"), nbytes, L)
        s["indexer_bytes_per_token"] = s["indexer_values"] * ibytes + s.pop("index_layers") * scale_bytes
        s["bytes_per_token"] = s["attention_values"] * nbytes + s["indexer_bytes_per_token"]
        s["bytes_for_context"] = s["bytes_per_token"] * L + s["fixed_bytes"]
        out[part] = s
    return out


def mean_keys(L: int, topk: int | None = None, *, prefill: bool) -> float:
    """Keys one query attends to. decode at context L: min(L, topk); prefill of length L:
    the mean over positions t = 1..L of min(t, topk) (no topk = dense: (L + 1) / 2)."""
    if not prefill:
        return float(min(L, topk) if topk else L)
    if not topk or L <= topk:
        return (L + 1) / 2
    return (topk * (topk + 1) / 2 + (L - topk) * topk) / L


def block_flops(cfg: ModelConfig, spec: LayerSpec, L: int, *, prefill: bool) -> dict[str, float]:
    """FLOPs per token of one decoder block at context L (2 per multiply-add).

    projections: 2 x attention matrices (kv_b counted once per token: the naive path expands each
      token's latent once; the absorbed path applies W_uk, W_uv to the query/output, same count)
      + 2 x indexer matrices on a layer that runs its indexer (`use_dsa` and an "own" layer; SWA
      layers holding indexer weights never run them);
    indexer_scoring: per causal key 2*I*J (q_i . k) + 2*I (head weights), I = index_n_heads
      (counted at every L, though `MLAttention` skips selection when T <= index_topk: a decode
      cache still needs the indexer keys and later queries score all of them);
    core_attention: per attended key, MLA prefill (naive) 2*H*(qk_head_dim + v_head_dim), MLA
      decode (absorbed) 2*H*((C + R) + C), GQA 2*H*(qk_head_dim + v_head_dim); keys =
      `mean_keys` with topk = `sliding_window` on "swa" layers, index_topk on layers that select
      keys ("own"/"shared") when `use_dsa`;
    moe: 2 x (router E*D + K routed + shared experts, 3*D*I each); dense_ffn: 2 x 3*D*I_dense."""
    attention_type, mlp_type = mixer_kind(spec), spec.mlp
    D, H = cfg.hidden_size, cfg.num_attention_heads
    runs_indexer = spec.indexer == "own" and cfg.use_dsa
    f = dict.fromkeys(FLOP_TERMS, 0.0)
    f["projections"] = 2.0 * (sum(attention_weights(cfg, attention_type).values())
                              + (indexer_weights(cfg) if runs_indexer else 0))
    if runs_indexer:
        f["indexer_scoring"] = 2.0 * cfg.index_n_heads * (cfg.index_head_dim + 1) * mean_keys(L, prefill=prefill)
    if attention_type in ("gdn", "simple_gdn"):  # per token, independent of L: decay, read, write, query
        heads, _, k, v = cfg.gdn_dims if attention_type == "gdn" else (H, 0, cfg.qk_head_dim, cfg.v_head_dim)
        f["core_attention"] = 2.0 * 4 * heads * k * v
        per_key = None
    elif attention_type == "mla" and not prefill:
        per_key = 2 * H * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    else:
        per_key = 2 * H * (cfg.qk_head_dim + cfg.v_head_dim)
    topk = spec.window or (cfg.index_topk if spec.indexer != "none" and cfg.use_dsa else None)
    if per_key is not None:
        f["core_attention"] = per_key * mean_keys(L, topk, prefill=prefill)
    if mlp_type == "dense":
        f["dense_ffn"] = 2.0 * 3 * D * cfg.intermediate_size
    else:
        experts = cfg.num_experts_per_tok + cfg.n_shared_experts
        f["moe"] = 2.0 * (cfg.n_routed_experts * D + experts * 3 * D * cfg.moe_intermediate_size)
    return f


def flops(cfg: ModelConfig, *, context: int | None = None) -> dict:
    """FLOPs per token: "prefill" (mean over the positions of a length-L prefill), "decode" (one
    new token at context L, absorbed MLA), each by `FLOP_TERMS` + "total", for the main model;
    "mtp_prefill" / "mtp_decode": one MTP step (its block + eh_proj in projections + lm_head).
    Raises ValueError for a context outside 1..max_position_embeddings."""
    L = _context(cfg, context)
    out = {"context": L}
    lm_head = 2.0 * cfg.vocab_size * cfg.hidden_size
    for mode, prefill in (("prefill", True), ("decode", False)):
        f = dict.fromkeys(FLOP_TERMS, 0.0)
        for spec in cfg.layers:
            for k, v in block_flops(cfg, spec, L, prefill=prefill).items():
                f[k] += v
        f["lm_head"] = lm_head
        out[mode] = {**f, "total": sum(f.values())}
        if cfg.num_nextn_predict_layers:
            m = block_flops(cfg, cfg.mtp_layer, L, prefill=prefill)
            m["projections"] += 2.0 * 2 * cfg.hidden_size**2
            m["lm_head"] = lm_head
            out[f"mtp_{mode}"] = {**m, "total": sum(m.values())}
    return out


def _context(cfg: ModelConfig, context: int | None) -> int:
    L = cfg.max_position_embeddings if context is None else context
    if not isinstance(L, int) or not 1 <= L <= cfg.max_position_embeddings:
        raise ValueError(f"context {L!r} is not allowed: 1..max_position_embeddings={cfg.max_position_embeddings}")
    return L


def report_note(cfg: ModelConfig) -> str:
    """`REPORT_NOTE` when `cfg` has the parameter counts of a `REPORT_SHAPES` preset (GLM-5 or
    GLM-4.5, under every convention), else `GENERAL_NOTE`."""
    counts = conventions(cfg)
    return REPORT_NOTE if any(counts == conventions(ModelConfig.from_preset(n)) for n in REPORT_SHAPES) else GENERAL_NOTE


def ledger(cfg: ModelConfig, *, dtype: str = "bf16", context: int | None = None, name: str = "",
           index_dtype: str | None = None) -> dict:
    """Everything, as a JSON-serialisable dict. `total_params` / `activated_params` = every parameter the
    model holds (with embedding+output, with MTP); one key per convention of `CONVENTIONS`, each {"total",
    "activated"}; "report_note" from `report_note`; "state" from `state` (index_dtype: the indexer keys'
    dtype there). Raises ValueError (bad dtype, index_dtype or context)."""
    conv = conventions(cfg)
    full = conv["with_embeddings_with_mtp"]
    return {
        "name": name, "total_params": full["total"], "activated_params": full["activated"], **conv,
        "report_stated_convention": "without_embeddings_with_mtp", "report_note": report_note(cfg),
        "params": {"main": main_params(cfg), "main_activated": main_params(cfg, active=True),
                   "mtp": mtp_params(cfg), "mtp_activated": mtp_params(cfg, active=True)},
        "buffers": {"e_score_correction_bias": router_bias_elements(cfg)},
        "state": state(cfg, dtype=dtype, context=context, index_dtype=index_dtype),
        "flops_per_token": flops(cfg, context=context),
    }


def _si(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _param_lines(d: dict) -> list[str]:
    p = d["params"]
    cols = ("main", "main_activated", "mtp", "mtp_activated")
    lines = [f"{'parameters':<16}{'main':>18}{'main activated':>18}{'MTP layer':>16}{'MTP activated':>16}"]
    for c in (*COMPONENTS, "sum"):
        row = [sum(p[col].values()) if c == "sum" else p[col][c] for col in cols]
        lines.append(f"  {c:<14}{row[0]:>18,}{row[1]:>18,}{row[2]:>16,}{row[3]:>16,}")
    bias = d["buffers"]["e_score_correction_bias"]
    lines.append(f"  (buffer e_score_correction_bias, not a parameter: main {bias['main']:,}, MTP {bias['mtp']:,})")
    lines += ["", f"{'convention':<52}{'total':>28}{'activated':>26}"]
    for name, text in CONVENTIONS.items():
        t, a = d[name]["total"], d[name]["activated"]
        lines.append(f"  {text:<50}{t:>19,} ={_si(t):>8}{a:>17,} ={_si(a):>8}")
    return lines + textwrap.wrap(d["report_note"], 104, initial_indent="  ", subsequent_indent="  ")


def _state_lines(s: dict) -> list[str]:
    index = "" if s["index_dtype"] == s["dtype"] and not s["index_scale_bytes"] else (
        f"; indexer keys {s['index_dtype']}, {s['index_bytes_per_value']} B/value"
        + (f" + a {s['index_scale_bytes']} B scale per token per layer" if s["index_scale_bytes"] else ""))
    lines = [f"state per token ({s['dtype']}, {s['bytes_per_value']} B/value{index}), context {s['context']:,}:"]
    for part, label in (("main", "main layers"), ("mtp", "MTP layer")):
        x = s[part]
        lines.append(f"  {label:<12}{x['attention_values']:>9,} attention + {x['indexer_values']:>7,} indexer values"
                     f" = {_bytes(x['bytes_per_token']):>11}/token, {_bytes(x['bytes_for_context']):>11} for the context")
        if x["window_values"]:
            lines.append(f"  {'':<12}+ sliding-window rings: {x['window_values']:,} values x {x['window_tokens']:,} "
                         f"tokens = {_bytes(x['window_bytes'])} per sequence, whatever the context")
        if x["recurrent_bytes"]:
            lines.append(f"  {'':<12}+ Gated DeltaNet states: {_bytes(x['recurrent_bytes'])} per sequence")
    return lines


def _flop_lines(f: dict) -> list[str]:
    modes = [m for m in ("prefill", "decode", "mtp_prefill", "mtp_decode") if m in f]
    unit, size = next((u, v) for u, v in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3), ("FLOP", 1))
                      if f["decode"]["total"] >= v or v == 1)
    lines = [f"{unit} per token at context {f['context']:,} (prefill: mean over a length-L prefill; "
             "decode: one new token; mtp_*: one MTP step):",
             f"  {'':<16}" + "".join(f"{m:>14}" for m in modes)]
    for term in (*FLOP_TERMS, "total"):
        lines.append(f"  {term:<16}" + "".join(f"{f[m][term] / size:>14.3f}" for m in modes))
    return lines


def render(d: dict) -> str:
    """The ledger dict (from `ledger`) as a readable text table."""
    head = [f"glm5lab ledger: {d['name']}" if d["name"] else "glm5lab ledger", ""]
    body = [*_param_lines(d), "", *_state_lines(d["state"]), "", *_flop_lines(d["flops_per_token"])]
    return "\n".join(head + body)
