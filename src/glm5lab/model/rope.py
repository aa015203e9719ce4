"""Rotary position embedding with explicit pairing.

Legend: B batch, T positions, H heads, R rotary width (`qk_rope_head_dim`).

Two pairings exist and both are used in the field:
- "interleaved" (GLM-5 MLA and GLM-5 indexer, DeepSeek-V3 MLA): pairs (x0,x1), (x2,x3), ...
  Like transformers' `apply_rotary_pos_emb_interleave`, the output is written de-interleaved,
  [even rotated | odd rotated]. Applied to q and k alike this permutation leaves every q.k dot
  product equal to the textbook interleaved rotation, and it makes our cached keys bit-identical
  to transformers'.
- "half" (Llama, DeepSeek-V3.2 indexer): pairs (x_i, x_{i+R/2}).
Frequencies: inv_freq_j = theta^(-2j/R), j < R/2 (plain RoPE; no YaRN).
"""

from __future__ import annotations

import torch


def rope_angles(positions_T: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, R/2] (fp32) for integer positions `positions_T` (any int dtype);
    [B, T] positions (one row per sequence, as in cached decoding) give [B, T, R/2]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions_T.device, dtype=torch.float) / rope_dim))
    freqs_TR2 = positions_T.float()[..., None] * inv_freq
    return freqs_TR2.cos(), freqs_TR2.sin()


def apply_rope(x_BTHR: torch.Tensor, cos_TR2: torch.Tensor, sin_TR2: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of `x_BTHR` ([B, T, H, R] or [B, T, R]) by position.

    cos/sin are [T, R/2] (or [B, T, R/2], per-row positions) from `rope_angles`; the result has x's shape and
    dtype. With `interleaved=True` the output layout is [rotated evens | rotated odds] (see module doc)."""
    squeeze = x_BTHR.dim() == 3
    x = x_BTHR.unsqueeze(2) if squeeze else x_BTHR
    cos = cos_TR2.to(x.dtype).unsqueeze(-2)
    sin = sin_TR2.to(x.dtype).unsqueeze(-2)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.squeeze(2) if squeeze else out
