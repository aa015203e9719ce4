"""MLA: the absorbed latent-space path (with gathered top-k) against the naive path (materialised
per-head K/V, dense mask), forward and backward, dense and sparse, odd shapes."""

import pytest
import torch

from glm5lab import ModelConfig
from glm5lab.model.mla import MLAttention
from glm5lab.model.rope import rope_angles
from tests.conftest import assert_close, grads

K = 6


def _layer(has_indexer=True, **changes):
    cfg = ModelConfig.from_preset("tiny", index_topk=K, qk_nope_head_dim=5, v_head_dim=7, kv_lora_rank=11, **changes)
    torch.manual_seed(0)
    layer = MLAttention(cfg, has_indexer=has_indexer)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, layer


def _run(layer, cfg, x, impl, prev_topk=None, **kw):
    cos, sin = rope_angles(torch.arange(x.shape[1]), cfg.qk_rope_head_dim, cfg.rope_theta)
    out, topk, _ = layer(x, cos, sin, impl=impl, prev_topk=prev_topk, **kw)
    return out, topk


@pytest.mark.parametrize("T", [1, K - 1, K, K + 1, 17, 16 * K + 1])  # the last: `auto` gathers
@pytest.mark.parametrize("use_dsa", [True, False])
def test_absorbed_equals_naive_forward_and_backward(T, use_dsa):
    cfg, layer = _layer(use_dsa=use_dsa)
    x = torch.randn(2, T, cfg.hidden_size, requires_grad=True)
    out_naive, topk_naive = _run(layer, cfg, x, "naive")
    out_abs, topk_abs = _run(layer, cfg, x, "absorbed")
    out_auto, _ = _run(layer, cfg, x, "auto")
    assert (topk_naive is None) == (not use_dsa or T <= K)
    if topk_naive is not None:
        assert torch.equal(topk_naive.idx_BTK, topk_abs.idx_BTK)
    assert_close(out_abs, out_naive)
    assert_close(out_auto, out_naive)
    params = [x] + list(layer.parameters())
    for a, b in zip(grads(out_abs, *params), grads(out_naive, *params), strict=True):
        if a is None or b is None:
            assert a is None and b is None  # indexer weights: selection is not differentiable
        else:
            assert_close(a, b)


def test_sparse_differs_from_dense_so_dsa_is_exercised():
    cfg, layer = _layer()
    x = torch.randn(1, 3 * K, cfg.hidden_size)
    sparse, _ = _run(layer, cfg, x, "naive")
    dense, _ = _run(layer, cfg, x, "naive", use_dsa=False)
    assert_close(sparse[:, :K], dense[:, :K])  # first K queries see every causal key either way
    assert (sparse[:, K:] - dense[:, K:]).abs().max() > 1e-3


def test_shared_layer_reuses_given_topk_and_refuses_without():
    cfg, full = _layer()
    _, shared = _layer(has_indexer=False)
    x = torch.randn(1, 2 * K, cfg.hidden_size)
    _, topk = _run(full, cfg, x, "absorbed")
    _, reused = _run(shared, cfg, x, "absorbed", prev_topk=topk)
    assert reused is topk
    with pytest.raises(ValueError, match="'shared' DSA layer needs the top-k"):
        _run(shared, cfg, x, "absorbed")


def test_unknown_impl_is_refused():
    cfg, layer = _layer()
    with pytest.raises(ValueError, match="impl 'flash'.*one of"):
        _run(layer, cfg, torch.randn(1, 2, cfg.hidden_size), "flash")
