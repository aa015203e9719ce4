"""Core attention kernels: latent (absorbed-MLA) attention gathered over the top-k or masked
through SDPA, and SDPA-causal, against the explicit masked reference, forward and backward, on
odd shapes (T = 1, K-1, K, K+1; odd widths; grouped heads; per-row offsets as in decoding)."""

import pytest
import torch

from glm5lab.model.attention import (
    attention_causal, attention_latent_gathered, attention_latent_masked, attention_reference, topk_mask,
)
from glm5lab.model.topk import select_topk
from glm5lab.model.visibility import visible
from tests.conftest import assert_close, grads as _grads

K = 5


def _q_kv(B, T, S, H, X, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()
    return mk(B, T, H, X), mk(B, S, X)


def _latent_reference(q, kv, v_dim, mask_BTS):
    """k = kv, v = kv[..., :v_dim], one KV head shared by all query heads."""
    return attention_reference(q, kv[:, :, None], kv[:, :, None, :v_dim], scale=0.3, mask_BTS=mask_BTS)


@pytest.mark.parametrize("T", [1, K - 1, K, K + 1, 13])
@pytest.mark.parametrize("H", [1, 3])
def test_latent_gathered_and_masked_equal_reference(T, H):
    q, kv = _q_kv(2, T, T, H, 11, seed=T)
    scores = torch.randn(2, T, T).masked_fill(~visible(0, T, T)[0], float("-inf"))
    topk = select_topk(scores, K)
    mask = visible(0, T, T)[0][None] & topk_mask(topk, T)
    ref = _latent_reference(q, kv, 7, mask)
    ref_grads = _grads(ref, q, kv)
    for out in (attention_latent_gathered(q, kv, v_dim=7, scale=0.3, topk=topk),
                attention_latent_masked(q, kv, v_dim=7, scale=0.3, mask_BTS=mask)):
        assert out.shape == (2, T, H, 7)
        assert_close(out, ref)
        for a, b in zip(_grads(out, q, kv), ref_grads, strict=True):
            assert_close(a, b)


def test_latent_kernels_with_per_row_offsets():
    """Decoding rows at different lengths: query t of row b sits at offsets[b] + t."""
    offsets, T, S = torch.tensor([3, 9]), 2, 11
    q, kv = _q_kv(2, T, S, 3, 9, seed=5)
    mask = visible(offsets, T, S)
    scores = torch.randn(2, T, S).masked_fill(~mask, float("-inf"))
    topk = select_topk(scores, K, q_offset=offsets)
    assert topk.valid_BTK[0].sum(-1).tolist() == [4, 5] and topk.valid_BTK[1].all()
    ref = _latent_reference(q, kv, 5, mask & topk_mask(topk, S))
    assert_close(attention_latent_gathered(q, kv, v_dim=5, scale=0.3, topk=topk), ref)
    assert_close(attention_latent_masked(q, kv, v_dim=5, scale=0.3, mask_BTS=mask & topk_mask(topk, S)), ref)
    causal_only = attention_latent_masked(q, kv, v_dim=5, scale=0.3, mask_BTS=mask)
    assert_close(causal_only, _latent_reference(q, kv, 5, mask))


@pytest.mark.parametrize("T,S,offset", [(1, 1, 0), (6, 6, 0), (1, 9, 8), (3, 9, 6)])
def test_sdpa_causal_equals_reference(T, S, offset):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, T, 4, 6, generator=g, requires_grad=True)
    k = torch.randn(1, S, 2, 6, generator=g, requires_grad=True)
    v = torch.randn(1, S, 2, 3, generator=g, requires_grad=True)
    ref = attention_reference(q, k, v, scale=0.5, mask_BTS=visible(offset, T, S)[0][None])
    out = attention_causal(q, k, v, scale=0.5, q_offset=offset)
    assert_close(out, ref)
    for a, b in zip(_grads(out, q, k, v), _grads(ref, q, k, v), strict=True):
        assert_close(a, b)


def test_garbage_selection_fails():
    """The tie is strict enough to notice a wrong key choice."""
    q, kv = _q_kv(1, 9, 9, 2, 4)
    scores = torch.randn(1, 9, 9).masked_fill(~visible(0, 9, 9)[0], float("-inf"))
    topk = select_topk(scores, 3)
    wrong = topk._replace(idx_BTK=(topk.idx_BTK.flip(-1) + 1) % 9)
    ref = _latent_reference(q, kv, 3, visible(0, 9, 9)[0][None] & topk_mask(topk, 9))
    with pytest.raises(AssertionError):
        assert_close(attention_latent_gathered(q, kv, v_dim=3, scale=0.3, topk=wrong), ref)


def test_group_mismatch_is_refused():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, h, 4, generator=g) for h in (3, 2, 2))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_causal(q, k, v, scale=1.0)
