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
from glm5lab.model.dsa_blocked import index_scores_fp8, index_topk_blocked
from glm5lab.model.fp8_keys import Fp8Keys
from glm5lab.model.precision import FP32LayerNorm, FP32Linear, fp32_compute
from glm5lab.model.rope import apply_rope
from glm5lab.model.topk import TopK, select_topk
from glm5lab.model.visibility import visible


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
        the MLA q latent after `q_a_layernorm`; k_BSJ: keys from `keys()` for positions 0..S-1, or
        `Fp8Keys` (an fp8 index cache's), scored as (q . k8) x scale without dequantizing
        (`dsa_blocked.index_scores_fp8`; its reference: this call on `Fp8Keys.dequantize()`);
        cos/sin: angles of the query positions q_offset..q_offset+T-1. q_offset: an int, or a
        LongTensor [B] with one offset per row (cached decoding of rows of different lengths)."""
        B, T, _ = x_BTD.shape
        q_BTIJ, w_BTI = self.queries(x_BTD, q_lat_BTQ, cos_TR2, sin_TR2)
        if isinstance(k_BSJ, Fp8Keys):
            scores_BTS = index_scores_fp8(q_BTIJ, w_BTI, k_BSJ, scale=self.head_dim**-0.5)
            return scores_BTS.masked_fill(~visible(q_offset, T, k_BSJ.shape[1], device=x_BTD.device), float("-inf"))
        with fp32_compute(x_BTD.device):
            dots_BTIS = torch.einsum("btij,bsj->btis", q_BTIJ.float(), k_BSJ.float()) * self.head_dim**-0.5
            scores_BTS = torch.einsum("bti,btis->bts", w_BTI, dots_BTIS.relu())
        return scores_BTS.masked_fill(~visible(q_offset, T, k_BSJ.shape[1], device=x_BTD.device), float("-inf"))

    def topk(self, x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, k: int, *, q_offset=0, blocked: bool) -> TopK:
        """`select_topk(scores(...), k)`: the same keys in the same order (idx int64 [B, T, min(k, S)]). blocked:
        by the blocked kernel (`dsa_blocked.index_topk_blocked`: scores per block of queries and keys, ReLU and
        head sum on the cache-resident block, one fp32 top-k per query block, O(T k + block x S) memory, one host
        read per call), which MLA runs for forwards that are neither decode-sized nor static (`Step`); else the
        reference, which has no host synchronisation and is as fast at a few queries. k_BSJ: a tensor or
        `Fp8Keys` (both ways scored without dequantizing, see `scores`). No gradient (selection is discrete).
        Raises ValueError for k < 1 or shapes that do not agree."""
        if not blocked:
            return select_topk(self.scores(x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, q_offset=q_offset), k,
                               q_offset=q_offset)
        q_BTIJ, w_BTI = self.queries(x_BTD, q_lat_BTQ, cos_TR2, sin_TR2)
        return index_topk_blocked(q_BTIJ, w_BTI, k_BSJ, k, scale=self.head_dim**-0.5, q_offset=q_offset)

    def scores_at(self, x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2, idx_BTK: torch.Tensor) -> torch.Tensor:
        """`scores(...)` at the K keys idx_BTK (int64 [B, T, K], positions in [0, S)) of each query: fp32 [B,
        T, K], differentiable in the indexer's inputs and weights, O(T K) work and memory (the sparse stage's
        indexer KL). No causal mask: pass visible keys (`TopK.valid_BTK` says which slots are). `Fp8Keys` are
        dequantized (training runs no cache; O(S J))."""
        if isinstance(k_BSJ, Fp8Keys):
            k_BSJ = k_BSJ.dequantize()
        (B, S, J), (T, K) = k_BSJ.shape, idx_BTK.shape[1:]
        q_BTIJ, w_BTI = self.queries(x_BTD, q_lat_BTQ, cos_TR2, sin_TR2)
        # index_select, not k[b, idx]: a key chosen by many queries gets its gradient summed in a fixed
        # order (index_add_), not by index_put_'s atomics in thread order (docs/reproducibility.md)
        rows_A = (idx_BTK + S * torch.arange(B, device=k_BSJ.device)[:, None, None]).reshape(-1)
        k_BTKJ = k_BSJ.reshape(B * S, J).index_select(0, rows_A).view(B, T, K, J)
        with fp32_compute(x_BTD.device):
            dots_BTIK = torch.einsum("btij,btkj->btik", q_BTIJ.float(), k_BTKJ.float()) * self.head_dim**-0.5
            return torch.einsum("bti,btik->btk", w_BTI, dots_BTIK.relu())
