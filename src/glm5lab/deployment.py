"""Deployment accounts: bytes per GPU for training or serving with expert parallelism, from the config alone.

`deployment` answers "what does each of G GPUs hold" for a model whose routed experts are sharded by
expert over an EP group of `ep` ranks, under one stated sharding model per mode (`SHARDING`), plus the
all-to-all bytes per token (`glm5lab.parallel.alltoall`). Pure arithmetic on `ModelConfig` (no torch); the
parameter counts are the ledger's (`glm5lab.ledger`, pinned to the model by `tests/test_ledger.py`).
Formulas, assumptions and the check against the published GLM-5-FP8 8 x H200 deployment: `docs/ledger.md`,
"Deployment accounts". Units: elements and bytes (GB = 1e9, GiB = 2**30 bytes).

Optimizer state follows the kinds of `glm5lab.optim.groups.RULES` (torch-free, from component counts,
`optimizer_kinds`): Muon keeps one fp32 momentum buffer per parameter, AdamW two (exp_avg, exp_avg_sq).
"""

from __future__ import annotations

from glm5lab.activations import activations, cp_gather_bytes
from glm5lab.parallel.alltoall import a2a_per_token, check_ep
from glm5lab.parallel.cp_layout import DEFAULT_LAYOUT, check_split
from glm5lab.config import ModelConfig
from glm5lab.ledger import (attention_params, attention_weights, indexer_params, indexer_weights, main_params,
                            mixer_kind, mtp_params, state)
from glm5lab.validate import dtype_bytes, dtype_name, int_at_least, one_of, refuse

MODES = ("train", "serve")
SHARDING = {
    "train": "FSDP over all G GPUs for every non-expert parameter; routed experts split by expert over the EP "
             "group, then FSDP over the G / ep data replicas: every parameter / G",
    "serve": "routed experts split by expert over the EP group (G / ep copies of the expert set); every other "
             "parameter replicated on each GPU (data-parallel attention); each GPU caches its own batch",
}
"""The sharding model of each mode, as printed and written into the JSON."""
FP32 = 4


def param_split(cfg: ModelConfig) -> dict[str, int]:
    """Parameters the model holds (main + MTP), {"routed_experts", "non_expert", "total"}."""
    main, mtp = main_params(cfg), mtp_params(cfg)
    total = sum(main.values()) + sum(mtp.values())
    routed = main["routed_experts"] + mtp["routed_experts"]
    return {"routed_experts": routed, "non_expert": total - routed, "total": total}


def per_gpu_params(cfg: ModelConfig, *, mode: str, gpus: int, ep: int) -> dict[str, int]:
    """Elements one GPU holds, {"routed_experts", "non_expert", "total"}: "train" every class / gpus,
    rounded up (FSDP padding ignored); "serve" routed experts / ep and every other parameter whole."""
    split = param_split(cfg)
    if mode == "train":
        held = {k: _ceil(split[k], gpus) for k in ("routed_experts", "non_expert")}
    else:
        held = {"routed_experts": split["routed_experts"] // ep, "non_expert": split["non_expert"]}
    return {**held, "total": sum(held.values())}


def payload_dtype(dtype: str) -> str:
    """The all-to-all payload (activation) dtype for weights in `dtype`: bf16 for fp8 weights (they
    compute in bf16; an fp8 dispatch, as DeepEP offers, would halve dispatch bytes), else `dtype`."""
    return "bf16" if dtype_name(dtype) == "fp8" else dtype_name(dtype)


def optimizer_kinds(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of each optimizer kind under "muon" / "muon-split" (`glm5lab.optim.groups.RULES`),
    main + MTP: "adamw" = embedding, output head, every norm (block, final, MTP, MLA q_a / kv_a,
    q_norm / k_norm, the indexer's k_norm LayerNorm), every bias, and Gated DeltaNet's per-head
    gates and conv (a_proj, b_proj, conv1d, A_log, dt_bias, b_bias, gated norm); "muon" = the rest
    (every other matrix, router, indexer, routed and shared experts, eh_proj)."""
    main, mtp = main_params(cfg), mtp_params(cfg)
    adamw = main["embedding"] + main["output"] + main["norms"] + mtp["norms"]
    blocks = cfg.layers + ((cfg.mtp_layer,) if cfg.num_nextn_predict_layers else ())
    for spec in blocks:
        kind = mixer_kind(spec)
        weights = attention_weights(cfg, kind)
        adamw += attention_params(cfg, kind) - sum(weights.values())  # inner norms, biases, GDN state params
        adamw += weights.get("a_proj", 0) + weights.get("b_proj", 0)  # GDN per-head gates: AdamW in RULES
        adamw += indexer_params(cfg) - indexer_weights(cfg) if spec.has_indexer_weights else 0
    total = param_split(cfg)["total"]
    return {"muon": total - adamw, "adamw": adamw}


def check_layout(cfg: ModelConfig, *, gpus: int, ep: int, mode: str, dtype: str = "bf16", batch: int = 1,
                 flag: str = "") -> None:
    """Raise ValueError, `NAME = VALUE is not allowed: RULE`, for a layout `deployment` refuses: gpus or
    ep or batch not an int >= 1, an ep `check_ep` refuses (gpus % ep != 0, n_routed_experts % ep != 0, ep > 1
    without MoE layers), mode not in MODES, an
    unknown dtype, fp8 with mode "train". `flag` prefixes the names ("--" for the command line)."""
    int_at_least(f"{flag}gpus", gpus, 1)
    check_ep(ep, gpus, cfg, name=f"{flag}ep", world=f"{flag}gpus = {gpus} (G = data replicas x ep)")
    one_of(f"{flag}mode", mode, MODES)
    dtype_name(dtype)
    if mode == "train" and dtype_name(dtype) == "fp8":
        refuse(f"{flag}dtype", dtype, "fp32, bf16 or fp16 with mode train (fp8 training is not modelled)")
    int_at_least(f"{flag}batch", batch, 1)


def train_bytes(cfg: ModelConfig, gpus: int, dtype: str) -> dict[str, int]:
    """Bytes per GPU in training (`SHARDING["train"]`: `per_gpu_params`, every parameter / G): weights
    and gradients in `dtype`; fp32 master weights (none when dtype is fp32: the weights are the master);
    optimizer state 4 B per Muon-kind and 8 B per AdamW-kind parameter / G (`optimizer_kinds`).
    Activations are added by `with_activations`; buffers and communication scratch are not counted."""
    per_gpu = per_gpu_params(cfg, mode="train", gpus=gpus, ep=1)["total"]
    kinds, nbytes = optimizer_kinds(cfg), dtype_bytes(dtype)
    out = {"weights": per_gpu * nbytes, "gradients": per_gpu * nbytes,
           "master_weights": 0 if nbytes == FP32 else per_gpu * FP32,
           "optimizer_state": _ceil(kinds["muon"], gpus) * FP32 + _ceil(kinds["adamw"], gpus) * 2 * FP32}
    return {**out, "total": sum(out.values())}


def serve_bytes(cfg: ModelConfig, ep: int, dtype: str, cache_dtype: str, context: int | None,
                batch: int) -> dict[str, int]:
    """Bytes per GPU in serving (`SHARDING["serve"]`): weights = (routed experts / ep + every other
    parameter) in `dtype`; cache = batch x the main layers' state for `context` tokens in `cache_dtype`
    (`glm5lab.ledger.state`'s bytes_for_context: latent + indexer-key bytes per token x context, plus
    sliding-window rings and Gated DeltaNet states); "mtp_cache": the MTP layer's, used only as a draft
    head, not in "total". Activations, CUDA graphs and runtime buffers are not counted."""
    weights = per_gpu_params(cfg, mode="serve", gpus=ep, ep=ep)["total"] * dtype_bytes(dtype)
    s = state(cfg, dtype=cache_dtype, context=context)
    cache, mtp = (batch * s[part]["bytes_for_context"] for part in ("main", "mtp"))
    return {"weights": weights, "cache": cache, "total": weights + cache, "mtp_cache": mtp}


def deployment(cfg: ModelConfig, *, gpus: int, ep: int, mode: str, dtype: str = "bf16",
               cache_dtype: str | None = None, context: int | None = None, batch: int = 1, name: str = "") -> dict:
    """The deployment accounts as a JSON-serialisable dict.

    Keys: name, mode, gpus, ep, "sharding" (`SHARDING[mode]`), "experts_per_ep_rank", "dtype" and
    "bytes_per_value" (weights), "params" (`param_split`), "optimizer_kinds", "per_gpu_params"
    (`per_gpu_params`), "per_gpu_bytes" (`train_bytes` or `serve_bytes`), "a2a": forward all-to-all
    bytes per token per MoE layer ("dispatch", "combine": `glm5lab.parallel.alltoall.a2a_per_token`, uniform
    routing, in `payload_dtype(dtype)`), "moe_layers" (main layers; the MTP layer adds one when it
    runs), "forward_per_token" over them and, in training, "forward_backward_per_token"; serve only:
    "cache" {"dtype", "context", "batch"}. cache_dtype: default `dtype`; context: default
    max_position_embeddings. Raises ValueError (`check_layout`; a context outside
    1..max_position_embeddings)."""
    check_layout(cfg, gpus=gpus, ep=ep, mode=mode, dtype=dtype, batch=batch)
    dtype = dtype_name(dtype)
    cache_dtype = dtype_name(cache_dtype or dtype)
    nbytes = (train_bytes(cfg, gpus, dtype) if mode == "train"
              else serve_bytes(cfg, ep, dtype, cache_dtype, context, batch))
    out = {"name": name, "mode": mode, "gpus": gpus, "ep": ep, "sharding": SHARDING[mode],
           "experts_per_ep_rank": cfg.n_routed_experts // ep, "dtype": dtype, "bytes_per_value": dtype_bytes(dtype),
           "params": param_split(cfg), "optimizer_kinds": optimizer_kinds(cfg),
           "per_gpu_params": per_gpu_params(cfg, mode=mode, gpus=gpus, ep=ep), "per_gpu_bytes": nbytes,
           "a2a": _a2a(cfg, ep, payload_dtype(dtype), backward=mode == "train")}
    if mode == "serve":
        out["cache"] = {"dtype": cache_dtype, "context": state(cfg, context=context)["context"], "batch": batch}
    return out


def check_cp(cp: int, *, gpus: int, ep: int, seq_len: int, flag: str = "", layout: str = DEFAULT_LAYOUT) -> None:
    """Raise ValueError for a context-parallel size the training layout cannot hold: cp not an int >= 1, cp x ep
    not dividing the GPUs (G = data replicas x cp x ep), or a sequence length `glm5lab train --cp` would refuse
    under `layout` (`cp_layout.check_split`: head_tail, the default, needs a multiple of 2 cp, the others of cp)."""
    int_at_least(f"{flag}cp", cp, 1)
    if (gpus // ep) % cp:
        refuse(f"{flag}cp", cp, f"a divisor of {flag}gpus / {flag}ep = {gpus} / {ep} = {gpus // ep} (G = data replicas "
               "x cp x ep)")
    check_split(seq_len, cp, layout)


def with_activations(d: dict, cfg: ModelConfig, *, seq_len: int, micro_batch: int = 1, checkpointing: bool = False,
                     cp: int = 1, flag: str = "", layout: str = DEFAULT_LAYOUT) -> dict:
    """The train accounts `d` (from `deployment`) with a step's activation bytes per GPU
    (`glm5lab.activations.activations` at d's dtype and ep: a DSA stage with its indexer KL when the model has
    DSA, MTP at 3 depths when it has an MTP layer) as "activations" (the per-layer figures, the settings, "total"),
    "total_with_activations" (d's per-GPU total + activations) and, with cp > 1, "cp_gather" (`cp_gather_bytes`).
    Raises ValueError (`check_cp`; a sequence or layer type `activations` refuses), naming `flag`-prefixed flags."""
    int_at_least(f"{flag}seq-len", seq_len, 1)
    int_at_least(f"{flag}micro-batch", micro_batch, 1)
    check_cp(cp, gpus=d["gpus"], ep=d["ep"], seq_len=seq_len, flag=flag, layout=layout)
    try:
        a = activations(cfg, seq_len=seq_len, batch=micro_batch, dtype=d["dtype"], use_dsa=cfg.use_dsa,
                        indexer_loss=cfg.use_dsa, checkpointing=checkpointing, cp=cp, ep=d["ep"])
    except ValueError as e:
        raise ValueError(str(e).replace("seq_len = ", f"{flag}seq-len = ", 1)) from None
    out = {**d, "activations": a, "total_with_activations": d["per_gpu_bytes"]["total"] + a["total"]}
    if cp > 1:
        out["cp_gather"] = {**cp_gather_bytes(cfg, cp, dtype=d["dtype"]), "cp": cp}
    return out


def _activation_lines(d: dict) -> list[str]:
    """The activation lines of `render_deployment` (train accounts `with_activations`)."""
    a = d["activations"]
    dsa = "a DSA sparse stage with its indexer KL" if a["use_dsa"] else "dense attention"
    lines = [f"activations per GPU ({a['dtype']} model, micro-batch {a['batch']} x {a['seq_len']:,} tokens, "
             f"{a['seq_len'] // a['cp']:,} on each of cp {a['cp']} ranks; {dsa}, MTP {a['mtp_depth']} depths; balanced "
             f"routing over ep {a['ep']}; activation checkpointing {'on' if a['checkpointing'] else 'off'}):"]
    rows = []
    kinds: dict[str, list[float]] = {}
    for layer in a["layers"]:
        kinds.setdefault(layer["kind"], []).append(layer["total"])
    rows += [(f"{len(sizes)} x {kind} layer, each", max(sizes)) for kind, sizes in kinds.items()]
    if a["mtp"]:
        rows.append((f"MTP layer ({a['mtp'][0]['kind']}), {len(a['mtp'])} depths", sum(m["total"] for m in a["mtp"])))
    rows.append(("head (embedding ids, final norm, output head, cross-entropy)", a["head"]))
    if a["checkpointing"]:
        rows += [("kept with checkpointing: every block's input", a["block_inputs"]),
                 ("+ the largest block, recomputed in the backward", a["recompute_peak"])]
    rows += [("activations", a["total"]),
             ("total per GPU (weights, gradients, master, optimizer state, activations)",
              d["total_with_activations"])]
    lines += [f"  {label:<76}{_amount(n):>28}" for label, n in rows]
    if "cp_gather" in d:
        g = d["cp_gather"]
        lines.append(f"context-parallel all-gather per token of the sequence per MLA layer (bytes a rank receives, "
                     f"(cp - 1) / cp of it, forward): latent {g['latent']:,.0f} B + indexer keys "
                     f"{g['indexer_keys']:,.0f} B (layers with their own indexer) = {g['total']:,.0f} B; the "
                     "backward's reduce-scatter as much")
    return lines


def _a2a(cfg: ModelConfig, ep: int, dtype: str, *, backward: bool) -> dict:
    """`a2a_per_token` + the MoE layer count and the per-token sums over the main MoE layers."""
    per_layer = a2a_per_token(cfg, ep=ep, dtype=dtype)
    layers = sum(spec.mlp == "sparse" for spec in cfg.layers)
    forward = layers * (per_layer["dispatch"] + per_layer["combine"])
    out = {**per_layer, "moe_layers": layers, "forward_per_token": forward}
    return {**out, "forward_backward_per_token": 2 * forward} if backward else out


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _size(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB ({n / 1e9:,.2f} GB)"


def _amount(n: float) -> str:
    """`_size`, or MiB (MB) below 1 GiB (a tiny model's activations would read 0.00 GiB)."""
    return _size(n) if n >= 2**30 else f"{n / 2**20:,.2f} MiB ({n / 1e6:,.2f} MB)"


def _labels(d: dict) -> dict[str, str]:
    """The printed name of each `per_gpu_bytes` entry."""
    kinds, c = d["optimizer_kinds"], d.get("cache", {})
    return {"weights": f"weights ({d['dtype']}, {d['bytes_per_value']} B/value)",
            "gradients": f"gradients ({d['dtype']})", "master_weights": "master weights (fp32)",
            "optimizer_state": f"optimizer state (fp32; Muon 1 x {kinds['muon']:,}, AdamW 2 x {kinds['adamw']:,})",
            "cache": f"cache ({c.get('dtype')}, main layers, batch {c.get('batch')} x context {c.get('context', 0):,})",
            "total": "total"}


def render_deployment(d: dict) -> str:
    """The `deployment` dict as readable lines (bytes in GiB and GB)."""
    p, b, a = d["per_gpu_params"], d["per_gpu_bytes"], d["a2a"]
    lines = [f"glm5lab ledger{' ' + d['name'] if d['name'] else ''}: {d['mode']} on {d['gpus']} GPUs, expert "
             f"parallel {d['ep']} ({d['experts_per_ep_rank']} routed experts per EP rank per MoE layer)",
             f"sharding: {d['sharding']}",
             f"parameters per GPU: routed experts {p['routed_experts']:,} + the rest {p['non_expert']:,}"
             f" = {p['total']:,} (of {d['params']['total']:,})", "bytes per GPU:"]
    lines += [f"  {label:<76}{_size(b[key]):>28}" for key, label in _labels(d).items() if key in b]
    if "mtp_cache" in b:
        lines.append(f"  (MTP layer cache, only as a draft head, not in the total: {_size(b['mtp_cache'])})")
    backward = a.get("forward_backward_per_token")
    lines.append(f"all-to-all per token per MoE layer ({a['dtype']} payload, uniform routing, forward): dispatch "
                 f"{a['dispatch']:,.0f} B + combine {a['combine']:,.0f} B; x {a['moe_layers']} MoE layers = "
                 f"{a['forward_per_token'] / 1e6:,.3f} MB per token"
                 + (f", {backward / 1e6:,.3f} MB with backward" if backward is not None else ""))
    if "activations" in d:
        lines += _activation_lines(d)
    return "\n".join(lines)
