"""DeepSeek Sparse Attention: the lightning indexer and its top-k selection.

Legend: B batch, T queries, S keys, I indexer heads, J indexer head width (`index_head_dim`),
R rotary width, Q q latent width (`q_lora_rank`), K `index_topk`.

score(t, s) = sum_i w_i(t) * ReLU(q_i(t) . k(s) / sqrt(J)),  w(t) = weights_proj(x_t) / sqrt(I)

q_i comes from the MLA query latent (`wq_b`), k from the hidden state (`wk` then LayerNorm
`k_norm`, one key per token shared by all indexer heads). RoPE covers the first R dims of q and
k (GLM-5: interleaved pairing; DeepSeek-V3.2: half). Keys after the query are excluded (-inf),
and each query keeps its top min(K, S) keys; ties go to the earlier position.

Source: DeepSeek-V3.2 (DSA) and transformers' `GlmMoeDsaIndexer` (the reference for names,
scaling and the interleaved RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.attention import TopK
from glm5lab.model.rope import apply_rope


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.interleaved = cfg.qk_rope_head_dim, cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope(self, x, cos, sin):
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, interleaved=self.interleaved), rest], dim=-1)

    def keys(self, x_BTD: torch.Tensor, cos_TR2, sin_TR2) -> torch.Tensor:
        """Indexer keys k_BTJ (what the inference cache stores, J values per token)."""
        return self._rope(self.k_norm(self.wk(x_BTD)), cos_TR2, sin_TR2)

    def scores(self, x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, *, q_offset: int = 0) -> torch.Tensor:
        """Index scores, fp32 [B, T, S]; -inf where the key is after the query.

        x_BTD: hidden states of the queries (layer input after `input_layernorm`); q_lat_BTQ:
        the MLA q latent after `q_a_layernorm`; k_BSJ: keys from `keys()` for positions 0..S-1;
        cos/sin: angles of the query positions q_offset..q_offset+T-1."""
        B, T, _ = x_BTD.shape
        q_BTIJ = self._rope(self.wq_b(q_lat_BTQ).view(B, T, self.n_heads, self.head_dim), cos_TR2, sin_TR2)
        dots_BTIS = torch.einsum("btij,bsj->btis", q_BTIJ.float(), k_BSJ.float()) * self.head_dim**-0.5
        w_BTI = F.linear(x_BTD.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        scores_BTS = torch.einsum("bti,btis->bts", w_BTI, dots_BTIS.relu())
        S = k_BSJ.shape[1]
        future = torch.arange(S, device=x_BTD.device)[None, :] > (torch.arange(T, device=x_BTD.device)[:, None] + q_offset)
        return scores_BTS.masked_fill(future, float("-inf"))


def select_topk(scores_BTS: torch.Tensor, k: int, *, q_offset: int = 0) -> TopK:
    """The min(k, S) best keys of each query, ties broken by position (earlier first).

    scores_BTS must hold -inf exactly at the keys after each query (as `scores` returns). A
    stable descending sort makes the choice deterministic on every device; slots beyond the
    query's number of causal keys (q_offset + t + 1) are marked invalid.
    Raises ValueError for k < 1."""
    if k < 1:
        raise ValueError(f"index_topk must be >= 1, got {k}")
    B, T, S = scores_BTS.shape
    K = min(k, S)
    order_BTS = torch.sort(scores_BTS, dim=-1, descending=True, stable=True).indices
    idx_BTK = order_BTS[..., :K]
    n_causal_T = (torch.arange(T, device=scores_BTS.device) + q_offset + 1).clamp(max=S)
    valid_BTK = torch.arange(K, device=scores_BTS.device)[None, None, :] < n_causal_T[None, :, None]
    return TopK(idx_BTK, valid_BTK.expand(B, T, K))
