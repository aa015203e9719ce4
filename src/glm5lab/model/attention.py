"""Core attention kernels shared by MLA (naive and absorbed), GQA and DSA.

Legend: B batch, T queries, S keys, H query heads, G key/value heads (H = G * r), D q/k width,
E v width, K selected keys per query (DSA top-k).

Every kernel takes q_BTHD, k_BSGD, v_BSGE and returns o_BTHE in q's dtype; softmax runs in fp32.
Query i sits at absolute position `q_offset + i`; key j at position j. Causality is "key
position <= query position".

- `attention_reference`: explicit scores + boolean mask. The obvious version; the twin every
  other kernel is tested against.
- `attention_causal`: dense causal attention through `F.scaled_dot_product_attention`.
- `attention_masked`: the reference's mask through SDPA (DSA at short context).
- `attention_gathered`: DSA core attention. Gathers the K selected keys of each query and
  attends to those only: O(T*K) scores instead of O(T*S). Source: DeepSeek-V3.2 (DSA),
  FlashMLA's sparse kernels; reference twin = `attention_reference` with `topk_mask`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class TopK(NamedTuple):
    """Selected keys per query. idx_BTK: int64 key positions (always in range [0, S)); slots
    past the number of causal keys hold arbitrary in-range positions and have valid_BTK False."""

    idx_BTK: torch.Tensor
    valid_BTK: torch.Tensor


def causal_mask(T: int, S: int, q_offset: int, device) -> torch.Tensor:
    """Bool [T, S]: True where key position <= query position (q_offset + row)."""
    q_pos = torch.arange(T, device=device)[:, None] + q_offset
    return torch.arange(S, device=device)[None, :] <= q_pos


def topk_mask(topk: TopK, S: int) -> torch.Tensor:
    """Bool [B, T, S]: True at the selected, valid keys of each query."""
    B, T, _ = topk.idx_BTK.shape
    mask = torch.zeros(B, T, S, dtype=torch.bool, device=topk.idx_BTK.device)
    return mask.scatter_(-1, topk.idx_BTK, topk.valid_BTK)


def _split_groups(q_BTHD: torch.Tensor, G: int) -> torch.Tensor:
    B, T, H, D = q_BTHD.shape
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G}")
    return q_BTHD.view(B, T, G, H // G, D)


def attention_reference(q_BTHD, k_BSGD, v_BSGE, *, scale: float, mask_BTS: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention, written out. mask_BTS (bool, [B|1, T, S]) says which keys each
    query may see; every row must allow at least one key (else the row is NaN)."""
    G = k_BSGD.shape[2]
    q_BTGrD = _split_groups(q_BTHD, G).float()
    scores_BGrTS = torch.einsum("btgrd,bsgd->bgrts", q_BTGrD, k_BSGD.float()) * scale
    scores_BGrTS = scores_BGrTS.masked_fill(~mask_BTS[:, None, None], float("-inf"))
    probs_BGrTS = scores_BGrTS.softmax(dim=-1)
    o_BTGrE = torch.einsum("bgrts,bsge->btgre", probs_BGrTS, v_BSGE.float())
    return o_BTGrE.flatten(2, 3).to(q_BTHD.dtype)


def attention_causal(q_BTHD, k_BSGD, v_BSGE, *, scale: float, q_offset: int = 0) -> torch.Tensor:
    """Dense causal attention via SDPA (flash/efficient kernels where available)."""
    T, S = q_BTHD.shape[1], k_BSGD.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BSGD, v_BSGE))
    G, H = k.shape[1], q.shape[1]
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G}")
    if T == S and q_offset == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G != H)
    else:
        mask = causal_mask(T, S, q_offset, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=G != H)
    return o.transpose(1, 2)


def attention_masked(q_BTHD, k_BSGD, v_BSGE, *, scale: float, mask_BTS: torch.Tensor) -> torch.Tensor:
    """`attention_reference` through SDPA: the same boolean mask ([B|1, T, S], True = may
    attend), fused kernels. The fast form of DSA when the selection is dense-ish (short context),
    where gathering K keys per query costs more than masking S."""
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BSGD, v_BSGE))
    G, H = k.shape[1], q.shape[1]
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G}")
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BTS[:, None], scale=scale, enable_gqa=G != H)
    return o.transpose(1, 2)


def attention_gathered(q_BTHD, k_BSGD, v_BSGE, *, scale: float, topk: TopK) -> torch.Tensor:
    """Attention of each query over its selected keys only (DSA core attention).

    Memory and compute are O(B*T*K*G*(D+E)) and O(B*T*K*H*(D+E)); with MLA absorbed (G=1,
    D=576) this is FlashMLA's sparse layout. Gradients flow to q, k and v (not to the indices)."""
    B, T, K = topk.idx_BTK.shape
    G = k_BSGD.shape[2]
    q_BTGrD = _split_groups(q_BTHD, G)
    b = torch.arange(B, device=q_BTHD.device)[:, None, None]
    k_BTKGD = k_BSGD[b, topk.idx_BTK]
    v_BTKGE = v_BSGE[b, topk.idx_BTK]
    scores_BTGrK = torch.einsum("btgrd,btkgd->btgrk", q_BTGrD.float(), k_BTKGD.float()) * scale
    scores_BTGrK = scores_BTGrK.masked_fill(~topk.valid_BTK[:, :, None, None, :], float("-inf"))
    probs_BTGrK = scores_BTGrK.softmax(dim=-1)
    o_BTGrE = torch.einsum("btgrk,btkge->btgre", probs_BTGrK, v_BTKGE.float())
    return o_BTGrE.flatten(2, 3).to(q_BTHD.dtype)
