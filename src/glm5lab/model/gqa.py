"""Grouped-query attention: the baseline the report compares MLA with (GLM-4.5, the GQA-8 proxy).

Legend: B batch, T new positions, S keys (the cache extent; T uncached), H query heads, G KV
heads, X q/k head width (`qk_head_dim` = no-RoPE N + RoPE R; RoPE covers the last R dims), V value width.
Cache per token per layer: G * (X + V) values (GQA-8 in the report: 8 * (128 + 128) = 2048).
Source: Ainslie et al. 2023 (GQA); GLM-4.5 (qkv bias, optional per-head QK RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.model.attention import attention_causal, attention_masked, attention_reference
from glm5lab.model.norm import RMSNorm
from glm5lab.model.rope import apply_rope
from glm5lab.model.step import LayerStep


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.cfg, self.window = cfg, spec.window
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

    def forward(self, x_BTD: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Causal GQA of each row's T new tokens over its S visible keys (`step`, see `glm5lab.model.step`;
        uncached = offset 0). Returns out_BTD. Their K/V are written to the step's cache (under context
        parallelism: gathered from the group, G (X + V) values per token, as one process caches them). `step.reference`: the
        written-out masked softmax, else SDPA (with `is_causal` for an uncached full-attention call). The layer's
        `window` (an "swa" layer) limits each query to its last `window` keys. GQA layers never select keys."""
        B, T, _ = x_BTD.shape
        q_BTHX = self.q_proj(x_BTD).view(B, T, self.n_heads, self.x_dim)
        k_BTGX = self.k_proj(x_BTD).view(B, T, self.n_kv, self.x_dim)
        v_BTGV = self.v_proj(x_BTD).view(B, T, self.n_kv, self.v_dim)
        if self.q_norm is not None:
            q_BTHX, k_BTGX = self.q_norm(q_BTHX), self.k_norm(k_BTGX)
        q_BTHX, k_BTGX = self._rope(q_BTHX, step.cos, step.sin), self._rope(k_BTGX, step.cos, step.sin)
        k_BSGX, v_BSGV = step.write("k", k_BTGX), step.write("v", v_BTGV)
        if step.reference:
            o_BTHV = attention_reference(q_BTHX, k_BSGX, v_BSGV, scale=self.scale, mask_BTS=step.mask(self.window))
        elif step.causal_prefix and self.window is None:
            o_BTHV = attention_causal(q_BTHX, k_BSGX, v_BSGV, scale=self.scale)
        else:
            o_BTHV = attention_masked(q_BTHX, k_BSGX, v_BSGV, scale=self.scale, mask_BTS=step.mask(self.window))
        return self.o_proj(o_BTHV.flatten(2))  # flatten, not reshape(B, T, -1): a CP rank's MTP depth may hold T = 0
