"""The byte model of MTP speculative decoding: the bytes a plain decode step and a speculative round read, from
a `ModelConfig` alone, the seconds they take on a host, and the speedup that predicts.

Legend: B rows, L cached tokens per row (the context), k drafts per round, E routed experts, K experts per
token, n tokens in one forward (all rows), D hidden, V vocab.

Decoding is memory bound: a forward costs the bytes it must read at least, over the host's bandwidth, plus a
fixed per-forward overhead (launches, dispatch, host work), t = bytes / bandwidth + forwards x overhead
(an MTP-layer forward may be given its own overhead: one layer where the main model has many).

What one forward of T tokens per row reads (`forward_bytes`):
- weights, once per forward: every dense part (attention, the indexers that run, dense FFNs, shared experts,
  routers, norms; the MTP layer's eh_proj), the expected distinct routed experts the n = B x T tokens touch
  per MoE layer, E (1 - (1 - K/E)^n) (K uniform choices per token, independent), n rows of the embedding, and
  the output head (V x D) when the forward makes logits;
- the cache, per row: a dense layer reads all L cached latents once (the T queries share them); a layer that
  selects keys (DSA: "own"/"shared" indexer roles when `use_dsa`) reads min(L, index_topk) latents per query
  (each query gathers its own top-k), and an "own" layer reads all L index keys once; a sliding-window layer
  min(L, window) keys once; a Gated DeltaNet layer its fixed state (`ledger.recurrent_state_bytes`) once
  per forward, whatever L.

A plain step (`plain_step`) is one forward of T = 1 with logits. A round of k drafts (`speculative_round`) is
the verification (`verification`: one main forward of T = k + 1) and the drafts as
`glm5lab.infer.steps.draft` runs them in steady state (`drafts`): the MTP layer over the k + 1 pending pairs
(no logits in the forward; the output head then runs once on the last pair), then k - 1 chained MTP forwards
of one token, each with logits; every MTP forward reads the MTP layer's own cache. Speculation yields
acceptance_length tokens per round, so `predicted_speedup` = acceptance_length x t(plain step) / t(round).

Not counted: activations, cache writes (T x bytes per token per row, small next to the reads), the accept
rule's element-wise work on [B, k+1, V]. Sources: Leviathan et al. 2023 (speculative decoding's cost model,
section 3.2: the speedup of a round over its cost in target steps); the expert count is the occupancy
expectation of K uniform choices per token; DeepSeek-V3.2 / `glm5lab.model.dsa` for what DSA reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.ledger import block_params, recurrent_state_bytes
from glm5lab.validate import finite, int_at_least, one_of

PARTS = ("main", "mtp")


Overhead = Union[float, Callable[[int], float]]
"""Seconds per forward: a constant, or a function of the forward's tokens (all rows: B x T)."""


@dataclass(frozen=True)
class Cost:
    """Bytes read and forwards run by one step or round: weights (the model's parameters, output head
    apart), head (the output head's reads), cache (the KV/index cache); calls: one (part, tokens) per forward
    ("main" or "mtp"; tokens over all rows; the output head run alone after the drafts' pending pass is part
    of that forward), each paying its per-forward overhead in `seconds`."""

    weights: float = 0.0
    head: float = 0.0
    cache: float = 0.0
    calls: tuple[tuple[str, int], ...] = ()

    @property
    def bytes(self) -> float:
        return self.weights + self.head + self.cache

    @property
    def forwards(self) -> int:
        return sum(part == "main" for part, _ in self.calls)

    @property
    def draft_forwards(self) -> int:
        return sum(part == "mtp" for part, _ in self.calls)

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.weights + other.weights, self.head + other.head, self.cache + other.cache,
                    self.calls + other.calls)

    def times(self, n: int) -> Cost:
        return Cost(n * self.weights, n * self.head, n * self.cache, self.calls * n)

    def seconds(self, bandwidth: float, overhead: Overhead = 0.0, draft_overhead: Overhead | None = None) -> float:
        """bytes / bandwidth (bytes per second) + each main forward's overhead + each MTP forward's
        draft_overhead (default: overhead); an overhead is seconds per forward, or a function of the
        forward's tokens (all rows) returning them."""
        finite("bandwidth", bandwidth, positive=True)
        per_draft = overhead if draft_overhead is None else draft_overhead
        total = self.bytes / bandwidth
        for part, tokens in self.calls:
            o = overhead if part == "main" else per_draft
            value = o(tokens) if callable(o) else o
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"overhead = {value!r} is not allowed: a finite number of seconds per forward "
                                 "(a calibration residual may be negative)")
            total += value
        return total


def distinct_experts(n_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` tokens, each choosing `per_token` of `n_experts` uniformly,
    touch: E (1 - (1 - K/E)^n). Raises ValueError unless 1 <= per_token <= n_experts and tokens >= 0."""
    int_at_least("n_experts", n_experts, 1)
    int_at_least("per_token", per_token, 1)
    int_at_least("tokens", tokens, 0)
    if per_token > n_experts:
        raise ValueError(f"per_token={per_token} is not allowed: at most n_experts={n_experts}")
    return n_experts * (1.0 - (1.0 - per_token / n_experts) ** tokens)


def weight_bytes(cfg: ModelConfig, tokens: int, *, part: str = "main", logits: bool = True,
                 bytes_per_param: float = 4.0) -> float:
    """Weight bytes one forward of `tokens` tokens (all rows together) reads: `part` "main" (the decoder
    layers and the final norm) or "mtp" (the MTP layer: its block, eh_proj and norms), each with `tokens`
    rows of the embedding and, when `logits`, the output head (V x D; the MTP layer shares the main one).
    Routed experts: `distinct_experts` per MoE layer; indexer weights only on layers that run their indexer
    ("own" and `use_dsa`). bytes_per_param: 4 fp32, 2 bf16, 1 fp8. Raises ValueError for a bad part."""
    one_of("part", part, PARTS)
    int_at_least("tokens", tokens, 1)
    D = cfg.hidden_size
    if part == "main":
        params = sum(_block_weights(cfg, spec, tokens) for spec in cfg.layers) + D  # + the final norm
    elif cfg.num_nextn_predict_layers:
        params = _block_weights(cfg, cfg.mtp_layer, tokens) + 3 * D + 2 * D * D  # enorm, hnorm, head norm; eh_proj
    else:
        raise ValueError("part='mtp' needs an MTP layer; this config has num_nextn_predict_layers=0")
    params += tokens * D + (head_params(cfg) if logits else 0)
    return params * bytes_per_param


def head_params(cfg: ModelConfig) -> int:
    """Parameters the output head reads: V x D (the embedding matrix when tied)."""
    return cfg.vocab_size * cfg.hidden_size


def _block_weights(cfg: ModelConfig, spec: LayerSpec, tokens: int) -> float:
    """Parameters one block's forward of `tokens` tokens reads (see `weight_bytes`)."""
    c = block_params(cfg, spec)
    if not (spec.indexer == "own" and cfg.use_dsa):
        c["indexer"] = 0
    if spec.mlp == "sparse":
        E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
        c["routed_experts"] *= distinct_experts(E, K, tokens) / E
    return float(sum(c.values()))


def cache_bytes(cfg: ModelConfig, specs, *, batch: int, context: int, queries: int,
                bytes_per_value: float = 4.0, index_bytes_per_value: float | None = None) -> float:
    """Cache bytes one forward of `queries` tokens per row reads over `context` cached tokens per row, for
    layers `specs` (`cfg.layers` or `(cfg.mtp_layer,)`): see the module docstring. index_bytes_per_value:
    the index keys' bytes per value (default: bytes_per_value; 1 for fp8 keys, their per-token scale
    not counted)."""
    int_at_least("batch", batch, 1)
    int_at_least("context", context, 0)
    int_at_least("queries", queries, 1)
    ib = bytes_per_value if index_bytes_per_value is None else index_bytes_per_value
    widths = {"mla": cfg.mla_cache_width, "gqa": cfg.gqa_cache_width}
    values = 0.0
    for spec in specs:
        if spec.recurrent:  # its fixed state, read once per forward
            values += recurrent_state_bytes(cfg, spec, int(bytes_per_value))
            continue
        width = widths[spec.attention]
        if spec.window:
            values += min(context, spec.window) * width * bytes_per_value
        elif spec.indexer != "none" and cfg.use_dsa:
            values += queries * min(context, cfg.index_topk) * width * bytes_per_value
        else:
            values += context * width * bytes_per_value
        if spec.index_cache:
            values += context * cfg.index_head_dim * ib
    return batch * values


@dataclass(frozen=True)
class Shape:
    """What the byte model is asked about: `batch` rows at `context` cached tokens each; the weights' and
    the cache's bytes per value (index keys: `index_bytes`, default the cache's)."""

    batch: int
    context: int
    weight_bytes: float = 4.0
    cache_bytes: float = 4.0
    index_bytes: float | None = None


def forward_cost(cfg: ModelConfig, shape: Shape, tokens: int, *, part: str = "main",
                 logits: bool = True) -> Cost:
    """One forward of `tokens` tokens per row over `shape`'s cache (see the module docstring)."""
    n = shape.batch * tokens
    head = head_params(cfg) * shape.weight_bytes if logits else 0.0
    weights = weight_bytes(cfg, n, part=part, logits=logits, bytes_per_param=shape.weight_bytes) - head
    specs = cfg.layers if part == "main" else (cfg.mtp_layer,)
    cache = cache_bytes(cfg, specs, batch=shape.batch, context=shape.context, queries=tokens,
                        bytes_per_value=shape.cache_bytes, index_bytes_per_value=shape.index_bytes)
    return Cost(weights, head, cache, ((part, n),))


def plain_step(cfg: ModelConfig, shape: Shape) -> Cost:
    """One decode step: a main forward of one token per row, with logits."""
    return forward_cost(cfg, shape, 1)


def verification(cfg: ModelConfig, shape: Shape, k: int) -> Cost:
    """The verification of k drafts: one main forward of k + 1 tokens per row, with logits."""
    int_at_least("k", k, 1)
    return forward_cost(cfg, shape, k + 1)


def drafts(cfg: ModelConfig, shape: Shape, k: int) -> Cost:
    """k drafts as `glm5lab.infer.steps.draft` runs them in steady state: the MTP layer over k + 1 pending
    pairs (no logits; then the output head on one row each), and k - 1 chained one-token MTP forwards with
    logits. Raises ValueError without an MTP layer."""
    int_at_least("k", k, 1)
    pending = forward_cost(cfg, shape, k + 1, part="mtp", logits=False)
    pending = pending + Cost(head=head_params(cfg) * shape.weight_bytes)
    return pending + forward_cost(cfg, shape, 1, part="mtp").times(k - 1)


def speculative_round(cfg: ModelConfig, shape: Shape, k: int) -> Cost:
    """One round: `drafts` + `verification`."""
    return drafts(cfg, shape, k) + verification(cfg, shape, k)


def predicted_speedup(cfg: ModelConfig, shape: Shape, *, k: int, acceptance_length: float, bandwidth: float,
                      overhead: Overhead = 0.0, draft_overhead: Overhead | None = None) -> float:
    """acceptance_length x t(plain step) / t(round), t = bytes / bandwidth + forwards x overhead (+ MTP
    forwards x draft_overhead, default overhead); bandwidth in bytes/s, overheads in seconds per forward.
    Raises ValueError for an acceptance length outside 1..k+1 or a non-positive bandwidth."""
    finite("acceptance_length", acceptance_length)
    if not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"acceptance_length={acceptance_length} is not allowed: 1..k+1={k + 1}")
    t_plain = plain_step(cfg, shape).seconds(bandwidth, overhead, draft_overhead)
    return acceptance_length * t_plain / speculative_round(cfg, shape, k).seconds(bandwidth, overhead, draft_overhead)
