"""Which keys a query may see: the one causal (and sliding-window) rule.

Legend: B rows, T queries, S keys. Query t of row b sits at absolute position offsets[b] + t
(offsets: an int for every row, or int64 [B], one per row: cached rows of different lengths), or, when
offsets is an int64 [B|1, T], at offsets[b, t] (explicit positions: a context-parallel rank's tokens,
`glm5lab.parallel.context_parallel`); key s at position s. A key is visible when

    key position <= query position   (and, with a `window`, > query position - window)

so a query at position p sees min(p + 1, window) keys. Attention masks (`Step.mask`), the
lightning indexer's scores and the blocked indexer's masking (`glm5lab.model.dsa`,
`dsa_blocked`) and the top-k's valid slots (`glm5lab.model.topk`) all use these two functions.
Source: the causal mask of every decoder; sliding windows as Longformer (Beltagy et al. 2020).
"""

from __future__ import annotations

import torch


def query_positions(offsets, T: int, device=None) -> torch.Tensor:
    """int64 [B|1, T]: the position of each query (offsets: int, int64 [B] or explicit positions [B|1, T])."""
    if torch.is_tensor(offsets) and offsets.dim() == 2:
        return offsets
    device = offsets.device if torch.is_tensor(offsets) else device
    return (torch.arange(T, device=device) + (offsets[:, None] if torch.is_tensor(offsets) else offsets)).reshape(-1, T)


def visible(offsets, T: int, keys, *, window: int | None = None, device=None) -> torch.Tensor:
    """Bool [B|1, T, S]: key visible to query. keys: an int S (positions 0..S-1), an int64 [S]
    of key positions (a block of columns) or [B, 1, S] (per row: a sliding-window ring's slots). device: where
    int offsets put the query positions (default: the keys' device when keys is a tensor, else the CPU)."""
    if device is None and torch.is_tensor(keys):
        device = keys.device
    q_pos_BT1 = query_positions(offsets, T, device)[..., None]
    keys_S = torch.arange(keys, device=q_pos_BT1.device) if isinstance(keys, int) else keys
    mask_BTS = keys_S <= q_pos_BT1
    return mask_BTS if window is None else mask_BTS & (keys_S > q_pos_BT1 - window)


def narrow_queries(offsets, t0: int, t: int):
    """The offsets of queries t0..t0+t-1 alone (a block of queries): int and [B] offsets shift by t0, explicit
    positions [B|1, T] are sliced."""
    if torch.is_tensor(offsets) and offsets.dim() == 2:
        return offsets[:, t0:t0 + t]
    return offsets + t0


def visible_count(offsets, T: int, S: int, *, window: int | None = None, device=None) -> torch.Tensor:
    """int64 [B|1, T]: how many of the keys 0..S-1 each query sees (`visible(...).sum(-1)`,
    without the [B, T, S] mask)."""
    q_pos_BT = query_positions(offsets, T, device)
    count_BT = (q_pos_BT + 1).clamp(min=0, max=S)
    return count_BT if window is None else count_BT - (q_pos_BT + 1 - window).clamp(min=0, max=S)
