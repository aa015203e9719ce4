"""Key-blocked causal attention of a prefill chunk over per-head K/V expanded from cached latents.

Legend: B rows, T queries (the chunk), P cached keys before it (the chunk's offset, one for all rows), S key
slots (>= P + T; slots from P + T on are not visible), H heads, X q/k width, V value width, L latent width.

A cached dense MLA call (`glm5lab.model.mla.attention_route`'s "expanded_blocked") of T queries at positions
P..P+T-1 over keys 0..P+T-1. The cached keys 0..P-1 go in blocks of `block` keys: each block's per-head K/V is
expanded from its latents (`expand`), attended unmasked (every cached key is visible to every query of the
chunk) and dropped; the chunk's own keys P..P+T-1 are attended with SDPA's `is_causal` (no explicit mask). The
partial softmaxes are merged by log-sum-exp (FlashAttention's rescaling). Memory: one block's K/V and the
chunk's, never all keys' at once, and no [T, S] mask. Per key and head the work is the uncached forward's
(N+R+V multiply-adds per query) plus one re-expansion per call (C(N+V)): small per query when T is large
(`glm5lab.infer.DENSE_PREFILL_CHUNK`).

Where no gradient is needed on CPU each part runs through the fused flash kernel that also returns the
log-sum-exp (`aten._scaled_dot_product_flash_attention_for_cpu`); elsewhere (autograd, other devices) through
written-out fp32 scores, which are differentiable. `attention_expanded_blocked_reference` is the twin with the
same signature: all keys expanded at once, the causal mask, `attention_reference`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from glm5lab.model.attention import attention_reference
from glm5lab.model.visibility import visible

Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""latent_BSL -> (k_BSHX, v_BSHV): the per-head keys and values of those keys' latents."""


def attention_expanded_blocked(q_BTHX: torch.Tensor, latent_BSL: torch.Tensor, expand: Expand, *, scale: float,
                               offset: int, block: int) -> torch.Tensor:
    """o_BTHV (q's dtype): causal attention of the T queries at positions offset..offset+T-1 over keys
    0..offset+T-1, whose latents are latent_BSL[:, :offset+T] (see the module docstring). block: cached keys
    expanded per step (>= 1). Raises ValueError when S < offset + T, offset < 0 or block < 1."""
    _check(q_BTHX, latent_BSL, offset, block)
    T = q_BTHX.shape[1]
    q_BHTX = q_BTHX.transpose(1, 2).contiguous()
    o_BHTV, lse_BHT = _partial(q_BHTX, *expand(latent_BSL[:, offset:offset + T]), scale=scale, causal=True)
    for s0 in range(0, offset, block):
        k_BSHX, v_BSHV = expand(latent_BSL[:, s0:min(s0 + block, offset)])
        o_BHTV, lse_BHT = _merge(o_BHTV, lse_BHT, *_partial(q_BHTX, k_BSHX, v_BSHV, scale=scale, causal=False))
    return o_BHTV.transpose(1, 2).to(q_BTHX.dtype)


def attention_expanded_blocked_reference(q_BTHX: torch.Tensor, latent_BSL: torch.Tensor, expand: Expand, *,
                                         scale: float, offset: int, block: int) -> torch.Tensor:
    """`attention_expanded_blocked` written out: every key's K/V expanded at once, the causal mask over all S
    slots, `attention_reference` (block is checked, not used)."""
    _check(q_BTHX, latent_BSL, offset, block)
    T, S = q_BTHX.shape[1], latent_BSL.shape[1]
    k_BSHX, v_BSHV = expand(latent_BSL)
    mask_1TS = visible(offset, T, S, device=q_BTHX.device)
    return attention_reference(q_BTHX, k_BSHX, v_BSHV, scale=scale, mask_BTS=mask_1TS)


def _check(q_BTHX, latent_BSL, offset: int, block: int) -> None:
    T, S = q_BTHX.shape[1], latent_BSL.shape[1]
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + T > S:
        raise ValueError(f"offset must be an int in 0..S-T = 0..{S - T} (T={T} queries, S={S} key slots), "
                         f"got {offset!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1 (cached keys expanded per step), got {block!r}")


def _partial(q_BHTX, k_BSHX, v_BSHV, *, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BHTV fp32, lse_BHT fp32): softmax attention of the queries over these keys alone (causal: T == S,
    aligned), and the log-sum-exp of each query's scaled scores."""
    k_BHSX, v_BHSV = k_BSHX.transpose(1, 2), v_BSHV.transpose(1, 2)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHTX, k_BHSX, v_BHSV))
    if q_BHTX.device.type == "cpu" and not needs_grad:
        return _fused_cpu(q_BHTX, k_BHSX, v_BHSV, scale=scale, causal=causal)
    scores_BHTS = torch.einsum("bhtx,bhsx->bhts", q_BHTX.float(), k_BHSX.float()) * scale
    if causal:
        T = scores_BHTS.shape[-2]
        keep_TT = torch.ones(T, T, dtype=torch.bool, device=scores_BHTS.device).tril()
        scores_BHTS = scores_BHTS.masked_fill(~keep_TT, float("-inf"))
    lse_BHT = scores_BHTS.logsumexp(-1)
    o_BHTV = torch.einsum("bhts,bhsv->bhtv", (scores_BHTS - lse_BHT[..., None]).exp(), v_BHSV.float())
    return o_BHTV, lse_BHT


def _fused_cpu(q_BHTX, k_BHSX, v_BHSV, *, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`_partial` through the CPU flash kernel, which needs one width for q, k and v: the narrower side is
    padded with zeros (zero q/k columns add nothing to a score; zero value columns are dropped after)."""
    X, V = q_BHTX.shape[-1], v_BHSV.shape[-1]
    if X < V:
        q_BHTX, k_BHSX = F.pad(q_BHTX, (0, V - X)), F.pad(k_BHSX, (0, V - X))
    elif V < X:
        v_BHSV = F.pad(v_BHSV, (0, X - V))
    o_BHTW, lse_BHT = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHTX, k_BHSX, v_BHSV, 0.0, causal, scale=scale)
    return o_BHTW[..., :V].float(), lse_BHT.float()


def _merge(o_a, lse_a, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmaxes over disjoint keys, as one: weights exp(lse_part - lse_all)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a * (lse_a - lse).exp()[..., None] + o_b * (lse_b - lse).exp()[..., None], lse
