"""Multi-head Latent Attention (MLA) with DSA.

Legend: B batch, T queries, S keys, H heads, N no-RoPE q/k width (`qk_nope_head_dim`), R RoPE width
(`qk_rope_head_dim`), V value width (`v_head_dim`), C kv latent (`kv_lora_rank`), Q q latent (`q_lora_rank`).

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

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.model.attention import (
    attention_latent_gathered, attention_latent_masked, attention_masked, attention_reference, topk_mask,
)
from glm5lab.model.attention_blocked import attention_expanded_blocked
from glm5lab.model.dsa import LightningIndexer
from glm5lab.model.fp8_keys import Fp8Keys
from glm5lab.model.index_distill import Teacher
from glm5lab.model.norm import RMSNorm
from glm5lab.model.rope import apply_rope
from glm5lab.model.step import LayerStep
from glm5lab.model.topk import TopK
from glm5lab.model.visibility import narrow_queries, visible

ATTN_IMPLS = ("auto", "naive", "absorbed")
"""Model-level choice of attention kernels (`GLM5ForCausalLM.forward(attn_impl=)`): "naive" sets
`Step.reference` (every mixer runs its reference), "absorbed" sets `Step.absorbed` (MLA only)."""
GATHER_MIN_KEYS_PER_TOPK = 4
"""Longer forwards gather the top-k keys once the keys exceed 4 x index_topk; below that a
masked SDPA over all keys is faster on CPU (BENCHMARKS.md, "Kernel choices"). Both compute
exactly the same function."""
ROUTES = ("reference", "expanded", "expanded_blocked", "latent_masked", "latent_gathered")
KEY_BLOCK = 4096
"""Cached keys whose per-head K/V the "expanded_blocked" route expands at a time (`attention_expanded_blocked`):
4096 x H x (N+R+V) fp32 values, 64 MiB at the bench preset's 8 heads, 512 MiB at GLM-5's 64."""
DENSE_KL_BLOCK_ELEMENTS = 2**26
"""The dense indexer KL (the warm-up's) runs in blocks of queries once its [B, heads, T, S] logits or index dots
would pass this many fp32 values (256 MiB): a 202,752-token sequence's warm-up would otherwise hold tens of GB
per layer (with CP too: the local queries over all keys)."""


def latent_max_queries(cfg: ModelConfig) -> int:
    """The most queries per row for which a cached call's latent route costs fewer FLOPs than its expanded one,
    per cached key and head: latent = T x 2(C+R) (the 576-wide latent as key and as value) against expanded =
    C(N+V) (re-expanding the key through kv_b_proj, every call) + T x (N+R+V). T <= C(N+V) / (2(C+R) - (N+R+V)):
    358 at GLM-5's widths (and the bench preset's); this CPU's break-even for 256-query calls over 8K keys lies
    between 384 and 512 (BENCHMARKS.md, "Cached prefill"). Uncached calls expand each key once, so the expanded
    route stays theirs."""
    C, R, N, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    extra = 2 * (C + R) - (N + R + V)
    return C * (N + V) // extra if extra > 0 else cfg.max_position_embeddings


def attention_route(*, reference: bool, absorbed: bool, sparse: bool, decode_sized: bool, S: int,
                    index_topk: int, cached: bool, T: int, latent_max_T: int, one_offset: bool = False) -> str:
    """The kernel of one MLA attention call: the route table. decode_sized: at most `DECODE_MAX_TOKENS` (16)
    queries per row (`Step.decode_sized`: decode, verification: per token only the 576-wide latent is read, never
    per-head K/V); S keys (the cache extent, or T uncached); `sparse`: DSA selected top-k keys for this call;
    `cached`: the call reads a cache (a prefill chunk, SWA's [ring | chunk] included); T queries per row;
    latent_max_T: `latent_max_queries` of the layer's config; one_offset: a cached full-attention call (no
    window) whose rows all start at one position (`Step.common_offset`: a prefill's chunks).

        reference  absorbed  top-k  decode-sized  S (keys)     cached, T        route
        yes        -         any    any           any          any              reference
        no         yes       yes    any           any          any              latent_gathered
        no         yes       no     any           any          any              latent_masked
        no         no        yes    yes           any          any              latent_gathered
        no         no        yes    no            > 4 x topk   any              latent_gathered
        no         no        yes    no            <= 4 x topk  any              latent_masked (mask: visible & top-k)
        no         no        no     yes           any          any              latent_masked
        no         no        no     no            any          cached, T <= max latent_masked (no re-expansion)
        no         no        no     no            any          cached, one offset  expanded_blocked
        no         no        no     no            any          otherwise        expanded

    reference: per-head K/V expanded from the latent, explicit boolean mask, written-out softmax
    (`attention_reference`; transformers' eager path). expanded: the same K/V through SDPA (`is_causal` for an
    uncached full-attention call, else the mask). expanded_blocked: the same K/V expanded `KEY_BLOCK` cached keys at
    a time, the chunk's own keys under `is_causal`, no mask (`attention_expanded_blocked`). latent_masked: absorbed
    attention over the 576-wide latents under the mask (`attention_latent_masked`). latent_gathered: absorbed
    attention over each query's gathered top-k latents only (`attention_latent_gathered`, DSA's core attention). The
    sliding window enters only through the mask (`Step.mask`): a cached call is the uncached one at offsets > 0, but
    a cached dense call of up to latent_max_T queries attends in the latent space, since the expanded route would
    re-expand the per-head K/V of every cached key for every call (quadratic over a chunked prefill). All routes
    compute the same function (tests/model/test_mla.py ties each to the reference)."""
    if reference:
        return "reference"
    if absorbed:
        return "latent_gathered" if sparse else "latent_masked"
    if decode_sized:
        return "latent_gathered" if sparse else "latent_masked"
    if sparse:
        return "latent_gathered" if S > GATHER_MIN_KEYS_PER_TOPK * index_topk else "latent_masked"
    if cached and T <= latent_max_T:
        return "latent_masked"
    return "expanded_blocked" if cached and one_offset else "expanded"


class MLAttention(nn.Module):
    """MLA self-attention of one layer (`spec`: its window, indexer role and whether it holds
    indexer weights; see `glm5lab.config.LayerSpec`)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.cfg, self.spec, self.window = cfg, spec, spec.window
        H, N, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank)
        self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = H, N, R, V, C
        self.scale = cfg.qk_head_dim**-0.5
        self.latent_max_T = latent_max_queries(cfg)
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (N + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, C + R, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(C, eps=1e-6)
        self.kv_b_proj = nn.Linear(C, H * (N + V), bias=False)
        self.o_proj = nn.Linear(H * V, cfg.hidden_size, bias=cfg.attention_bias)
        self.indexer = LightningIndexer(cfg) if spec.has_indexer_weights else None

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
        """Per-head keys k_BSHX (X = N+R) and values v_BSHV expanded from the latent."""
        B, S, _ = c_BSC.shape
        kv_BSHY = self.kv_b_proj(c_BSC).view(B, S, self.n_heads, self.nope_dim + self.v_dim)
        k_nope_BSHN, v_BSHV = kv_BSHY.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe_BSHR = k_pe_BSR[:, :, None, :].expand(-1, -1, self.n_heads, -1)
        return torch.cat([k_nope_BSHN, k_pe_BSHR], dim=-1), v_BSHV

    def absorbed_weights(self):
        """W_uk [H, N, C] and W_uv [H, V, C], views of kv_b_proj.weight."""
        w_HYC = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w_HYC.split([self.nope_dim, self.v_dim], dim=1)

    def absorbed_query(self, q_nope_BTHN, q_pe_BTHR):
        """q_BTHX = [q_nope W_uk | q_pe] (X = C+R): the query against the latent keys [c | k_pe]."""
        w_uk_HNC, _ = self.absorbed_weights()
        return torch.cat([torch.einsum("bthn,hnc->bthc", q_nope_BTHN, w_uk_HNC), q_pe_BTHR], dim=-1)

    def select(self, x_BTD, q_lat_BTQ, index_keys_BSJ, step: LayerStep) -> TopK | None:
        """This layer's DSA top-k, or None when DSA is off for this call (off, a layer that selects nothing,
        or S <= index_topk: every query then keeps all its causal keys). An "own" layer scores the keys with
        its indexer; a "shared" layer reuses `step.topk`, the last "own" layer's, handed on to it (IndexCache).
        Selection is discrete: no gradient flows through it."""
        role = self.spec.indexer
        if not step.use_dsa or role == "none" or step.extent <= step.index_topk:
            return None
        if role == "shared":
            if step.topk is None:
                raise ValueError("a 'shared' DSA layer needs the top-k of an earlier 'own' layer in the same forward")
            return step.topk
        with torch.no_grad():
            return self.indexer.topk(x_BTD, q_lat_BTQ, index_keys_BSJ, step.cos, step.sin, step.index_topk,
                                     q_offset=step.offsets, blocked=not (step.decode_sized or step.static))

    def index_keys(self, x_BTD, step: LayerStep) -> torch.Tensor | Fp8Keys | None:
        """The indexer keys of all S keys ([B, S, J]; `Fp8Keys` from an fp8 index cache) on an "own" layer: written
        to the cache whenever it keeps them (later steps score them), computed uncached only when DSA runs (then
        from the detached input: selection takes no gradient, and the indexer KL reuses them, training the indexer only;
        under CP gathered from the group)."""
        if self.spec.indexer != "own":
            return None
        if step.cached:
            if "index_keys" not in step.state.buffers:
                if step.use_dsa:
                    raise ValueError("DSA is on but this cache holds no indexer keys (built for a dense model)")
                return None
            return step.write("index_keys", self.indexer.keys(x_BTD, step.cos, step.sin))
        if not (step.use_dsa and step.extent > step.index_topk):
            return None
        return step.write("index_keys", self.indexer.keys(x_BTD.detach(), step.cos, step.sin))

    def forward(self, x_BTD: torch.Tensor, step: LayerStep) -> tuple[torch.Tensor, TopK | None, torch.Tensor | None]:
        """Causal self-attention of each row's T new tokens over its S visible keys (`step`, see
        `glm5lab.model.step`: uncached = offset 0 and S = T). Returns (out_BTD, the selection to hand on: this
        layer's on an "own" layer, else `step.topk`; the indexer KL (`indexer_kl`) of an "own" layer under
        `step.indexer_loss` (uncached), else None). Writes the new latents (and indexer keys where the cache keeps
        them) to the step's cache. DSA is active when `step.use_dsa`, the layer selects ("own"/"shared") and S >
        index_topk. The kernel is `attention_route`'s. Raises ValueError when DSA is on for a cache without
        indexer keys, or for a "shared" layer with no earlier selection."""
        q_nope, q_pe, q_lat, c_BTC, k_pe_BTR = self.project(x_BTD, step.cos, step.sin)
        latent_BSX = step.write("latent", torch.cat([c_BTC, k_pe_BTR], dim=-1))
        index_keys_BSJ = self.index_keys(x_BTD, step)
        topk = self.select(x_BTD, q_lat, index_keys_BSJ, step)
        S, T = latent_BSX.shape[1], x_BTD.shape[1]
        one_offset = (step.cached and self.window is None and topk is None and T > self.latent_max_T
                      and step.common_offset() is not None)  # the host read only where the route can use it
        route = attention_route(reference=step.reference, absorbed=step.absorbed, sparse=topk is not None,
                                decode_sized=step.decode_sized, S=S, index_topk=step.index_topk, cached=step.cached,
                                T=T, latent_max_T=self.latent_max_T, one_offset=one_offset)
        o_BTHV = self.attend(route, q_nope, q_pe, latent_BSX, topk, step)
        own = self.spec.indexer == "own"
        out_BTD = self.o_proj(o_BTHV.flatten(2))
        if step.indexer_loss and step.indexer_target == "served" and self.spec.indexer != "none":
            return (out_BTD, *self.served_kl(x_BTD, q_lat, (q_nope, q_pe, latent_BSX), step, topk, index_keys_BSJ))
        kl = (self.indexer_kl(x_BTD, q_lat, (q_nope, q_pe, latent_BSX), step, topk=topk, index_keys_BSJ=index_keys_BSJ)
              if own and step.indexer_loss else None)
        return out_BTD, topk if own else step.handoff, kl

    def served_kl(self, x_BTD, q_lat_BTQ, projected, step: LayerStep, topk: TopK | None, index_keys_BSJ):
        """Multi-layer distillation (`glm5lab.model.index_distill`): (what to hand on, this layer's KL). An own
        layer: a `Teacher` (its top-k, its index scores with their gradient) and KL(p_own || q); a shared layer:
        the teacher handed to it and KL(p_this || q of that teacher), p without gradient on the teacher's keys."""
        sparse = topk is not None and not step.reference
        if self.spec.indexer == "own":
            if index_keys_BSJ is None:
                index_keys_BSJ = step.write("index_keys", self.indexer.keys(x_BTD.detach(), step.cos, step.sin))
            x, q_lat = x_BTD.detach(), q_lat_BTQ.detach()
            scores = (self.indexer.scores_at(x, q_lat, index_keys_BSJ, step.cos, step.sin, topk.idx_BTK) if sparse
                      else self.indexer.scores(x, q_lat, index_keys_BSJ, step.cos, step.sin, q_offset=step.offsets))
            teacher = Teacher(topk, scores)
        else:
            teacher = step.teacher
            if teacher is None:
                raise ValueError("a 'shared' DSA layer under indexer_target 'served' needs the scores of an earlier "
                                 "'own' layer in the same forward")
        target, keep = self.attention_target(*projected, step.offsets, topk, sparse=sparse)
        return teacher, step.token_mean(kl_to_indexer(target, teacher.scores, keep))

    @torch.no_grad()
    def attention_target(self, q_nope, q_pe, latent_BSX, offsets, topk: TopK | None, *, sparse: bool):
        """(p, keep): this layer's attention probabilities averaged over heads, fp32 without gradient (the indexer
        KL's target, DeepSeek-V3.2 section 2.1), and the keys they cover. sparse: [B, T, K] at topk's keys, keep
        its valid slots [B, T, K]; else [B, T, S] over the keys visible to queries at `offsets`
        (`glm5lab.model.visibility`), and topk's when given; keep that mask [B|1, T, S]. The dense form holds
        [B, H, T, S] fp32 logits."""
        q_BTHX = self.absorbed_query(q_nope, q_pe).float()
        if sparse:
            rows_B11 = torch.arange(q_BTHX.shape[0], device=q_BTHX.device)[:, None, None]
            kv_BTKX = latent_BSX.float()[rows_B11, topk.idx_BTK]
            logits_BTHK = torch.einsum("bthx,btkx->bthk", q_BTHX, kv_BTKX) * self.scale
            probs_BTHK = logits_BTHK.masked_fill(~topk.valid_BTK[:, :, None], float("-inf")).softmax(-1)
            return probs_BTHK.mean(2), topk.valid_BTK
        S = latent_BSX.shape[1]
        keep_BTS = visible(offsets, q_BTHX.shape[1], S, device=q_BTHX.device)
        if topk is not None:
            keep_BTS = keep_BTS & topk_mask(topk, S)
        logits_BHTS = torch.einsum("bthx,bsx->bhts", q_BTHX, latent_BSX.float()) * self.scale
        probs_BHTS = logits_BHTS.masked_fill(~keep_BTS[:, None], float("-inf")).softmax(-1)
        return probs_BHTS.sum(1) / probs_BHTS.shape[1], keep_BTS

    def attend(self, route: str, q_nope, q_pe, latent_BSX, topk: TopK | None, step: LayerStep) -> torch.Tensor:
        """o_BTHV of one `attention_route` route over the latents [c | k_pe] of all S keys."""
        S = latent_BSX.shape[1]
        if route == "expanded_blocked":
            return self.attend_blocked(q_nope, q_pe, latent_BSX, topk, step)
        plain_causal = step.causal_prefix and self.window is None and topk is None  # SDPA's is_causal
        no_mask = plain_causal or route == "latent_gathered"  # the top-k slots are the gathered keys' mask
        mask_BTS = None if no_mask else step.mask(self.window)
        if topk is not None and route != "latent_gathered":
            mask_BTS = mask_BTS & topk_mask(topk, S)
        if route in ("reference", "expanded"):
            k_BSHX, v_BSHV = self.expand_kv(*latent_BSX.split([self.kv_rank, self.rope_dim], dim=-1))
            q_BTHX = torch.cat([q_nope, q_pe], dim=-1)
            if route == "reference":
                mask_BTS = step.mask(self.window) if mask_BTS is None else mask_BTS
                return attention_reference(q_BTHX, k_BSHX, v_BSHV, scale=self.scale, mask_BTS=mask_BTS)
            return attention_masked(q_BTHX, k_BSHX, v_BSHV, scale=self.scale, mask_BTS=mask_BTS)
        q_BTHX = self.absorbed_query(q_nope, q_pe)
        if route == "latent_gathered":
            o_BTHC = attention_latent_gathered(q_BTHX, latent_BSX, v_dim=self.kv_rank, scale=self.scale, topk=topk)
        else:
            o_BTHC = attention_latent_masked(q_BTHX, latent_BSX, v_dim=self.kv_rank, scale=self.scale,
                                             mask_BTS=mask_BTS)
        return torch.einsum("bthc,hvc->bthv", o_BTHC, self.absorbed_weights()[1])

    def attend_blocked(self, q_nope, q_pe, latent_BSX, topk: TopK | None, step: LayerStep) -> torch.Tensor:
        """o_BTHV of the "expanded_blocked" route. Raises ValueError for a call it does not fit (a top-k, a
        window, rows at different offsets)."""
        offset = step.common_offset()
        if topk is not None or self.window is not None or offset is None:
            raise ValueError("the expanded_blocked route is for cached full-attention calls whose rows share one "
                             f"offset, got top-k {topk is not None}, window {self.window}, offset {offset}")
        C, R = self.kv_rank, self.rope_dim
        return attention_expanded_blocked(torch.cat([q_nope, q_pe], dim=-1), latent_BSX,
                                          lambda lat_BSX: self.expand_kv(*lat_BSX.split([C, R], dim=-1)),
                                          scale=self.scale, offset=offset, block=KEY_BLOCK)

    def indexer_kl(self, x_BTD, q_lat_BTQ, projected, step: LayerStep, *, topk: TopK | None,
                   index_keys_BSJ: torch.Tensor | None = None) -> torch.Tensor:
        """DSA indexer training loss (DeepSeek-V3.2, section 2.1): mean over queries of KL(p || softmax(index
        scores)), p = this layer's attention probabilities summed over heads and L1-normalised. Dense
        (warm-up): over all causal keys; sparse (`topk` given): both restricted to the selected keys, computed
        at those keys only (`indexer_kl_sparse`, O(T K)) unless `step.reference` (the dense-mask reference
        below: [B, H, T, S] logits, scores at every key, the same value; past `DENSE_KL_BLOCK_ELEMENTS` per
        forward, in blocks of queries, each recomputed in the backward (activation checkpointing), so a long
        sequence's warm-up holds one block's [B, H | I, t, S] at a time). projected: (q_nope, q_pe, latent_BSX:
        the [c | k_pe] of all S keys); index_keys_BSJ: the indexer keys of all S keys from the detached input
        (`index_keys`; None: computed here). The indexer's inputs are detached, so this loss trains the
        indexer only, and p carries no gradient. Under CP: the local queries over the gathered keys, the mean
        being this rank's share (`Step.token_mean`). Returns a scalar fp32 tensor."""
        if index_keys_BSJ is None:
            index_keys_BSJ = step.write("index_keys", self.indexer.keys(x_BTD.detach(), step.cos, step.sin))
        if topk is not None and not step.reference:
            return self.indexer_kl_sparse(x_BTD, q_lat_BTQ, projected, step, topk, index_keys_BSJ)
        q_nope, q_pe, latent_BSX = projected
        (B, T), S = x_BTD.shape[:2], latent_BSX.shape[1]
        rows = (x_BTD.detach(), q_lat_BTQ.detach(), q_nope.detach(), q_pe.detach())
        keys = (latent_BSX.detach(), index_keys_BSJ)
        tq = max(1, DENSE_KL_BLOCK_ELEMENTS // (B * max(self.n_heads, self.indexer.n_heads) * S))
        if tq >= T:
            return step.token_mean(self._dense_kl(*rows, *keys, step.cos, step.sin, step.offsets, topk))
        parts = []
        for t0 in range(0, T, tq):
            t = min(tq, T - t0)
            part = None if topk is None else TopK(topk.idx_BTK[:, t0:t0 + t], topk.valid_BTK[:, t0:t0 + t])
            parts.append(checkpoint(self._dense_kl, *(r[:, t0:t0 + t] for r in rows), *keys, step.cos[t0:t0 + t],
                                    step.sin[t0:t0 + t], narrow_queries(step.offsets, t0, t), part,
                                    use_reentrant=False))
        return step.token_mean(torch.cat(parts, dim=1))

    def _dense_kl(self, x_BTD, q_lat_BTQ, q_nope, q_pe, latent_BSX, index_keys_BSJ, cos_TR2, sin_TR2, offsets,
                  topk: TopK | None) -> torch.Tensor:
        """fp32 [B, T]: the dense-form KL of each of T queries (at `offsets`: `glm5lab.model.visibility`) over the
        S keys, restricted to `topk`'s keys when given; inputs detached but the indexer keys."""
        target_BTS, keep_BTS = self.attention_target(q_nope, q_pe, latent_BSX, offsets, topk, sparse=False)
        scores_BTS = self.indexer.scores(x_BTD, q_lat_BTQ, index_keys_BSJ, cos_TR2, sin_TR2, q_offset=offsets)
        return kl_to_indexer(target_BTS, scores_BTS, keep_BTS)

    def indexer_kl_sparse(self, x_BTD, q_lat_BTQ, projected, step: LayerStep, topk: TopK,
                          index_keys_BSJ: torch.Tensor) -> torch.Tensor:
        """`indexer_kl` of the sparse stage over the K selected keys of each query: the target from
        the absorbed logits at the gathered latents, the index scores from
        `LightningIndexer.scores_at`. Same value and indexer gradients as the dense-mask form."""
        target_BTK, _ = self.attention_target(*projected, step.offsets, topk, sparse=True)
        scores_BTK = self.indexer.scores_at(x_BTD.detach(), q_lat_BTQ.detach(), index_keys_BSJ, step.cos, step.sin,
                                            topk.idx_BTK)
        return step.token_mean(kl_to_indexer(target_BTK, scores_BTK, topk.valid_BTK))


def kl_to_indexer(target_BTS: torch.Tensor, scores_BTS: torch.Tensor, keep_BTS: torch.Tensor) -> torch.Tensor:
    """fp32 [B, T]: per query sum_s p log(p / q), q = softmax of `scores_BTS` over the kept keys.
    target_BTS: a distribution over the kept keys (zero elsewhere). Terms with p = 0 count 0."""
    log_q_BTS = scores_BTS.float().masked_fill(~keep_BTS, float("-inf")).log_softmax(-1)
    p_log_p = torch.xlogy(target_BTS, target_BTS)
    p_log_q = (target_BTS * log_q_BTS.masked_fill(~keep_BTS, 0.0))
    return (p_log_p - p_log_q).sum(-1)
