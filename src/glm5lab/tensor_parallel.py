"""Serving accounts under tensor parallelism: bytes per GPU for the layout vLLM and SGLang serve GLM-5 with.

`tp_serve(cfg, gpus=G, tp=T, ep=E)` answers "what does each of G GPUs hold" when attention runs tensor-parallel
over T GPUs (G / T data-parallel replicas of it) and the MoE spans all G GPUs. Pure arithmetic on `ModelConfig`
(no torch), from the ledger's parameter counts (`glm5lab.ledger`, pinned to the model by `tests/test_ledger.py`).
Units: elements and bytes (GB = 1e9, GiB = 2**30 bytes). Derivation and the check against the published
GLM-5-FP8 TP=8 figure: `docs/ledger.md`, "Tensor-parallel serving".

The layout, as `vllm/model_executor/models/deepseek_v2.py` builds it (`TP_LAYOUT` is the printed table):

| part | per GPU |
|---|---|
| MLA q_b_proj, kv_b_proj (column-parallel), o_proj (row-parallel) | / tp, by head |
| MLA q_a_proj + kv_a_proj_with_mqa (one `MergedColumnParallelLinear(disable_tp=True)`), their norms, biases | whole |
| DSA indexer: wq_b, wk, weights_proj (`ReplicatedLinear`), k_norm | whole |
| dense MLP, shared experts (gate/up column-, down row-parallel) | / tp, by intermediate size |
| routed experts: split by expert over ep, by intermediate size over G / ep (moe-tp x ep = G) | / G |
| router (`ReplicatedLinear`), every RMSNorm, MTP eh_proj (`nn.Linear`) | whole |
| embedding (`VocabParallelEmbedding`), output head (`ParallelLMHead`) | vocab / tp rows, rounded up |

Routed experts: vLLM's FusedMoE spans all G = tp x dp GPUs: without expert parallelism it splits every expert's
intermediate size over G (TP flattened across DP); `--enable-expert-parallel` splits by expert over G (ep = G).
ep between those is expert groups of G / ep GPUs each splitting intermediate size. Either way a GPU holds
routed / G. Cache: MLA's latent is shared by every head, so each TP rank caches the whole latent (and indexer
key) of every sequence of its replica: `batch` is the replica's sequences. Padding of the vocabulary to a
multiple of 64, activations, CUDA graphs and runtime buffers are not counted; weights are `dtype` throughout
(the FP8 checkpoint's bf16 norms, router and embeddings and its block scales are not modelled).
"""

from __future__ import annotations

from glm5lab.config import ModelConfig
from glm5lab.deployment import param_split
from glm5lab.ledger import attention_params, attention_weights, block_params, indexer_params, mixer_kind, state
from glm5lab.parallel.alltoall import check_ep
from glm5lab.validate import dtype_bytes, dtype_name, int_at_least, refuse

HEAD_SPLIT = ("q_b_proj", "kv_b_proj", "o_proj")
"""The MLA matrices split by head over the TP ranks; the rest of the attention layer is replicated."""
TP_LAYOUT = {
    "attention_heads": "MLA q_b_proj, kv_b_proj, o_proj: split by head over tp",
    "attention_replicated": "MLA q_a_proj, kv_a_proj_with_mqa, their norms and biases: whole",
    "indexer": "DSA indexer (wq_b, wk, weights_proj, k_norm): whole",
    "dense_ffn": "dense MLP: split by intermediate size over tp",
    "shared_experts": "shared experts: split by intermediate size over tp",
    "routed_experts": "routed experts: by expert over ep, by intermediate size over G / ep",
    "router": "router: whole",
    "embedding": "embedding: vocab-parallel over tp",
    "output": "output head: vocab-parallel over tp",
    "norms": "block, final and MTP norms: whole",
    "eh_proj": "MTP eh_proj: whole",
}
"""Each part of the TP layout and how a GPU holds it (the printed rows, in order)."""


def check_tp(cfg: ModelConfig, *, gpus: int, tp: int, ep: int = 1, mode: str = "serve", flag: str = "") -> None:
    """Raise ValueError, `NAME = VALUE is not allowed: RULE`, for a TP layout `tp_serve` refuses: mode not "serve",
    tp or gpus not an int >= 1, gpus not a multiple of tp, tp not dividing the attention heads, a layer that is not
    MLA, ep refused by `check_ep` (not dividing gpus or the routed experts), intermediate sizes the split does not
    divide. `flag` prefixes the names ("--" for the command line)."""
    int_at_least(f"{flag}tp", tp, 1)
    if mode != "serve":
        refuse(f"{flag}tp", tp, f"only with {flag}mode serve (training shards with FSDP and {flag}ep)")
    H = cfg.num_attention_heads
    if H % tp:
        refuse(f"{flag}tp", tp, f"a divisor of the {H} attention heads (MLA splits by head)")
    int_at_least(f"{flag}gpus", gpus, 1)
    if gpus % tp:
        refuse(f"{flag}gpus", gpus, f"a multiple of {flag}tp = {tp} (G = data-parallel replicas x tp)")
    blocks = cfg.layers + ((cfg.mtp_layer,) if cfg.num_nextn_predict_layers else ())
    kinds = sorted({mixer_kind(spec) for spec in blocks} - {"mla"})
    if kinds:
        refuse(f"{flag}tp", tp, f"only for models whose every layer is MLA (this one has {', '.join(kinds)})")
    check_ep(ep, gpus, cfg, name=f"{flag}ep", world=f"{flag}gpus = {gpus} (G = ep x MoE tensor-parallel size)")
    if any(spec.mlp == "dense" for spec in blocks) and cfg.intermediate_size % tp:
        refuse(f"{flag}tp", tp, f"a divisor of intermediate_size = {cfg.intermediate_size} (the dense MLP's split)")
    if any(spec.mlp == "sparse" for spec in blocks):
        moe_tp = gpus // ep
        if cfg.moe_intermediate_size % tp or cfg.moe_intermediate_size % moe_tp:
            refuse(f"{flag}tp", tp, f"a layout whose tp = {tp} and {flag}gpus / {flag}ep = {moe_tp} divide "
                   f"moe_intermediate_size = {cfg.moe_intermediate_size}")


def tp_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of the model (main + MTP) by `TP_LAYOUT` part; they sum to `param_split(cfg)["total"]`."""
    out = dict.fromkeys(TP_LAYOUT, 0)
    blocks = cfg.layers + ((cfg.mtp_layer,) if cfg.num_nextn_predict_layers else ())
    for spec in blocks:
        heads = sum(n for k, n in attention_weights(cfg, "mla").items() if k in HEAD_SPLIT)
        out["attention_heads"] += heads
        out["attention_replicated"] += attention_params(cfg, "mla") - heads
        out["indexer"] += indexer_params(cfg) if spec.has_indexer_weights else 0
        c = block_params(cfg, spec)
        for k in ("dense_ffn", "shared_experts", "routed_experts", "router", "norms"):
            out[k] += c[k]
    out["embedding"] = cfg.vocab_size * cfg.hidden_size
    out["output"] = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    out["norms"] += cfg.hidden_size + (3 * cfg.hidden_size if cfg.num_nextn_predict_layers else 0)
    out["eh_proj"] = 2 * cfg.hidden_size**2 if cfg.num_nextn_predict_layers else 0
    return out


def tp_per_gpu_params(cfg: ModelConfig, *, gpus: int, tp: int) -> dict[str, int]:
    """Elements one GPU holds of each `TP_LAYOUT` part (see the module table), + "total"."""
    whole = tp_params(cfg)
    rows = -(-cfg.vocab_size // tp) * cfg.hidden_size
    split = {"attention_heads": whole["attention_heads"] // tp, "dense_ffn": whole["dense_ffn"] // tp,
             "shared_experts": whole["shared_experts"] // tp, "routed_experts": whole["routed_experts"] // gpus,
             "embedding": rows, "output": rows if whole["output"] else 0}
    held = {k: split.get(k, n) for k, n in whole.items()}
    return {**held, "total": sum(held.values())}


def tp_serve(cfg: ModelConfig, *, gpus: int, tp: int, ep: int = 1, dtype: str = "bf16",
             cache_dtype: str | None = None, context: int | None = None, batch: int = 1, name: str = "") -> dict:
    """The TP serving accounts as a JSON-serialisable dict.

    Keys: name, mode ("serve"), gpus, tp, ep, "replicas" (gpus / tp), "moe_tp" (gpus / ep), "layout" (`TP_LAYOUT`),
    "params" (`tp_params`), "per_gpu_params" (`tp_per_gpu_params`), "dtype", "bytes_per_value", "per_gpu_bytes"
    {"weights", "cache", "total", "mtp_cache"}: weights = per-GPU elements x bytes of `dtype`; cache = batch x the
    main layers' latent + indexer-key (+ any ring / recurrent) state for `context` tokens in `cache_dtype`, whole
    on every TP rank (`glm5lab.ledger.state`); "mtp_cache" the MTP layer's (a draft head only, not in "total");
    "cache" {"dtype", "context", "batch"}. cache_dtype: default `dtype`; context: default max_position_embeddings.
    Raises ValueError (`check_tp`; batch < 1; an unknown dtype; context outside 1..max_position_embeddings)."""
    check_tp(cfg, gpus=gpus, tp=tp, ep=ep)
    int_at_least("batch", batch, 1)
    dtype, cache_dtype = dtype_name(dtype), dtype_name(cache_dtype or dtype)
    held = tp_per_gpu_params(cfg, gpus=gpus, tp=tp)
    assert sum(tp_params(cfg).values()) == param_split(cfg)["total"]
    weights = held["total"] * dtype_bytes(dtype)
    s = state(cfg, dtype=cache_dtype, context=context)
    cache, mtp = (batch * s[part]["bytes_for_context"] for part in ("main", "mtp"))
    return {"name": name, "mode": "serve", "gpus": gpus, "tp": tp, "ep": ep, "replicas": gpus // tp,
            "moe_tp": gpus // ep, "layout": TP_LAYOUT, "params": tp_params(cfg), "per_gpu_params": held,
            "dtype": dtype, "bytes_per_value": dtype_bytes(dtype),
            "per_gpu_bytes": {"weights": weights, "cache": cache, "total": weights + cache, "mtp_cache": mtp},
            "cache": {"dtype": cache_dtype, "context": s["context"], "batch": batch}}


def _size(n: float) -> str:
    """GiB (GB), or MiB (MB) below 1 GiB (a tiny model's bytes would read 0.00 GiB)."""
    if n >= 2**30:
        return f"{n / 2**30:,.2f} GiB ({n / 1e9:,.2f} GB)"
    return f"{n / 2**20:,.2f} MiB ({n / 1e6:,.2f} MB)"


def render_tp(d: dict) -> str:
    """The `tp_serve` dict as readable lines: per part its elements per GPU (of the whole) and bytes, then the
    cache and the total per GPU (GiB and GB)."""
    p, b, n, c = d["per_gpu_params"], d["per_gpu_bytes"], d["bytes_per_value"], d["cache"]
    lines = [f"glm5lab ledger{' ' + d['name'] if d['name'] else ''}: serve on {d['gpus']} GPUs, tensor parallel "
             f"{d['tp']} ({d['replicas']} replica{'s' if d['replicas'] > 1 else ''} of attention), routed experts "
             f"over ep {d['ep']} x MoE tp {d['moe_tp']}",
             f"weights per GPU ({d['dtype']}, {n} B/value), elements held of each part (of the whole):"]
    for key, how in d["layout"].items():
        if d["params"][key]:
            lines.append(f"  {how:<68}{p[key]:>15,} of {d['params'][key]:>17,}{_size(p[key] * n):>28}")
    cache = (f"cache ({c['dtype']}, main layers, whole latent on every TP rank, batch {c['batch']} x context "
             f"{c['context']:,})")
    rows = [("weights", b["weights"]), (cache, b["cache"]), ("total per GPU", b["total"])]
    lines += [f"  {label:<102}{_size(v):>28}" for label, v in rows]
    lines.append(f"  (MTP layer cache, only as a draft head, not in the total: {_size(b['mtp_cache'])})")
    return "\n".join(lines)
