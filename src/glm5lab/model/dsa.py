"""DeepSeek Sparse Attention: the lightning indexer and its top-k selection.

Legend: B batch, T queries, S keys, I indexer heads, J indexer head width (`index_head_dim`),
R rotary width, Q q latent width (`q_lora_rank`), K `index_topk`.

score(t, s) = sum_i w_i(t) * ReLU(q_i(t) . k(s) / sqrt(J)),  w(t) = weights_proj(x_t) / sqrt(I)

q_i comes from the MLA query latent (`wq_b`), k from the hidden state (`wk` then LayerNorm
`k_norm`, one key per token shared by all indexer heads). RoPE covers the first R dims of q and
k (GLM-5: interleaved pairing; DeepSeek-V3.2: half). Keys after the query are excluded (-inf),
and each query keeps its top min(K, S) keys; ties go to the earlier position.

Precision: `weights_proj` and `k_norm` are fp32 parameters that no model cast rounds
(`glm5lab.model.precision`; DeepSeek-V3.2's inference code keeps both fp32); w, the dot products,
the ReLU and the head sum run in fp32 with autocast off, so the top-k is chosen from fp32 scores
in every model dtype. `wq_b` and `wk` follow the model dtype (q and k are then upcast).

Source: DeepSeek-V3.2 (DSA) and transformers' `GlmMoeDsaIndexer` (the reference for names,
scaling and the interleaved RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.attention import TopK
from glm5lab.model.precision import FP32LayerNorm, FP32Linear, fp32_compute
from glm5lab.model.rope import apply_rope


BLOCKED_MIN_QUERIES = 16
"""`LightningIndexer.topk` runs the blocked kernel for forwards of more than 16 queries per row
(prefill chunks, training); decode and verification steps (and compiled graphs) use the
reference, which is sync-free and as fast at T <= 16."""


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.interleaved = cfg.qk_rope_head_dim, cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = FP32LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = FP32Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope(self, x, cos, sin):
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, interleaved=self.interleaved), rest], dim=-1)

    def keys(self, x_BTD: torch.Tensor, cos_TR2, sin_TR2) -> torch.Tensor:
        """Indexer keys k_BTJ (what the inference cache stores, J values per token)."""
        return self._rope(self.k_norm(self.wk(x_BTD)), cos_TR2, sin_TR2)

    def queries(self, x_BTD, q_lat_BTQ, cos_TR2, sin_TR2) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer queries q_BTIJ (RoPE applied, model dtype) and head weights w_BTI (fp32,
        `weights_proj(x) / sqrt(I)`) of T query tokens; arguments as `scores`."""
        B, T, _ = x_BTD.shape
        q_BTIJ = self._rope(self.wq_b(q_lat_BTQ).view(B, T, self.n_heads, self.head_dim), cos_TR2, sin_TR2)
        return q_BTIJ, self.weights_proj(x_BTD).float() * self.n_heads**-0.5

    def scores(self, x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, *, q_offset: int = 0) -> torch.Tensor:
        """Index scores, fp32 [B, T, S]; -inf where the key is after the query. The reference:
        every (query, head, key) dot product is materialised ([B, T, I, S] fp32); `topk` selects
        from the same scores block by block.

        x_BTD: hidden states of the queries (layer input after `input_layernorm`); q_lat_BTQ:
        the MLA q latent after `q_a_layernorm`; k_BSJ: keys from `keys()` for positions 0..S-1;
        cos/sin: angles of the query positions q_offset..q_offset+T-1. q_offset: an int, or a
        LongTensor [B] with one offset per row (cached decoding of rows of different lengths)."""
        B, T, _ = x_BTD.shape
        q_BTIJ, w_BTI = self.queries(x_BTD, q_lat_BTQ, cos_TR2, sin_TR2)
        with fp32_compute(x_BTD.device):
            dots_BTIS = torch.einsum("btij,bsj->btis", q_BTIJ.float(), k_BSJ.float()) * self.head_dim**-0.5
            scores_BTS = torch.einsum("bti,btis->bts", w_BTI, dots_BTIS.relu())
        return scores_BTS.masked_fill(~_visible(q_offset, B, T, k_BSJ.shape[1], x_BTD.device), float("-inf"))

    def topk(self, x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, k: int, *, q_offset=0,
             blocked: bool | None = None) -> TopK:
        """`select_topk(scores(...), k)`: the same keys in the same order (idx int64 [B, T,
        min(k, S)]), without the reference's [B, T, I, S] intermediate. blocked=None (auto): the
        blocked kernel (`dsa_blocked.index_topk_blocked`: scores per block of queries and keys,
        ReLU and head sum on the cache-resident block, one fp32 top-k per query block, O(T k +
        block x S) memory) for forwards of more than `BLOCKED_MIN_QUERIES` queries outside
        torch.compile; the reference otherwise (decode and verification steps, compiled graphs:
        it has no host synchronisation). No gradient (selection is discrete). Raises ValueError
        for k < 1 or shapes that do not agree."""
        if blocked is None:
            blocked = x_BTD.shape[1] > BLOCKED_MIN_QUERIES and not torch.compiler.is_compiling()
        if not blocked:
            return select_topk(self.scores(x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, q_offset=q_offset), k,
                               q_offset=q_offset)
        from glm5lab.model.dsa_blocked import index_topk_blocked

        q_BTIJ, w_BTI = self.queries(x_BTD, q_lat_BTQ, cos_TR2, sin_TR2)
        return index_topk_blocked(q_BTIJ, w_BTI, k_BSJ, k, scale=self.head_dim**-0.5, q_offset=q_offset)

    def scores_at(self, x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, idx_BTK: torch.Tensor) -> torch.Tensor:
        """`scores(...)` at the K keys idx_BTK (int64 [B, T, K], positions in [0, S)) of each
        query: fp32 [B, T, K], differentiable in the indexer's inputs and weights, O(T K) work and
        memory (the sparse stage's indexer KL). No causal mask: pass visible keys (`TopK.valid_BTK`
        says which slots are)."""
        (B, S, J), (T, K) = k_BSJ.shape, idx_BTK.shape[1:]
        q_BTIJ, w_BTI = self.queries(x_BTD, q_lat_BTQ, cos_TR2, sin_TR2)
        # index_select, not k[b, idx]: a key chosen by many queries gets its gradient summed in a fixed
        # order (index_add_), not by index_put_'s atomics in thread order (docs/reproducibility.md)
        rows_A = (idx_BTK + S * torch.arange(B, device=k_BSJ.device)[:, None, None]).reshape(-1)
        k_BTKJ = k_BSJ.reshape(B * S, J).index_select(0, rows_A).view(B, T, K, J)
        with fp32_compute(x_BTD.device):
            dots_BTIK = torch.einsum("btij,btkj->btik", q_BTIJ.float(), k_BTKJ.float()) * self.head_dim**-0.5
            return torch.einsum("bti,btik->btk", w_BTI, dots_BTIK.relu())


def _visible(q_offset, B: int, T: int, S: int, device) -> torch.Tensor:
    """Bool [B|1, T, S]: key position <= query position, for an int or per-row [B] offset."""
    q_pos = torch.arange(T, device=device) + (q_offset[:, None] if torch.is_tensor(q_offset) else q_offset)
    return torch.arange(S, device=device) <= q_pos.reshape(-1, T)[..., None]


def select_topk(scores_BTS: torch.Tensor, k: int, *, q_offset=0) -> TopK:
    """The min(k, S) best keys of each query, ties broken by position (earlier first).

    scores_BTS must hold -inf exactly at the keys after each query (as `scores` returns); the
    scores of visible keys may hold anything: NaN (either sign) ranks first, as torch.topk ranks
    it, and a visible -inf before the -inf keys after the query, so those are never selected. The
    choice is that of a stable descending sort, computed as torch.topk over distinct int64 keys
    (`_ranking_keys`: the score's order-preserving bits, then the position), so it is
    deterministic on every device and O(S log K) rather than a full sort. Slots beyond the
    query's number of causal keys (q_offset + t + 1) are marked invalid. q_offset: an int or a
    LongTensor [B] (one offset per row). Raises ValueError for k < 1."""
    if k < 1:
        raise ValueError(f"index_topk must be >= 1, got {k}")
    B, T, S = scores_BTS.shape
    K = min(k, S)
    idx_BTK = _ranking_keys(scores_BTS).topk(K, dim=-1).indices
    return TopK(idx_BTK, _valid_slots((B, T, S), k, q_offset, scores_BTS.device))


def select_topk_fast(scores_BTS: torch.Tensor, k: int, *, q_offset=0) -> TopK:
    """`select_topk`'s choice, in its order, from one fp32 torch.topk of k+1 per query (no int64
    ranking keys, ~3x faster on CPU): where the k+1 best scores of a row are all distinct, the
    stable sort's prefix is exactly torch.topk's (a strictly decreasing run has one order); the
    rows with an equal pair among them (a tie at or above the boundary, -0.0 == +0.0, or -inf
    slots of a query with fewer than k+1 causal keys) or a NaN (first in both; torch.topk orders
    NaNs among themselves arbitrarily) are re-ranked by `select_topk`. One host
    synchronisation (whether any row tied): not for compiled graphs. Raises ValueError for k < 1."""
    if k < 1:
        raise ValueError(f"index_topk must be >= 1, got {k}")
    S = scores_BTS.shape[-1]
    if S <= k:
        return select_topk(scores_BTS, k, q_offset=q_offset)
    vals_BTK1, idx_BTK1 = _topk_grouped(scores_BTS, k + 1)
    # both rank NaN first, but torch.topk orders NaNs among themselves arbitrarily: re-rank rows with a NaN
    tied_BT = (vals_BTK1[..., 1:] == vals_BTK1[..., :-1]).any(-1) | vals_BTK1[..., :1].isnan()[..., 0]
    idx_BTK = idx_BTK1[..., :k]
    if bool(tied_BT.any()):
        idx_BTK = idx_BTK.clone()
        rows = tied_BT.nonzero(as_tuple=True)
        idx_BTK[rows] = _ranking_keys(scores_BTS[rows]).topk(k, dim=-1).indices
    return TopK(idx_BTK, _valid_slots(scores_BTS.shape, k, q_offset, scores_BTS.device))


GROUPED_TOPK_MIN_KEYS = 8192


def _topk_grouped(scores_BTS: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores_BTS, k) over a shortlist: the k groups of g scores (strided: j, j + G,
    ..., G = S // g) with the largest maxima (g = 8, or 16 from 48K keys), plus the tail that
    fills no group. Every score outside them is <= the k-th largest group maximum, itself one of
    the shortlist's k best, so the values are torch.topk's exactly and the indices are wherever
    those values are distinct (an outside score can only equal the k-th: `select_topk_fast`
    re-ranks such rows anyway). CPU, 64 rows, k = 257, 1 thread: 3.9 vs 7.5 ms at 32K keys, 2.9
    vs 6.4 at 16K, 2.3 vs 3.5 at 8K (torch.topk copies each row into (value, index) pairs and
    heap-sorts them, so its cost follows the row length). Rows shorter than 8192 keys use
    torch.topk itself."""
    *lead, S = scores_BTS.shape
    g = 8 if S < 49152 else 16
    if S < GROUPED_TOPK_MIN_KEYS or S // g < k:
        return scores_BTS.topk(k, dim=-1)
    rows_NS = scores_BTS.reshape(-1, S)
    n, G = rows_NS.shape[0], S // g
    # group j = the scores at j, j + G, ..., j + (g-1) G: strided groups, so that their maxima are g
    # elementwise maxima of contiguous runs (vectorised) rather than reductions over 8 neighbours
    best_groups_Nk = rows_NS[:, :G * g].view(n, g, G).amax(1).topk(k, dim=-1, sorted=False).indices
    cols_NC = (best_groups_Nk[..., None] + G * torch.arange(g, device=rows_NS.device)).view(n, -1)
    if G * g < S:
        cols_NC = torch.cat([cols_NC, torch.arange(G * g, S, device=rows_NS.device).expand(n, -1)], dim=1)
    vals_Nk, j_Nk = rows_NS.gather(1, cols_NC).topk(k, dim=-1)
    return vals_Nk.view(*lead, k), cols_NC.gather(1, j_Nk).view(*lead, k)


def _valid_slots(shape, k: int, q_offset, device) -> torch.Tensor:
    """Bool [B, T, min(k, S)]: slot j of query t is valid iff j < its causal keys (q_offset + t + 1)."""
    B, T, S = shape
    offset = q_offset[:, None] if torch.is_tensor(q_offset) else q_offset
    n_causal_BT = (torch.arange(T, device=device) + offset + 1).clamp(max=S).reshape(-1, T)
    return (torch.arange(min(k, S), device=device) < n_causal_BT[..., None]).expand(B, T, min(k, S))


def boundary_ties(scores_BTS: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [B, T]: query rows whose k-th and (k+1)-th best scores are exactly equal, among rows
    with more than k causal (finite) keys: the rows where the tie rule, not the scores, decides
    the last selected key (ours: the earlier key; torch.topk: unspecified). scores_BTS as
    `LightningIndexer.scores` returns them. A diagnostic (tests/test_hf_ties.py,
    benchmarks/index_ties.py), not on the forward path."""
    best = scores_BTS.sort(-1, descending=True).values
    many = scores_BTS.isfinite().sum(-1) > k
    return many & (best[..., k - 1] == best[..., k]) if scores_BTS.shape[-1] > k else many


def _ranking_keys(scores_BTS: torch.Tensor) -> torch.Tensor:
    """int64 [B, T, S], all distinct per row, ordered as (score, -position): fp32 bits made
    order-preserving (negative floats get their magnitude bits flipped; -0.0 counts as +0.0),
    shifted left past the position field, plus (S - 1 - position).

    NaN of either sign ranks above +inf, as torch.topk (and so transformers) ranks it: by its
    bits a NaN with the sign bit set (what inf * 0 gives on x86) would sort below -inf, after
    the -inf keys that follow the query, and those would fill the query's valid slots. With
    every NaN first, the -inf keys after the query rank below every visible key (a visible -inf
    ties with them and wins by position), so the valid slots hold visible keys only."""
    S = scores_BTS.shape[-1]
    scores_BTS = scores_BTS.float()
    bits = (scores_BTS + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = ordered.masked_fill(scores_BTS.isnan(), torch.iinfo(torch.int32).max).to(torch.int64)
    shift = max(1, (S - 1).bit_length())
    later_first = torch.arange(S - 1, -1, -1, device=scores_BTS.device)
    return (ordered << shift) | later_first
