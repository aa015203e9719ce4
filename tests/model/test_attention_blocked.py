"""`attention_expanded_blocked` (key-blocked causal attention over per-head K/V expanded from latents) against
its reference twin `attention_expanded_blocked_reference`: odd shapes (T = 1, offsets block-1, block, block+1
and past several blocks, q/k width above and below the value width, stale slots past the keys), forward through
the fused CPU kernel (no gradient) and through the differentiable fp32 path, backward, bf16, bad arguments."""

import pytest
import torch

from glm5lab.model.attention_blocked import attention_expanded_blocked, attention_expanded_blocked_reference
from tests.conftest import assert_close, grads

B, H, L, SCALE = 2, 3, 6, 0.37
BLOCK = 4


def _expand(X: int, V: int):
    """A random linear expansion latent_BSL -> (k_BSHX, v_BSHV), and its weight (for gradients)."""
    w_LY = torch.randn(L, H * (X + V), generator=torch.Generator().manual_seed(X * 31 + V))
    w_LY.requires_grad_(True)

    def expand(latent_BSL):
        b, s, _ = latent_BSL.shape
        kv_BSHY = (latent_BSL @ w_LY).view(b, s, H, X + V)
        return kv_BSHY[..., :X], kv_BSHY[..., X:]

    return expand, w_LY


def _inputs(T: int, offset: int, X: int, stale: int = 2):
    g = torch.Generator().manual_seed(T * 100 + offset)
    q = torch.randn(B, T, H, X, generator=g) / 2
    latent = torch.randn(B, offset + T + stale, L, generator=g) / 2
    return q, latent


OFFSETS = (0, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 1)
WIDTHS = ((7, 5), (5, 7), (6, 6))
"""(X, V): q/k wider than the value, narrower, equal (the fused kernel pads the narrower side)."""
SHAPES = [(T, offset, X, V) for T in (1, BLOCK - 1, BLOCK + 1) for offset in OFFSETS for X, V in WIDTHS]


@pytest.mark.parametrize("T, offset, X, V", SHAPES)
def test_blocked_equals_the_reference_forward(T, offset, X, V):
    expand, _ = _expand(X, V)
    q, latent = _inputs(T, offset, X)
    with torch.no_grad():  # the fused CPU kernel
        want = attention_expanded_blocked_reference(q, latent, expand, scale=SCALE, offset=offset, block=BLOCK)
        got = attention_expanded_blocked(q, latent, expand, scale=SCALE, offset=offset, block=BLOCK)
    assert got.shape == (B, T, H, V) and got.dtype == q.dtype
    assert_close(got, want)


@pytest.mark.parametrize("T, offset, X, V", [s for s in SHAPES if s[2:] != (6, 6)])
def test_blocked_equals_the_reference_backward(T, offset, X, V):
    expand, w = _expand(X, V)
    q, latent = _inputs(T, offset, X)
    q.requires_grad_(True)
    latent.requires_grad_(True)
    want = attention_expanded_blocked_reference(q, latent, expand, scale=SCALE, offset=offset, block=BLOCK)
    got = attention_expanded_blocked(q, latent, expand, scale=SCALE, offset=offset, block=BLOCK)
    assert_close(got, want)
    for a, b in zip(grads(got, q, latent, w), grads(want, q, latent, w), strict=True):
        assert_close(a, b)


def test_blocked_bf16_stays_within_the_bf16_tolerance():
    expand, _ = _expand(6, 6)
    q, latent = _inputs(5, 9, 6)
    with torch.no_grad():
        want = attention_expanded_blocked_reference(q, latent, expand, scale=SCALE, offset=9, block=BLOCK)
        got = attention_expanded_blocked(q.bfloat16(), latent, lambda lat: tuple(t.bfloat16() for t in expand(lat)),
                                         scale=SCALE, offset=9, block=BLOCK)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want, dtype=torch.bfloat16)


@pytest.mark.parametrize("kw, match", [(dict(offset=-1), "offset must be"), (dict(offset=5), "offset must be"),
                                       (dict(offset=True), "offset must be"), (dict(block=0), "block must be"),
                                       (dict(block=2.0), "block must be")])
def test_bad_arguments_are_refused(kw, match):
    expand, _ = _expand(6, 6)
    q, latent = _inputs(3, 0, 6, stale=1)  # S = 4: offsets 0..1 fit
    args = dict(scale=SCALE, offset=0, block=BLOCK) | kw
    for fn in (attention_expanded_blocked, attention_expanded_blocked_reference):
        with pytest.raises(ValueError, match=match):
            fn(q, latent, expand, **args)
