"""Core attention kernels shared by MLA (naive and absorbed), GQA and DSA.

Legend: B batch, T queries, S keys, H query heads, G key/value heads (H = G * r), D q/k width,
E v width, K selected keys per query (DSA top-k).

Every kernel takes q_BTHD, k_BSGD, v_BSGE (the latent kernels: q_BTHX and one kv_BSX) and returns o_BTHE in
q's dtype; softmax runs in fp32. Query i sits at absolute position `q_offset + i`; key j at position j; which
keys a query sees is `glm5lab.model.visibility.visible`.

- `attention_reference`: explicit scores + boolean mask. The obvious version; the twin every
  other kernel is tested against.
- `attention_causal`: dense causal attention through `F.scaled_dot_product_attention`.
- `attention_masked`: the reference's mask through SDPA (DSA at short context).
- `attention_latent_masked` / `attention_latent_gathered`: absorbed MLA, one shared key per
  token whose first `v_dim` columns are also the value (the latent c): FlashMLA's layout, K and V
  read from one tensor.
  `attention_latent_gathered` is DSA's core attention: it gathers the K selected keys of each
  query and attends to those only, O(T*K) scores instead of O(T*S). Source: DeepSeek-V3.2
  (DSA), FlashMLA's sparse kernels; reference twin = `attention_reference` with `topk_mask`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5lab.model.topk import TopK
from glm5lab.model.visibility import visible


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
    if T == S and q_offset == 0:
        return _sdpa(q_BTHD, k_BSGD, v_BSGE, is_causal=True, scale=scale)
    return _sdpa(q_BTHD, k_BSGD, v_BSGE, attn_mask=visible(q_offset, T, S, device=q_BTHD.device)[0], scale=scale)


def attention_masked(q_BTHD, k_BSGD, v_BSGE, *, scale: float, mask_BTS: torch.Tensor | None,
                     q_offset: int = 0) -> torch.Tensor:
    """`attention_reference` through SDPA: the same boolean mask ([B|1, T, S], True = may
    attend), fused kernels; None: `attention_causal` with `q_offset`. The fast form of DSA when the selection is
    dense-ish (short context), where gathering K keys per query costs more than masking S."""
    if mask_BTS is None:
        return attention_causal(q_BTHD, k_BSGD, v_BSGE, scale=scale, q_offset=q_offset)
    return _sdpa(q_BTHD, k_BSGD, v_BSGE, attn_mask=mask_BTS[:, None], scale=scale)


def _sdpa(q_BTHD, k_BSGD, v_BSGE, **kwargs) -> torch.Tensor:
    """o_BTHE: SDPA (`kwargs`: its mask and scale) of H query heads over G key/value heads (G divides H)."""
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BSGD, v_BSGE))
    G, H = k.shape[1], q.shape[1]
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G}")
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=G != H, **kwargs).transpose(1, 2)


def attention_latent_masked(q_BTHX, kv_BSX, *, v_dim: int, scale: float, mask_BTS: torch.Tensor | None,
                            q_offset: int = 0) -> torch.Tensor:
    """Absorbed MLA attention: every head attends to the shared key kv_BSX ([c | k_pe], X wide) and reads the
    value kv[..., :v_dim] (= c). Returns o_BTHV. mask_BTS: as `attention_masked` (None: causal with
    `q_offset`). The value passed to SDPA is the whole X-wide key (the extra output columns are dropped):
    equal widths keep CPU SDPA on its fused kernel, and no sliced copy of the cache is made."""
    kv_BS1X = kv_BSX[:, :, None, :]
    return attention_masked(q_BTHX, kv_BS1X, kv_BS1X, scale=scale, mask_BTS=mask_BTS, q_offset=q_offset)[..., :v_dim]


def attention_latent_gathered(q_BTHX, kv_BSX, *, v_dim: int, scale: float, topk: TopK,
                              query_block: int = 16) -> torch.Tensor:
    """`attention_latent_masked` over each query's selected keys only (absorbed DSA core attention, FlashMLA's
    sparse decode): the K selected latents of each query serve as key and value. Returns o_BTHV. Reference
    twin: `attention_reference` with k = kv, v = kv[..., :v_dim] and the top-k mask. topk.idx_BTK must lie in
    [0, S) (TopK's invariant; not checked here: a check would read the indices on the host, which compiled
    decode steps must not). Raises ValueError for query_block < 1 or shapes that do not agree.

    Blocked over queries: per `query_block` queries one `index_select` of their K latents ([query_block * K,
    X], 9 MiB at K = 256, X = 576: it stays in cache, in one reused buffer when no gradient is needed), then
    SDPA with each query as a batch entry and its H heads as SDPA's queries over its K latents (the whole
    X-wide latent as value, as `attention_latent_masked`: the fused kernel, faster than two bmm and a softmax:
    BENCHMARKS.md, "Kernel choices"). The one-shot gather it replaces copied [T, K, X] per call, then read it
    back twice from memory. Backward (training) flows through `index_select` and SDPA."""
    B, T, H, X = q_BTHX.shape
    S, K = kv_BSX.shape[1], topk.idx_BTK.shape[-1]
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    if topk.idx_BTK.shape[:2] != (B, T) or kv_BSX.shape[0] != B or kv_BSX.shape[2] != X:
        raise ValueError(f"sparse attention shapes do not agree: q {tuple(q_BTHX.shape)} [B, T, H, X], kv "
                         f"{tuple(kv_BSX.shape)} [B, S, X], top-k {tuple(topk.idx_BTK.shape)} [B, T, K]")
    kv_NX = kv_BSX.reshape(B * S, X)
    rows_NK = (topk.idx_BTK + S * torch.arange(B, device=kv_BSX.device)[:, None, None]).reshape(B * T, K)
    q_NHX, valid_N1K = q_BTHX.reshape(B * T, H, X), topk.valid_BTK.reshape(B * T, 1, K)
    grad = torch.is_grad_enabled() and (q_BTHX.requires_grad or kv_BSX.requires_grad)
    f32 = torch.float32
    out_NHV = None if grad else torch.empty(B * T, H, v_dim, dtype=f32, device=q_BTHX.device)
    gathered = None if grad or kv_BSX.dtype != f32 else torch.empty(query_block * K, X, dtype=f32, device=kv_BSX.device)
    blocks = []
    for n0 in range(0, B * T, query_block):
        n1 = min(n0 + query_block, B * T)
        rows = rows_NK[n0:n1].reshape(-1)
        if gathered is None:
            kv_nKX = kv_NX.index_select(0, rows).view(n1 - n0, K, X).float()
        else:  # no autograd: gather into one reused buffer
            kv_nKX = torch.index_select(kv_NX, 0, rows, out=gathered[:rows.numel()]).view(n1 - n0, K, X)
        kv_n1KX = kv_nKX[:, None]  # each query a batch entry, its H heads the SDPA "queries"
        o_nHX = F.scaled_dot_product_attention(q_NHX[n0:n1, None].float(), kv_n1KX, kv_n1KX,
                                               attn_mask=valid_N1K[n0:n1, None], scale=scale)[:, 0]
        if out_NHV is None:
            blocks.append(o_nHX[..., :v_dim])
        else:
            out_NHV[n0:n1] = o_nHX[..., :v_dim]
    out_NHV = torch.cat(blocks) if out_NHV is None else out_NHV
    return out_NHV.view(B, T, H, v_dim).to(q_BTHX.dtype)
