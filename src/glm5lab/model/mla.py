"""Multi-head Latent Attention (MLA) with DSA.

Legend: B batch, T queries, S keys, H heads, N no-RoPE q/k width (`qk_nope_head_dim`), R RoPE
width (`qk_rope_head_dim`), V value width (`v_head_dim`), C kv latent (`kv_lora_rank`),
Q q latent (`q_lora_rank`).

    q:  x -> q_a_proj -> q_a_layernorm (= q_lat, also the indexer's input) -> q_b_proj -> H x (N | R)
    kv: x -> kv_a_proj_with_mqa -> [c (C) | k_pe (R, one per token)]; c -> kv_a_layernorm
        naive:    kv_b_proj(c) -> H x (N key | V value); k = [k_nope | k_pe]
        absorbed: W_uk, W_uv = kv_b_proj split by head; q_c = q_nope W_uk, attention over
                  [c | k_pe] (C+R = 576 values per token in GLM-5), output o_c W_uv^T
Only c and k_pe are ever cached. The two paths are the same function of the weights
(q_nope . (W_uk c) = (q_nope W_uk) . c); `tests/model/test_mla.py` ties them forward and backward.

Source: DeepSeek-V2 section 2.1 (MLA, absorption), DeepSeek-V3 `model.py` (naive/absorb modes),
transformers' `GlmMoeDsaAttention` (names, RoPE pairing, DSA masking).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.attention import (
    TopK, attention_causal, attention_latent_gathered, attention_latent_masked, attention_masked, attention_reference,
    causal_mask, topk_mask, window_mask,
)
from glm5lab.model.dsa import LightningIndexer, select_topk
from glm5lab.model.norm import RMSNorm
from glm5lab.model.rope import apply_rope

if TYPE_CHECKING:
    from glm5lab.model.cache import LayerStep

ATTN_IMPLS = ("auto", "naive", "absorbed")
GATHER_MIN_KEYS_PER_TOPK = 16
ABSORBED_MAX_QUERIES = 16
"""Cached forwards of at most this many new tokens per row (decode, speculative verification)
run absorbed: per token only the 576-wide latent is read, never per-head K/V. Longer ones
(prefill chunks) expand K/V like the uncached forward."""
"""`auto` gathers the top-k keys once the context exceeds 16 x index_topk; below that a masked
SDPA over all keys is faster on CPU (measured: S=256/K=64 masked 5x faster; S=2048/K=64 gathered
1.6x faster; crossover near S = 16-24 K). Both compute exactly the same function."""


class MLAttention(nn.Module):
    """MLA self-attention of one layer; with an indexer when `has_indexer` ("full" DSA layer).
    `window`: sliding-window attention ("swa" mixer): each query sees its last `window` keys,
    densely (no DSA selection, the indexer, if any, is not run)."""

    def __init__(self, cfg: ModelConfig, *, has_indexer: bool, window: int | None = None):
        super().__init__()
        self.cfg, self.window = cfg, window
        H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank)
        self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = H, N, R, V, C
        self.scale = cfg.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (N + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, C + R, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(C, eps=1e-6)
        self.kv_b_proj = nn.Linear(C, H * (N + V), bias=False)
        self.o_proj = nn.Linear(H * V, cfg.hidden_size, bias=cfg.attention_bias)
        self.indexer = LightningIndexer(cfg) if has_indexer else None

    def project(self, x_BTD, cos_TR2, sin_TR2):
        """q_nope_BTHN, q_pe_BTHR, q_lat_BTQ, c_BTC, k_pe_BTR for the tokens in x (RoPE applied)."""
        B, T, _ = x_BTD.shape
        q_lat_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTD))
        q_BTHX = self.q_b_proj(q_lat_BTQ).view(B, T, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope_BTHN, q_pe_BTHR = q_BTHX.split([self.nope_dim, self.rope_dim], dim=-1)
        c_BTC, k_pe_BTR = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_rank, self.rope_dim], dim=-1)
        c_BTC = self.kv_a_layernorm(c_BTC)
        interleaved = self.cfg.rope_interleave
        q_pe_BTHR = apply_rope(q_pe_BTHR, cos_TR2, sin_TR2, interleaved=interleaved)
        k_pe_BTR = apply_rope(k_pe_BTR, cos_TR2, sin_TR2, interleaved=interleaved)
        return q_nope_BTHN, q_pe_BTHR, q_lat_BTQ, c_BTC, k_pe_BTR

    def expand_kv(self, c_BSC, k_pe_BSR):
        """Naive path: per-head keys k_BSHX (X = N+R) and values v_BSHV from the latent."""
        B, S, _ = c_BSC.shape
        kv_BSHY = self.kv_b_proj(c_BSC).view(B, S, self.n_heads, self.nope_dim + self.v_dim)
        k_nope_BSHN, v_BSHV = kv_BSHY.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe_BSHR = k_pe_BSR[:, :, None, :].expand(-1, -1, self.n_heads, -1)
        return torch.cat([k_nope_BSHN, k_pe_BSHR], dim=-1), v_BSHV

    def absorbed_weights(self):
        """W_uk [H, N, C] and W_uv [H, V, C], views of kv_b_proj.weight."""
        w_HYC = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w_HYC.split([self.nope_dim, self.v_dim], dim=1)

    def attend_naive(self, q_nope, q_pe, c_BSC, k_pe_BSR, *, topk: TopK | None, q_offset: int):
        """Reference: materialised per-head K/V, explicit mask (causal, and top-k when given)."""
        k_BSHX, v_BSHV = self.expand_kv(c_BSC, k_pe_BSR)
        q_BTHX = torch.cat([q_nope, q_pe], dim=-1)
        T, S = q_BTHX.shape[1], k_BSHX.shape[1]
        mask = causal_mask(T, S, q_offset, q_BTHX.device)[None]
        if topk is not None:
            mask = mask & topk_mask(topk, S)
        return attention_reference(q_BTHX, k_BSHX, v_BSHV, scale=self.scale, mask_BTS=mask)

    def attend_absorbed(self, q_nope, q_pe, c_BSC, k_pe_BSR, *, topk: TopK | None, q_offset: int,
                        gather: bool = True):
        """Fast path: attention in the latent space (one 576-wide key per token for all heads).
        With `topk`, only the selected keys are gathered (`gather`), or, for short contexts where
        that costs more, attended through a mask (`gather=False`)."""
        T, S = q_nope.shape[1], c_BSC.shape[1]
        mask_BTS = None
        if topk is not None and not gather:
            mask_BTS = causal_mask(T, S, q_offset, q_nope.device)[None] & topk_mask(topk, S)
        return self.attend_latent(q_nope, q_pe, torch.cat([c_BSC, k_pe_BSR], dim=-1), mask_BTS=mask_BTS,
                                  topk=topk if gather else None, q_offset=q_offset)

    def attend_dense(self, q_nope, q_pe, latent_BSX, mask_BTS, *, expand: bool, reference: bool = False):
        """Attention over all S keys under an explicit mask [B|1, T, S] (causal, sliding-window
        or top-k): `expand` = per-head K/V expanded from the latent [c | k_pe] (`reference`: the
        written-out softmax, else SDPA), otherwise in the latent space. Returns o_BTHV."""
        if not expand:
            return self.attend_latent(q_nope, q_pe, latent_BSX, mask_BTS=mask_BTS, topk=None)
        k_BSHX, v_BSHV = self.expand_kv(*latent_BSX.split([self.kv_rank, self.rope_dim], dim=-1))
        attend = attention_reference if reference else attention_masked
        return attend(torch.cat([q_nope, q_pe], dim=-1), k_BSHX, v_BSHV, scale=self.scale, mask_BTS=mask_BTS)

    def attend_latent(self, q_nope, q_pe, latent_BSX, *, mask_BTS, topk: TopK | None, q_offset: int = 0):
        """Absorbed attention over latents [c | k_pe] (X = C+R): q_c = q_nope W_uk, scores over
        the shared 576-wide keys, values c, output o_c W_uv^T. `topk`: gather the selected keys
        (validity encodes causality); else `mask_BTS` [B|1, T, S] (None: causal from q_offset)."""
        w_uk_HNC, w_uv_HVC = self.absorbed_weights()
        q_BTHX = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk_HNC), q_pe], dim=-1)
        if topk is not None:
            o_BTHC = attention_latent_gathered(q_BTHX, latent_BSX, v_dim=self.kv_rank, scale=self.scale, topk=topk)
        else:
            o_BTHC = attention_latent_masked(q_BTHX, latent_BSX, v_dim=self.kv_rank, scale=self.scale,
                                             mask_BTS=mask_BTS, q_offset=q_offset)
        return torch.einsum("bthc,hvc->bthv", o_BTHC, w_uv_HVC)

    def select(self, x_BTD, q_lat_BTQ, cos_TR2, sin_TR2, *, prev_topk: TopK | None) -> TopK:
        """The top-k for this layer: its own indexer ("full" layer), else the earlier full
        layer's (IndexCache "shared" layer). Selection is discrete: no gradient flows here."""
        if self.indexer is None:
            if prev_topk is None:
                raise ValueError("a 'shared' DSA layer needs the top-k of an earlier 'full' layer")
            return prev_topk
        with torch.no_grad():
            k_BSJ = self.indexer.keys(x_BTD, cos_TR2, sin_TR2)
            scores_BTS = self.indexer.scores(x_BTD, q_lat_BTQ, k_BSJ, cos_TR2, sin_TR2)
        return select_topk(scores_BTS, self.cfg.index_topk)

    def forward(self, x_BTD, cos_TR2, sin_TR2, *, prev_topk: TopK | None = None, impl: str = "auto",
                use_dsa: bool | None = None, indexer_loss: bool = False, cache: LayerStep | None = None):
        """Causal self-attention over x (positions 0..T-1). Returns (out_BTD, topk or None,
        indexer KL or None).

        With `cache` (cached decoding, see `glm5lab.model.cache`): x holds each row's new tokens,
        cos/sin their positions ([B, T, R/2]); see `forward_cached`.
        DSA is active when `use_dsa` (default: the config's) and T > index_topk (otherwise
        top-k keeps every causal key and attention is exactly dense). impl: "naive" (reference,
        as transformers' eager path), "absorbed" (latent space, gathered top-k), "auto"
        (absorbed when sparse, gathered above 16 x index_topk keys and masked SDPA below; naive
        K/V with SDPA when dense). `indexer_loss` (layers with an
        indexer): also return the DSA indexer's KL to this layer's attention, see `indexer_kl`.
        Raises ValueError for an unknown impl."""
        if impl not in ATTN_IMPLS:
            raise ValueError(f"attention impl {impl!r} is not allowed: one of {ATTN_IMPLS}")
        B, T, _ = x_BTD.shape
        use_dsa = (self.cfg.use_dsa if use_dsa is None else use_dsa) and self.window is None
        if cache is not None:
            if indexer_loss:
                raise ValueError("indexer_loss is a training loss: it is not computed in cached decoding")
            out_BTD, topk = self.forward_cached(x_BTD, cos_TR2, sin_TR2, cache, prev_topk=prev_topk, impl=impl,
                                                use_dsa=use_dsa)
            return out_BTD, topk, None
        q_nope, q_pe, q_lat, c_BTC, k_pe_BTR = self.project(x_BTD, cos_TR2, sin_TR2)
        if self.window is not None:
            mask_BTS = window_mask(T, T, 0, self.window, x_BTD.device)[None]
            expand = impl == "naive" or (impl == "auto" and T > ABSORBED_MAX_QUERIES)
            o_BTHV = self.attend_dense(q_nope, q_pe, torch.cat([c_BTC, k_pe_BTR], dim=-1), mask_BTS, expand=expand,
                                       reference=impl == "naive")
            return self.o_proj(o_BTHV.reshape(B, T, -1)), None, None
        topk = None
        if use_dsa and T > self.cfg.index_topk:
            topk = self.select(x_BTD, q_lat, cos_TR2, sin_TR2, prev_topk=prev_topk)
        if impl == "naive":
            o_BTHV = self.attend_naive(q_nope, q_pe, c_BTC, k_pe_BTR, topk=topk, q_offset=0)
        elif impl == "absorbed" or topk is not None:
            gather = impl == "absorbed" or T > GATHER_MIN_KEYS_PER_TOPK * self.cfg.index_topk
            o_BTHV = self.attend_absorbed(q_nope, q_pe, c_BTC, k_pe_BTR, topk=topk, q_offset=0, gather=gather)
        else:
            k_BTHX, v_BTHV = self.expand_kv(c_BTC, k_pe_BTR)
            q_BTHX = torch.cat([q_nope, q_pe], dim=-1)
            o_BTHV = attention_causal(q_BTHX, k_BTHX, v_BTHV, scale=self.scale)
        kl = None
        if indexer_loss and self.indexer is not None:
            kl = self.indexer_kl(x_BTD, q_lat, (q_nope, q_pe, c_BTC, k_pe_BTR), cos_TR2, sin_TR2, topk=topk)
        return self.o_proj(o_BTHV.reshape(B, T, -1)), topk, kl

    def forward_cached(self, x_BTD, cos_BTR2, sin_BTR2, cache: LayerStep, *, prev_topk: TopK | None,
                       impl: str, use_dsa: bool):
        """Cached attention of each row's T new tokens over its cached tokens and themselves.
        Returns (out_BTD, topk or None). Writes the new latents (and indexer keys on a full layer)
        into `cache`. DSA is active when `use_dsa` and the cache extent S > index_topk; every
        query then keeps its top-k of the causal keys (all of them while it has <= index_topk).
        impl "naive": per-head K/V expanded from the latent, explicit mask (the reference);
        "absorbed": latent-space attention, gathered top-k; "auto": absorbed for steps of up to
        ABSORBED_MAX_QUERIES tokens, else as the uncached forward (prefill chunks)."""
        B, T, _ = x_BTD.shape
        q_nope, q_pe, q_lat, c_BTC, k_pe_BTR = self.project(x_BTD, cos_BTR2, sin_BTR2)
        latent_BSX = cache.write("latent", torch.cat([c_BTC, k_pe_BTR], dim=-1))
        S, offsets_B = latent_BSX.shape[1], cache.offsets_B
        index_keys_BSJ = None
        if self.indexer is not None and cache.has("index_keys"):
            index_keys_BSJ = cache.write("index_keys", self.indexer.keys(x_BTD, cos_BTR2, sin_BTR2))
        topk = None
        if use_dsa and S > self.cfg.index_topk:
            if self.indexer is None:
                topk = self.select(x_BTD, q_lat, cos_BTR2, sin_BTR2, prev_topk=prev_topk)
            elif index_keys_BSJ is None:
                raise ValueError("DSA is on but this cache holds no indexer keys (built for a dense model)")
            else:
                scores_BTS = self.indexer.scores(x_BTD, q_lat, index_keys_BSJ, cos_BTR2, sin_BTR2, q_offset=offsets_B)
                topk = select_topk(scores_BTS, self.cfg.index_topk, q_offset=offsets_B)
        mask_BTS = cache.causal_mask(self.window)
        gather = topk is not None and impl != "naive" and (
            impl == "absorbed" or T <= ABSORBED_MAX_QUERIES or S > GATHER_MIN_KEYS_PER_TOPK * self.cfg.index_topk)
        if gather:
            o_BTHV = self.attend_latent(q_nope, q_pe, latent_BSX, mask_BTS=None, topk=topk)
        else:
            if topk is not None:
                mask_BTS = mask_BTS & topk_mask(topk, S)
            expand = impl == "naive" or (impl == "auto" and T > ABSORBED_MAX_QUERIES and topk is None)
            o_BTHV = self.attend_dense(q_nope, q_pe, latent_BSX, mask_BTS, expand=expand, reference=impl == "naive")
        return self.o_proj(o_BTHV.reshape(B, T, -1)), topk

    def indexer_kl(self, x_BTD, q_lat_BTQ, projected, cos_TR2, sin_TR2, *, topk: TopK | None) -> torch.Tensor:
        """DSA indexer training loss (DeepSeek-V3.2, section 2.1): mean over queries of
        KL(p || softmax(index scores)), p = this layer's attention probabilities summed over heads
        and L1-normalised. Dense (warm-up): over all causal keys; sparse (`topk` given): both
        restricted to the selected keys. The indexer's inputs are detached, so this loss trains the
        indexer only, and p carries no gradient. Returns a scalar fp32 tensor."""
        q_nope, q_pe, c_BTC, k_pe_BTR = projected
        T = x_BTD.shape[1]
        keep_BTS = causal_mask(T, T, 0, x_BTD.device)[None]
        if topk is not None:
            keep_BTS = keep_BTS & topk_mask(topk, T)
        with torch.no_grad():
            w_uk_HNC, _ = self.absorbed_weights()
            q_BTHX = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk_HNC), q_pe], dim=-1).float()
            k_BTX = torch.cat([c_BTC, k_pe_BTR], dim=-1).float()
            logits_BHTS = torch.einsum("bthx,bsx->bhts", q_BTHX, k_BTX) * self.scale
            probs_BHTS = logits_BHTS.masked_fill(~keep_BTS[:, None], float("-inf")).softmax(-1)
            target_BTS = probs_BHTS.sum(1) / probs_BHTS.shape[1]
        x_in, q_lat_in = x_BTD.detach(), q_lat_BTQ.detach()
        k_BSJ = self.indexer.keys(x_in, cos_TR2, sin_TR2)
        scores_BTS = self.indexer.scores(x_in, q_lat_in, k_BSJ, cos_TR2, sin_TR2)
        return kl_to_indexer(target_BTS, scores_BTS, keep_BTS)


def kl_to_indexer(target_BTS: torch.Tensor, scores_BTS: torch.Tensor, keep_BTS: torch.Tensor) -> torch.Tensor:
    """mean_{b,t} sum_s p log(p / q), q = softmax of `scores_BTS` over the kept keys (fp32).
    target_BTS: a distribution over the kept keys (zero elsewhere). Terms with p = 0 count 0."""
    log_q_BTS = scores_BTS.float().masked_fill(~keep_BTS, float("-inf")).log_softmax(-1)
    p_log_p = torch.xlogy(target_BTS, target_BTS)
    p_log_q = (target_BTS * log_q_BTS.masked_fill(~keep_BTS, 0.0))
    return (p_log_p - p_log_q).sum(-1).mean()
