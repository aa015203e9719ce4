"""DSA's top-k selection: the result type, the valid slots, the reference selector and its fast and grouped twins.

Legend: B rows, T queries, S keys, K `index_topk`.

Each query keeps its min(K, S) best-scoring keys, ties to the earlier key: the choice of a stable descending
sort. Keys after the query hold -inf (`glm5lab.model.visibility`) and rank after every visible key; NaN
(either sign) ranks first, as torch.topk ranks it. Slot j of query t is valid iff j < the number of keys it
sees (`visible_count`). `select_topk` is the reference; `select_topk_fast` (one fp32 torch.topk, rows with
ties or NaN re-ranked) and `_topk_grouped` (a shortlist for long rows) compute the same choice, tied by
tests/model/test_dsa_blocked.py and test_topk_causal.py. Source: DeepSeek-V3.2 (DSA's top-k), transformers'
`GlmMoeDsaIndexer` (torch.topk).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from glm5lab.model.visibility import visible_count


class TopK(NamedTuple):
    """Selected keys per query. idx_BTK: int64 key positions (always in range [0, S)); slots
    past the number of causal keys hold arbitrary in-range positions and have valid_BTK False."""

    idx_BTK: torch.Tensor
    valid_BTK: torch.Tensor


def check_k(k: int) -> None:
    """Raise ValueError unless k >= 1 (`index_topk`)."""
    if k < 1:
        raise ValueError(f"index_topk must be >= 1, got {k}")


def select_topk(scores_BTS: torch.Tensor, k: int, *, q_offset=0) -> TopK:
    """The min(k, S) best keys of each query, ties broken by position (earlier first).

    scores_BTS must hold -inf exactly at the keys after each query (as `scores` returns); the scores of
    visible keys may hold anything: NaN (either sign) ranks first, as torch.topk ranks it, and a visible -inf
    before the -inf keys after the query, so those are never selected. The choice is that of a stable
    descending sort, computed as torch.topk over distinct int64 keys (`_ranking_keys`: the score's
    order-preserving bits, then the position), so it is deterministic on every device and O(S log K) rather
    than a full sort. Slots beyond the query's number of causal keys (q_offset + t + 1) are marked invalid.
    q_offset: an int or a LongTensor [B] (one offset per row). Raises ValueError for k < 1."""
    check_k(k)
    B, T, S = scores_BTS.shape
    K = min(k, S)
    idx_BTK = _ranking_keys(scores_BTS).topk(K, dim=-1).indices
    return TopK(idx_BTK, valid_slots((B, T, S), k, q_offset, scores_BTS.device))


def select_topk_fast(scores_BTS: torch.Tensor, k: int, *, q_offset=0) -> TopK:
    """`select_topk`'s choice, in its order, from one fp32 torch.topk of k+1 per query (no int64
    ranking keys, faster on CPU: BENCHMARKS.md, "Kernel choices"): where the k+1 best scores of a row are all distinct, the
    stable sort's prefix is exactly torch.topk's (a strictly decreasing run has one order); the
    rows with an equal pair among them (a tie at or above the boundary, -0.0 == +0.0, or -inf
    slots of a query with fewer than k+1 causal keys) or a NaN (first in both; torch.topk orders
    NaNs among themselves arbitrarily) are re-ranked by `select_topk`. One host
    synchronisation (whether any row tied): not for compiled graphs. Raises ValueError for k < 1."""
    check_k(k)
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
    return TopK(idx_BTK, valid_slots(scores_BTS.shape, k, q_offset, scores_BTS.device))


GROUPED_TOPK_MIN_KEYS = 8192


def _topk_grouped(scores_BTS: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores_BTS, k) over a shortlist: the k groups of g scores (strided: j, j + G, ..., G = S //
    g) with the largest maxima (g = 8, or 16 from 48K keys), plus the tail that fills no group. Every score
    outside them is <= the k-th largest group maximum, itself one of the shortlist's k best, so the values are
    torch.topk's exactly and the indices are wherever those values are distinct (an outside score can only
    equal the k-th: `select_topk_fast` re-ranks such rows anyway). torch.topk copies each row into (value,
    index) pairs and heap-sorts them, so its cost follows the row length; the shortlist's gain is in
    BENCHMARKS.md ("Kernel choices"). Rows shorter than 8192 keys use torch.topk itself."""
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


def valid_slots(shape, k: int, q_offset, device) -> torch.Tensor:
    """Bool [B, T, min(k, S)]: slot j of query t is valid iff j < the keys it sees (`visible_count`)."""
    B, T, S = shape
    n_visible_BT = visible_count(q_offset, T, S, device=device)
    return (torch.arange(min(k, S), device=device) < n_visible_BT[..., None]).expand(B, T, min(k, S))


def boundary_ties(scores_BTS: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [B, T]: query rows whose k-th and (k+1)-th best scores are exactly equal, among rows with more
    than k causal (finite) keys: the rows where the tie rule, not the scores, decides the last selected key
    (ours: the earlier key; torch.topk: unspecified). scores_BTS as `LightningIndexer.scores` returns them. A
    diagnostic (tests/test_hf_ties.py, benchmarks/index_ties.py), not on the forward path."""
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
