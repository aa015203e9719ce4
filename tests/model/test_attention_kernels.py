"""Core attention kernels: gathered top-k and SDPA-causal against the explicit masked reference,
forward and backward, on odd shapes (T = 1, K-1, K, K+1; odd widths; grouped heads)."""

import pytest
import torch

from glm5lab.model.attention import (
    attention_causal, attention_gathered, attention_reference, causal_mask, topk_mask,
)
from glm5lab.model.dsa import select_topk
from tests.conftest import assert_close, grads as _grads

K = 5


def _qkv(B, T, H, G, D, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()
    return mk(B, T, H, D), mk(B, T, G, D), mk(B, T, G, E)


@pytest.mark.parametrize("T", [1, K - 1, K, K + 1, 13])
@pytest.mark.parametrize("H,G", [(3, 3), (4, 2), (3, 1)])
def test_gathered_equals_masked_reference(T, H, G):
    q, k, v = _qkv(2, T, H, G, 7, 5)
    scores = torch.randn(2, T, T).masked_fill(~causal_mask(T, T, 0, "cpu"), float("-inf"))
    topk = select_topk(scores, K)
    mask = causal_mask(T, T, 0, "cpu")[None] & topk_mask(topk, T)
    ref = attention_reference(q, k, v, scale=0.3, mask_BTS=mask)
    out = attention_gathered(q, k, v, scale=0.3, topk=topk)
    assert_close(out, ref)
    for a, b in zip(_grads(out, q, k, v), _grads(ref, q, k, v), strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("T,S,offset", [(1, 1, 0), (6, 6, 0), (1, 9, 8), (3, 9, 6)])
def test_sdpa_causal_equals_reference(T, S, offset):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, T, 4, 6, generator=g, requires_grad=True)
    k = torch.randn(1, S, 2, 6, generator=g, requires_grad=True)
    v = torch.randn(1, S, 2, 3, generator=g, requires_grad=True)
    ref = attention_reference(q, k, v, scale=0.5, mask_BTS=causal_mask(T, S, offset, "cpu")[None])
    out = attention_causal(q, k, v, scale=0.5, q_offset=offset)
    assert_close(out, ref)
    for a, b in zip(_grads(out, q, k, v), _grads(ref, q, k, v), strict=True):
        assert_close(a, b)


def test_garbage_selection_fails():
    """The tie is strict enough to notice a wrong key choice."""
    q, k, v = _qkv(1, 9, 2, 2, 4, 4)
    scores = torch.randn(1, 9, 9).masked_fill(~causal_mask(9, 9, 0, "cpu"), float("-inf"))
    topk = select_topk(scores, 3)
    wrong = topk._replace(idx_BTK=topk.idx_BTK.flip(-1))
    mask = causal_mask(9, 9, 0, "cpu")[None] & topk_mask(topk, 9)
    ref = attention_reference(q, k, v, scale=0.5, mask_BTS=mask)
    with pytest.raises(AssertionError):
        assert_close(attention_gathered(q, k, v, scale=0.5, topk=wrong._replace(idx_BTK=(wrong.idx_BTK + 1) % 9)), ref)


def test_group_mismatch_is_refused():
    q, k, v = _qkv(1, 3, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_causal(q, k, v, scale=1.0)
