"""MoE: router against transformers' GlmMoeDsaTopkRouter (incl. group-limited routing), the
grouped and gathered expert paths against the per-expert loop (forward and backward), the whole
block against transformers' GlmMoeDsaMoE, the router's fp32 and selection-only bias rules, and
load counting (training mode only, exactly the routed assignments)."""

import pytest
import torch

from glm5lab import ModelConfig
from glm5lab.model.dispatch import LocalDispatcher
from glm5lab.model.moe import (
    MoE, Router, experts_gathered, experts_grouped, experts_grouped_mm, experts_loop, grouped_mm_runs,
)
from tests.conftest import assert_close, grads


def _moe(kernel, x, idx, w, weights, **kw):
    """dispatch -> `kernel` over the rows grouped by expert -> combine: y [N, D]."""
    x_AD, counts_E, sent = LocalDispatcher().dispatch(x, idx, w, weights[0].shape[0])
    return LocalDispatcher().combine(kernel(x_AD, counts_E, *weights, **kw), sent, x.dtype)


def _by_hand(x, idx, w, weights):
    """y_n = sum_k w_nk FFN_{idx_nk}(x_n), token by token: what dispatch, experts and combine compute."""
    gate, up, down = weights
    rows = []
    for n in range(x.shape[0]):
        rows.append(sum(w[n, k] * ((torch.nn.functional.silu(x[n] @ gate[e].T) * (x[n] @ up[e].T)) @ down[e].T)
                        for k, e in enumerate(idx[n].tolist())))
    return torch.stack(rows)


def _cfg(**changes):
    return ModelConfig.from_preset("tiny", **changes)


def _hf(cfg):
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig.from_dict(cfg.to_hf())


@pytest.mark.parametrize("changes", [{}, dict(n_group=4, topk_group=2, num_experts_per_tok=3),
                                     dict(norm_topk_prob=False, routed_scaling_factor=1.7)])
def test_router_matches_transformers(changes):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    cfg = _cfg(**changes)
    torch.manual_seed(0)
    ours = Router(cfg)
    torch.nn.init.normal_(ours.weight)
    ours.e_score_correction_bias.normal_(std=0.3)
    theirs = GlmMoeDsaTopkRouter(_hf(cfg))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(37, cfg.hidden_size)
    w, idx, _ = ours(x)
    _, w_hf, idx_hf = theirs(x)
    order, order_hf = idx.argsort(-1), idx_hf.argsort(-1)
    assert torch.equal(idx.gather(1, order), idx_hf.gather(1, order_hf))
    assert_close(w.gather(1, order), w_hf.gather(1, order_hf))


def test_bias_steers_selection_but_not_weights():
    cfg = _cfg()
    torch.manual_seed(1)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, cfg.hidden_size)
    router.e_score_correction_bias[3] = 100.0
    w, idx, scores = router(x)
    assert (idx == 3).any(-1).all()
    chosen = scores.gather(1, idx)
    expected = chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    assert_close(w, expected)
    assert_close(w.sum(-1), torch.full((5,), cfg.routed_scaling_factor))


def test_router_stays_fp32_when_model_is_cast():
    router = Router(_cfg()).to(torch.bfloat16)
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    assert isinstance(router.weight, torch.nn.Parameter)
    assert "e_score_correction_bias" not in dict(router.named_parameters())


@pytest.mark.parametrize("N", [1, 2, 7, 33])
@pytest.mark.parametrize("E,K", [(8, 2), (5, 3), (3, 3)])
@pytest.mark.parametrize("tile", [1, 3, 64])
def test_grouped_equals_loop_forward_and_backward(N, E, K, tile):
    g = torch.Generator().manual_seed(N * 10 + E)
    D, I = 6, 5
    x = torch.randn(N, D, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g, requires_grad=True)
    weights = [torch.randn(E, I, D, generator=g, requires_grad=True), torch.randn(E, I, D, generator=g, requires_grad=True),
               torch.randn(E, D, I, generator=g, requires_grad=True)]
    ref = _moe(experts_loop, x, idx, w, weights)
    out = _moe(experts_grouped, x, idx, w, weights, tile=tile)
    assert_close(ref, _by_hand(x, idx, w, weights))  # the reference pipeline is the formula
    assert_close(out, ref)
    for a, b in zip(grads(out, x, w, *weights), grads(ref, x, w, *weights), strict=True):
        assert_close(a, b)


def _expert_inputs(g, N, E, K, D=6, I=5):
    x = torch.randn(N, D, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])  # K distinct experts per token
    w = torch.rand(N, K, generator=g, requires_grad=True)
    weights = [torch.randn(E, I, D, generator=g, requires_grad=True), torch.randn(E, I, D, generator=g, requires_grad=True),
               torch.randn(E, D, I, generator=g, requires_grad=True)]
    return x, idx, w, weights


def _assert_gathered_equals_loop(x, idx, w, weights):
    """Both sync-free decode paths (gathered weights, torch._grouped_mm) equal the loop, fwd+bwd."""
    ref = _moe(experts_loop, x, idx, w, weights)
    ref_grads = grads(ref, x, w, *weights)
    for fast in (experts_gathered, experts_grouped_mm) if grouped_mm_runs(x, weights[0]) else (experts_gathered,):
        out = _moe(fast, x, idx, w, weights)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_close(out, ref)
        for a, b in zip(grads(out, x, w, *weights), ref_grads, strict=True):
            assert_close(a, b)


@pytest.mark.parametrize("N", [1, 3, 7])
@pytest.mark.parametrize("E,K", [(8, 2), (5, 3), (3, 3)])
@pytest.mark.parametrize("D,I", [(6, 5), (8, 12)], ids=["odd", "aligned"])  # aligned: torch._grouped_mm runs too
def test_gathered_equals_loop_forward_and_backward(N, E, K, D, I):
    if D == 8:
        assert grouped_mm_runs(torch.zeros(1, D), torch.zeros(E, I, D))
    _assert_gathered_equals_loop(*_expert_inputs(torch.Generator().manual_seed(N * 10 + E), N, E, K, D=D, I=I))


def test_gathered_equals_loop_when_tokens_share_experts():
    """Typical routing (K distinct experts per token) where tokens overlap on some experts and
    leave others idle: expert 1 serves three tokens, expert 3 none."""
    g = torch.Generator().manual_seed(5)
    x, _, w, weights = _expert_inputs(g, 3, 5, 2)
    idx = torch.tensor([[1, 0], [2, 1], [1, 4]])
    _assert_gathered_equals_loop(x, idx, w, weights)


@pytest.mark.parametrize("fast", [experts_gathered, experts_grouped, experts_grouped_mm],
                         ids=["gathered", "grouped", "grouped_mm"])
def test_tie_to_the_loop_catches_a_wrong_expert(fast):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.rand(4, 2, generator=g)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    weights = [torch.randn(4, 12, 8, generator=g), torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 12, generator=g)]
    with pytest.raises(AssertionError):
        assert_close(_moe(fast, x, (idx + 1) % 4, w, weights), _moe(experts_loop, x, idx, w, weights))


def test_moe_block_matches_transformers_and_records_load():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

    cfg = _cfg()
    torch.manual_seed(2)
    ours = MoE(cfg)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    theirs = GlmMoeDsaMoE(_hf(cfg))
    sd = {k: v for k, v in ours.state_dict().items() if not k.startswith("experts.")}
    sd["experts.gate_up_proj"] = torch.cat([ours.experts.gate_proj, ours.experts.up_proj], dim=1).detach()
    sd["experts.down_proj"] = ours.experts.down_proj.detach()
    theirs.load_state_dict(sd)
    x = torch.randn(2, 9, cfg.hidden_size)
    assert_close(ours(x), theirs(x))
    assert_close(ours(x, impl="loop"), theirs(x))
    load = ours.pop_load()  # two forwards above
    assert load.sum().item() == 2 * 2 * 9 * cfg.num_experts_per_tok and load.shape == (cfg.n_routed_experts,)
    assert ours.pop_load().sum().item() == 0


def test_load_is_counted_in_training_mode_only_and_exactly():
    cfg = _cfg()
    torch.manual_seed(3)
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.gate.weight)
    x = torch.randn(1, 3, cfg.hidden_size)  # 3 tokens x 2 experts < 8 experts: some stay idle
    E = cfg.n_routed_experts
    _, idx, _ = moe.gate(x.reshape(-1, cfg.hidden_size))
    expected = torch.zeros(E, dtype=torch.long)
    for e in idx.reshape(-1).tolist():  # by hand: one count per (token, expert) assignment
        expected[e] += 1
    assert expected.sum().item() == 3 * cfg.num_experts_per_tok and (expected == 0).any()

    moe.eval()
    with torch.no_grad():
        for impl in ("auto", "grouped", "gathered", "loop"):
            moe(x, impl=impl)
    assert moe.load is None  # nothing counted in eval mode
    assert torch.equal(moe.pop_load(), torch.zeros(E, dtype=torch.long))

    moe.train()
    moe(x)
    assert moe.load.dtype == torch.long and torch.equal(moe.load, expected)
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert torch.equal(moe.load, expected)  # an eval forward leaves an existing count untouched
    moe.train()
    moe(x, impl="loop")
    assert torch.equal(moe.pop_load(), 2 * expected)
    assert moe.load is None and torch.equal(moe.pop_load(), torch.zeros(E, dtype=torch.long))
