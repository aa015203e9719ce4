"""Grouped-query attention: the baseline the report compares MLA with (GLM-4.5, the GQA-8 proxy).

Legend: B batch, T positions, H query heads, G KV heads, X q/k head width (`qk_head_dim` =
no-RoPE N + RoPE R; RoPE covers the last R dims), V value width.
Cache per token per layer: G * (X + V) values (GQA-8 in the report: 8 * (128 + 128) = 2048).
Source: Ainslie et al. 2023 (GQA); GLM-4.5 (qkv bias, optional per-head QK RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.attention import attention_causal, attention_masked, attention_reference, causal_mask, window_mask
from glm5lab.model.norm import RMSNorm
from glm5lab.model.rope import apply_rope

GQA_IMPLS = ("auto", "naive", "absorbed")


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, window: int | None = None):
        super().__init__()
        self.cfg, self.window = cfg, window
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.x_dim, self.v_dim, self.rope_dim = cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        self.scale = cfg.qk_head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.x_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.x_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.v_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.x_dim, eps=cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(self.x_dim, eps=cfg.rms_norm_eps) if cfg.use_qk_norm else None

    def _rope(self, x, cos, sin):
        nope, pe = x.split([self.x_dim - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([nope, apply_rope(pe, cos, sin, interleaved=self.cfg.rope_interleave)], dim=-1)

    def forward(self, x_BTD, cos_TR2, sin_TR2, *, prev_topk=None, impl: str = "auto", use_dsa=None,
                indexer_loss: bool = False, cache=None):
        """Causal GQA over x. Returns (out_BTD, None, None): GQA layers never select keys.
        impl "naive" = explicit masked softmax (reference); otherwise SDPA. `window` (set at
        construction): sliding-window attention over the last `window` keys. With `cache` (a
        `LayerStep`): x holds each row's new tokens, their K/V are appended to the cache and
        attention runs over everything cached (cos/sin [B, T, R/2])."""
        if impl not in GQA_IMPLS:
            raise ValueError(f"attention impl {impl!r} is not allowed: one of {GQA_IMPLS}")
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, self.n_heads, self.x_dim)
        k = self.k_proj(x_BTD).view(B, T, self.n_kv, self.x_dim)
        v = self.v_proj(x_BTD).view(B, T, self.n_kv, self.v_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, cos_TR2, sin_TR2), self._rope(k, cos_TR2, sin_TR2)
        if cache is not None or self.window is not None:
            if cache is not None:
                k, v = cache.write("k", k), cache.write("v", v)
                mask_BTS = cache.causal_mask(self.window)
            else:
                mask_BTS = window_mask(T, T, 0, self.window, x_BTD.device)[None]
            attend = attention_reference if impl == "naive" else attention_masked
            o = attend(q, k, v, scale=self.scale, mask_BTS=mask_BTS)
        elif impl == "naive":
            o = attention_reference(q, k, v, scale=self.scale, mask_BTS=causal_mask(T, T, 0, x_BTD.device)[None])
        else:
            o = attention_causal(q, k, v, scale=self.scale)
        return self.o_proj(o.reshape(B, T, -1)), None, None
