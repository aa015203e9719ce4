"""Activation bytes of one training step per GPU, from the config alone: what autograd saves for the backward.

`activations(cfg, seq_len=T, batch=B, ...)` counts, term by term, the tensors that a training forward of
`glm5lab.train.losses.task_losses` (all parameters trainable, MTP unrolled `mtp_depth` times, DSA on or off as
the stage says) leaves for the backward on one process: per decoder layer (by kind: MLA with an "own" indexer,
a "shared" one or none; dense MLP or MoE), the MTP layer (one entry per depth) and the head (embedding,
final norm, output head inputs, cross-entropy). Pure arithmetic on `ModelConfig` (no torch).

Units: bytes of one micro-batch's saved tensors (B sequences of T tokens), each distinct storage once.
Parameters that ops save by reference are not activations and are not counted (they are in the weights).
`tests/test_activations.py` measures the saved tensors of real CPU forwards of the tiny preset in fp32 and
bf16 (with and without MTP and DSA, both SDPA paths, odd shapes) with `torch.autograd.graph.saved_tensors_hooks`
and holds the totals to `TOLERANCE`; docs/ledger.md, "Activations", prints the table.

Where each term comes from (the op that saves it, per token unless said; N = tokens, A = N x top-k rows;
"model" = the model dtype, fp32 where said):
  RMSNorm(W)         its input in fp32 (W; the input itself in an fp32 model), rsqrt (1, fp32), the
                     normalised value (W, model) (`glm5lab.model.norm`)
  MLA projections    q_a / kv_a input h (D), q_b input q_lat (Q), o_proj input (H V) (`model/mla.py`); RoPE:
                     each `apply_rope` call's cos/sin cast to the model dtype (T R per call and forward, not per
                     row; in an fp32 model the angles themselves, once, in the head)
  attention routes   (`glm5lab.model.mla.attention_route`, uncached):
    expanded         (dense attention) kv_b input (C + R, the latent's storage); SDPA where q/k and v widths
                     are equal (CPU's fused kernel): q and k (H (N+R) each), v (H (N+V): a view of kv_b's
                     output), log-sum-exp (H, fp32) and out (o_proj's input); where they differ (the tiny
                     preset, 24 vs 16) torch's math fallback: q, k, v upcast to fp32 (v: H V, a view of H (N+V)
                     for one row in fp32) and the probabilities, H x T per query (fp32)
    latent_masked    DSA with T <= 4 x index_topk: q_nope (H (N+R): a view of q's storage) for the absorbed
                     query; SDPA over the latents in the model dtype: q (H X), out (H X), the latents (X per
                     key), the boolean mask cast to the model dtype (T per query row), lse (H, fp32)
    latent_gathered  DSA with T > 4 x index_topk (`attention_latent_gathered`): q_nope (H (N+R)); fp32: q (H X),
                     the gathered latents (K X), out (H X), lse (H), mask (K); the rows (K, int64), o (H C) for
                     W_uv
  indexer            an "own" layer with the sparse-stage KL (`MLAttention.indexer_kl_sparse`), fp32: rows (K
                     int64), q (I J), gathered keys (K J), head weights (I), ReLU(dots) (I K), k_norm's input,
                     mean and rstd (J + 2), KL terms (2 K fp32, 2 K bool), weights_proj's fp32 copy of its
                     input (D, a low-precision model only)
  dense MLP          input (D), gate and up outputs, SiLU output, product (4 x intermediate)
  MoE                router input (D, saved by the shared expert; its fp32 copy in a low-precision model), scores
                     (E, fp32), top-k ids (E int64: a slice of the sorted order's storage), weights (k + 1,
                     fp32); dispatch per row: order and token (2 int64), expert output (D) and its weight (1,
                     fp32), weighted output (D), row slot (int64); grouped experts (`experts_grouped`) per tile
                     of 64 rows: the tile's rows (64 D), the three gathered expert matrices (3 D I:
                     `index_select` copies, saved by `bmm`), gate, up, SiLU and product outputs (4 x 64 I);
                     shared expert 4 x I_shared
  MTP depth j        (L = T - j tokens) enorm (its input: the embedding's output), hnorm (in an fp32 model its
                     input is counted at the output head), eh_proj input (2 D), the block, shared_head.norm
  head               the packed window's ids (T + 1 per row, int64), final norm, output head inputs (D per main
                     and per MTP token), cross-entropy: log-softmax (vocab, fp32) and labels (int64; views of
                     the window when B = 1) per scored token and a scalar per loss

With activation checkpointing (`glm5lab.parallel.activation_checkpoint`: every main block and every MTP call),
each block keeps its input (D per token; an MTP depth the next tokens' embeddings: its other input, h^(j-1),
is kept as the output head's input anyway) and the backward recomputes one block at a time: the step holds
the head, every block's inputs and the largest block's saved tensors ("recompute_peak").

Context parallelism (`cp`): each rank holds T / cp tokens (the queries' activations scale by 1 / cp) and
the latents of all T keys gathered per MLA layer, (C + R) values per key, plus J per key for the indexer on
an "own" layer (`cp_gather_bytes` gives the all-gather traffic, which tests/model/test_context_parallel.py
measures equal to `ContextParallel.gathered_bytes`); the dense route's per-head K/V are expanded from them for
all T keys (cp per local token), and kv_b_proj's input is the gathered latents. `tests/model/test_cp_activations.py`
measures a CP rank's saved tensors (cp 2, tiny preset: dense, DSA's masked and gathered routes) against the
formula. Expert parallelism (`ep`): the MoE's
rows per rank are the N x k assignments spread over ep ranks; balanced routing is assumed (every expert
receives N x k / E rows), so a rank holds N x k rows of E / ep experts, with the one-process dispatcher's
saved tensors (the all-to-all dispatcher's are not measured).
Not counted: autograd metadata, the allocator's fragmentation, communication buffers, FSDP's unsharded
weights; GPU kernels may save other tensors than the CPU kernels measured.
"""

from __future__ import annotations

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.validate import dtype_bytes, int_at_least, refuse

FP32, INT64, BOOL = 4, 8, 1
EXPERT_TILE = 64
"""Rows per tile of `glm5lab.model.moe.experts_grouped` (its `tile` default)."""
GATHER_MIN_KEYS_PER_TOPK = 4
"""`glm5lab.model.mla.GATHER_MIN_KEYS_PER_TOPK`, restated here (the ledger imports no torch; a test ties them)."""
DECODE_MAX_TOKENS = 16
"""`glm5lab.model.step.DECODE_MAX_TOKENS`: forwards of at most 16 tokens a row run the decode kernels (latent
attention, `_grouped_mm` experts), whose saved tensors are not modelled."""
TOLERANCE = 0.05
"""|formula / measured - 1| that `tests/test_activations.py` allows on every measured total (tiny preset,
fp32 and bf16; every block but the MoE is exact): the routing of a random model is not balanced, so the MoE's
tile count differs from the balanced one by a tile or two per layer (observed: at most 2.8%, one tile short in
one layer at 37 x 1)."""


def _norm(width: int, nbytes: int, *, input_counted: bool = False) -> int:
    """Bytes per token that RMSNorm(width) saves: its input in fp32 (unless counted elsewhere), rsqrt,
    the normalised value in the model dtype."""
    return (0 if input_counted else width * FP32) + FP32 + width * nbytes


def attention_route(cfg: ModelConfig, spec: LayerSpec, T: int, *, use_dsa: bool) -> str:
    """The route of an uncached training call of T keys (`glm5lab.model.mla.attention_route`): "expanded"
    (dense), "latent_masked" (DSA, T <= 4 x index_topk) or "latent_gathered" (DSA, longer)."""
    if not (use_dsa and cfg.use_dsa and spec.indexer != "none" and T > cfg.index_topk):
        return "expanded"
    return "latent_gathered" if T > GATHER_MIN_KEYS_PER_TOPK * cfg.index_topk else "latent_masked"


def mla_bytes(cfg: ModelConfig, spec: LayerSpec, T: int, *, dtype: str, use_dsa: bool, indexer_loss: bool,
              cp: int = 1, batch: int = 2) -> dict[str, float]:
    """Bytes per local token of one MLA attention sub-block (norms inside it, projections, the route's core
    attention, the indexer's KL) for rows of T keys (the queries are T / cp of them). Keys: "attention",
    "indexer", "cp_gathered" (bytes per local token of the gathered latents: cp x (C + R), + J on an "own"
    layer when DSA runs). batch: rows per micro-batch (one row's SDPA math fallback saves a view, not a copy)."""
    nb = dtype_bytes(dtype)
    D, Q, C, R, H = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    N, V, X, K = cfg.qk_nope_head_dim, cfg.v_head_dim, C + R, cfg.index_topk
    kv_in = X * FP32 if nb == FP32 else C * FP32  # kv_a_layernorm's fp32 input: the [c | k_pe] storage in fp32
    a = _norm(Q, nb) + kv_in + FP32 + C * nb + (D + Q + H * V) * nb
    route = attention_route(cfg, spec, T, use_dsa=use_dsa)
    # expanded K/V are per key: under CP each rank expands all T gathered keys (cp per local token), and kv_b_proj
    # reads the gathered latents (their storage is "cp_gathered"), not the local ones
    kv_b_in = X * nb if cp == 1 else 0
    if route == "expanded" and N + R != V:  # CPU's math fallback: q, k, v upcast to fp32 and the probabilities;
        v = H * (N + V) if batch == 1 and nb == FP32 else H * V  # one row's v is a view of kv_b_proj's output
        a += kv_b_in + (H * (N + R) + cp * (H * (N + R) + v) + H * T) * FP32
    elif route == "expanded":  # the fused kernel: q, k, v (a view of kv_b_proj's output), lse in fp32, and out,
        a += kv_b_in + (H * (N + R) + cp * (H * (N + R) + H * (N + V))) * nb + H * FP32  # out: o_proj's input
    elif route == "latent_masked":  # SDPA in the model dtype over the latents, its boolean mask cast to it
        a += H * (N + R) * nb + (2 * H * X + X + T) * nb + H * FP32
    else:
        a += H * (N + R) * nb + 2 * H * X * FP32 + K * X * FP32 + H * FP32 + K * (FP32 + INT64) + H * C * nb
    runs = route != "expanded" and spec.indexer == "own"
    I, J = cfg.index_n_heads, cfg.index_head_dim
    idx = 0.0
    if runs and indexer_loss:  # + weights_proj's fp32 copy of its input (FP32Linear) in a low-precision model
        idx = K * INT64 + (I * J + K * J + I + I * K + J + 2) * FP32 + 2 * K * (FP32 + BOOL)
        idx += D * FP32 if nb != FP32 else 0
    gathered = (cp * X * nb + (cp * J * nb if runs else 0)) if cp > 1 else 0
    return {"attention": a, "indexer": idx, "cp_gathered": gathered}


def mlp_bytes(cfg: ModelConfig, spec: LayerSpec, tokens: int, *, dtype: str, ep: int = 1) -> float:
    """Bytes of one FFN sub-block for `tokens` local tokens: dense MLP, or MoE (router, dispatch, grouped
    experts at balanced routing over `ep` ranks, shared expert)."""
    nb, D = dtype_bytes(dtype), cfg.hidden_size
    if spec.mlp == "dense":
        return tokens * (D + 4 * cfg.intermediate_size) * nb
    E, k, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    # the router's input: its fp32 copy in a low-precision model; the model-dtype one saved by the shared expert
    router = (D * nb if nb == FP32 or cfg.n_shared_experts else 0) + (D * FP32 if nb != FP32 else 0)
    router += E * FP32 + E * INT64 + (k + 1) * FP32
    shared = 4 * I * cfg.n_shared_experts * nb
    rows = tokens * k  # balanced: a rank sends N k rows and receives N k rows of its E / ep experts
    per_expert = rows * ep / E
    tiles = (E // ep) * -(-per_expert // EXPERT_TILE) if per_expert else 0
    dispatch = rows * (3 * INT64 + 2 * D * nb + FP32)
    experts = tiles * (EXPERT_TILE * D * nb + 3 * D * I * nb + 4 * EXPERT_TILE * I * nb) + E // ep * INT64
    return tokens * (router + shared) + dispatch + experts


def block_bytes(cfg: ModelConfig, spec: LayerSpec, T: int, batch: int, *, dtype: str, use_dsa: bool,
                indexer_loss: bool, cp: int = 1, ep: int = 1) -> dict[str, float]:
    """Bytes one decoder block saves for `batch` rows of T tokens (T / cp local): "attention", "indexer",
    "ffn", "norms" (input and post-attention RMSNorms), "cp_gathered", "total"."""
    if spec.mixer != "attention" or spec.attention != "mla":
        refuse("layer type", spec.mixer if spec.mixer != "attention" else spec.attention,
               "MLA attention layers only (activation bytes of GQA, SWA and Gated DeltaNet are not modelled)")
    nb, n = dtype_bytes(dtype), batch * T // cp
    m = mla_bytes(cfg, spec, T, dtype=dtype, use_dsa=use_dsa, indexer_loss=indexer_loss, cp=cp, batch=batch)
    # RoPE: in a low-precision model each apply_rope saves its own cos/sin cast ([T, R/2] each, per forward, not per
    # row): q_pe and k_pe, and the KL's indexer keys and queries on an "own" layer (fp32: the angles, in the head)
    calls = 2 + (2 if m["indexer"] else 0)
    rope = calls * (T // cp) * cfg.qk_rope_head_dim * nb if nb != FP32 else 0
    out = {"attention": n * m["attention"] + rope, "indexer": n * m["indexer"],
           "ffn": mlp_bytes(cfg, spec, n, dtype=dtype, ep=ep), "norms": n * 2 * _norm(cfg.hidden_size, nb),
           "cp_gathered": n * m["cp_gathered"]}
    return {**out, "total": sum(out.values())}


def activations(cfg: ModelConfig, *, seq_len: int, batch: int, dtype: str = "bf16", use_dsa: bool = True,
                indexer_loss: bool = True, mtp_depth: int | None = None, checkpointing: bool = False, cp: int = 1,
                ep: int = 1) -> dict:
    """Activation bytes of one training micro-batch per GPU (module docstring: the terms and their sources).

    seq_len T tokens per sequence, `batch` sequences per micro-batch; dtype: the model's; use_dsa /
    indexer_loss: the stage's (DSA selection on; the sparse-stage indexer KL); mtp_depth: MTP depths unrolled
    (default 3 when the model has an MTP layer, as `Stage.mtp_depth`); checkpointing: activation checkpointing
    per block; cp: context-parallel ranks (T divisible by cp); ep: expert-parallel ranks. Returns {"layers":
    [{"index", "kind", bytes by part, "total"}], "mtp": [one per depth], "head", "blocks", "block_inputs",
    "recompute_peak", "total", settings}. Raises ValueError for bad sizes or an unmodelled layer type."""
    T, B = int_at_least("seq_len", seq_len, 1), int_at_least("batch", batch, 1)
    int_at_least("cp", cp, 1)
    int_at_least("ep", ep, 1)
    if T % cp:
        refuse("seq_len", T, f"a multiple of cp = {cp} (each rank holds seq_len / cp tokens)")
    nb, D, n = dtype_bytes(dtype), cfg.hidden_size, B * T // cp
    depth = (3 if cfg.num_nextn_predict_layers else 0) if mtp_depth is None else mtp_depth
    depth = min(depth, T - 1) if cfg.num_nextn_predict_layers else 0
    if T - depth <= DECODE_MAX_TOKENS:
        refuse("seq_len", T, f"more than {DECODE_MAX_TOKENS + depth} (forwards of at most {DECODE_MAX_TOKENS} tokens "
               f"a row, the last of {depth} MTP depths included, run the decode kernels, which are not modelled)")
    kw = dict(dtype=dtype, use_dsa=use_dsa, indexer_loss=indexer_loss, cp=cp, ep=ep)
    layers = [{"index": s.index, "kind": layer_kind(s), **block_bytes(cfg, s, T, B, **kw)} for s in cfg.layers]
    mtp = []
    for j in range(1, depth + 1):
        L = T - j
        blk = block_bytes(cfg, cfg.mtp_layer, L, B, **kw)
        m = B * L // cp
        # enorm, hnorm (its input in fp32 is h^(j-1), counted at the output head), eh_proj input, shared_head.norm
        extra = m * (2 * _norm(D, nb) + _norm(D, nb, input_counted=nb == FP32) + 2 * D * nb)
        mtp.append({"depth": j, "kind": layer_kind(cfg.mtp_layer), **blk, "mtp_extra": extra,
                    "total": blk["total"] + extra})
    scored = n + sum(B * (T - j) // cp for j in range(1, depth + 1))
    labels = INT64 if B > 1 else 0  # a one-row batch's shifted labels are views of the window (no copy)
    head = (B * (T + 1) // cp * INT64 + n * _norm(D, nb) + scored * (D * nb + cfg.vocab_size * FP32 + labels)
            + (1 + depth) * FP32 + (T // cp * cfg.qk_rope_head_dim * FP32 if nb == FP32 else 0))
    blocks = [x["total"] for x in layers + mtp]
    # checkpointing keeps each block's input; an MTP depth's other input, h^(j-1), is the output head's
    inputs = n * D * nb * len(layers) + sum(B * (T - j) // cp * D * nb for j in range(1, depth + 1))
    peak = max(blocks, default=0)
    total = head + (inputs + peak if checkpointing else sum(blocks))
    return {"seq_len": T, "batch": B, "dtype": dtype, "use_dsa": use_dsa, "indexer_loss": indexer_loss,
            "mtp_depth": depth, "checkpointing": checkpointing, "cp": cp, "ep": ep, "layers": layers, "mtp": mtp,
            "head": head, "blocks": sum(blocks), "block_inputs": inputs, "recompute_peak": peak, "total": total}


def layer_kind(spec: LayerSpec) -> str:
    """A block's kind as the activation table names it, e.g. "mla+own/moe", "mla+shared/dense"."""
    return f"{spec.attention}+{spec.indexer}/{'moe' if spec.mlp == 'sparse' else 'dense'}"


def cp_gather_bytes(cfg: ModelConfig, cp: int, *, dtype: str = "bf16") -> dict[str, float]:
    """All-gather bytes per token per MLA layer that context parallelism moves, forward: each rank receives
    the (cp - 1) / cp of the sequence it does not hold, (C + R) latent values plus J indexer-key values per
    token ("own" layers only), at `dtype` bytes: bytes received per rank per token of the whole sequence
    (the convention of `cp_gather`: a rank's traffic in, divided by the sequence's tokens). The backward's
    reduce-scatter of the key gradients moves the same amount again."""
    int_at_least("cp", cp, 1)
    nb, frac = dtype_bytes(dtype), (cp - 1) / cp
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * nb * frac
    index = cfg.index_head_dim * nb * frac
    return {"latent": latent, "indexer_keys": index, "total": latent + index}
