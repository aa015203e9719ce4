"""Gated DeltaNet token mixers: GatedDeltaNet == transformers' Qwen3NextGatedDeltaNet (same
weights, fp32), prefill + steps == full forward (one `RecurrentState` advanced in place),
chunked == recurrent (`step.reference`), SimpleGDN (state, decay option, built from a GQA layer),
argument validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from glm5lab import ModelConfig
from glm5lab.model.gdn import gated_delta_rule_recurrent, l2_normalize
from glm5lab.model.gdn_layer import GatedDeltaNet, SimpleGDN
from glm5lab.model.gqa import GQAttention
from glm5lab.model.mla import MLAttention
from glm5lab.model.step import LayerStep, Step
from tests.conftest import assert_close, grads

H, HK, K, V = 4, 2, 8, 6  # grouped value heads: 2 q/k heads, 4 value heads


def _x(B=2, T=7, D=64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def _step(T, state=None, *, reference=False, **options) -> LayerStep:
    """One uncached layer step of T tokens: `state` (a `new_state`) or None (zero start).
    Gated DeltaNet uses no RoPE: the angles are zeros."""
    zeros = torch.zeros(T, 4)
    return LayerStep(Step.uncached(T, zeros, zeros, reference=reference, **options), state)


def _randomize(module, seed=0):
    """Every parameter random (norm weights, A_log and dt_bias included), so no mapping error
    hides behind an init of ones or zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.5 if p.dim() == 1 else 0.0))
    return module


def _hf_layer(cfg):
    hf_cfg = Qwen3NextConfig(hidden_size=cfg.hidden_size, linear_num_value_heads=H, linear_num_key_heads=HK,
                             linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=4,
                             rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu", num_hidden_layers=1,
                             layer_types=["linear_attention"])
    return _randomize(Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0)).eval()


def _load_from_hf(ours: GatedDeltaNet, hf) -> None:
    """Unpack HF's per-key-head packing: in_proj_qkvz rows [Hk, (q K | k K | v rV | z rV)],
    in_proj_ba rows [Hk, (b r | a r)], r = H / Hk."""
    r, D = H // HK, hf.hidden_size
    qkvz = hf.in_proj_qkvz.weight.view(HK, 2 * K + 2 * r * V, D)
    q, k, v, z = qkvz.split([K, K, r * V, r * V], dim=1)
    b, a = hf.in_proj_ba.weight.view(HK, 2 * r, D).split([r, r], dim=1)
    with torch.no_grad():
        for dst, src in ((ours.q_proj.weight, q), (ours.k_proj.weight, k), (ours.v_proj.weight, v),
                         (ours.z_proj.weight, z), (ours.b_proj.weight, b), (ours.a_proj.weight, a),
                         (ours.conv1d.weight, hf.conv1d.weight), (ours.dt_bias, hf.dt_bias),
                         (ours.A_log, hf.A_log), (ours.norm.weight, hf.norm.weight),
                         (ours.o_proj.weight, hf.out_proj.weight)):
            dst.copy_(src.reshape(dst.shape))


@pytest.fixture
def gdn_pair(tiny_cfg):
    torch.manual_seed(0)
    hf = _hf_layer(tiny_cfg)
    ours = GatedDeltaNet(tiny_cfg, num_heads=H, head_k_dim=K, head_v_dim=V, num_k_heads=HK).eval()
    _load_from_hf(ours, hf)
    return ours, hf


@pytest.mark.parametrize("T", [1, 7, 65])
def test_gated_deltanet_matches_qwen3_next(gdn_pair, T):
    ours, hf = gdn_pair
    x = _x(T=T)
    with torch.no_grad():
        expected = hf(x)
        for reference in (False, True):  # chunked (recurrent at T = 1) / token-by-token
            step = _step(T, reference=reference, use_dsa=True, index_topk=2, indexer_loss=True)
            assert_close(ours(x, step), expected)
            assert torch.is_tensor(ours(x, step))  # a plain output: selects nothing, no indexer loss
    assert expected.abs().max() > 1e-2  # a non-trivial output


def test_gated_deltanet_cached_steps_equal_full_forward(gdn_pair):
    ours, hf = gdn_pair
    x = _x(T=9)
    with torch.no_grad():
        full = hf(x)
        state_full = ours.new_state(2)
        out_full = ours(x, _step(9, state_full))
        assert_close(out_full, full)
        for prefill in (0, 2, 5):  # 2 < kernel - 1: the window mixes zeros and tokens
            state, outs = ours.new_state(2), []
            if prefill:
                outs.append(ours(x[:, :prefill], _step(prefill, state)))
            for t in range(prefill, 9):
                outs.append(ours(x[:, t:t + 1], _step(1, state)))  # the same state, advanced in place
            assert_close(torch.cat(outs, dim=1), full)
            assert_close(state.recurrent_BHKV, state_full.recurrent_BHKV)
            assert_close(state.conv_BCW, state_full.conv_BCW)
    assert state.conv_BCW.shape == (2, 2 * HK * K + H * V, 3)
    assert state.recurrent_BHKV.shape == (2, H, K, V) and state.recurrent_BHKV.dtype == torch.float32


def test_gated_deltanet_chunked_equals_recurrent_forward_and_backward(tiny_cfg):
    torch.manual_seed(0)
    layer = _randomize(GatedDeltaNet(tiny_cfg, num_heads=H, head_k_dim=K, head_v_dim=V, num_k_heads=HK,
                                     chunk_size=8))
    x = _x(T=21).requires_grad_(True)
    outs = {impl: layer(x, _step(21, reference=impl == "recurrent")) for impl in ("chunked", "recurrent")}
    assert_close(outs["chunked"], outs["recurrent"])
    params = (x, layer.A_log, layer.q_proj.weight, layer.conv1d.weight)
    for g_c, g_r in zip(grads(outs["chunked"], *params), grads(outs["recurrent"], *params), strict=True):
        assert_close(g_c, g_r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["gdn", "simple_gdn"])
def test_forward_does_not_mutate_previous_tensors_and_zero_state_equals_none(gdn_pair, tiny_cfg, kind):
    """A forward replaces the state's tensors (it never writes into the previous ones, which the
    rollback record keeps), and a fresh zero `new_state` gives the same output as no state."""
    ours = gdn_pair[0] if kind == "gdn" else _randomize(SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K,
                                                                  head_v_dim=V, num_kv_heads=2))
    x = _x(T=5)
    state = ours.new_state(2)
    zero_recurrent, zero_conv = state.recurrent_BHKV, state.conv_BCW
    with torch.no_grad():
        out_none = ours(x, _step(5))
        out_state = ours(x, _step(5, state))
        assert_close(out_state, out_none)
        assert zero_recurrent.abs().max() == 0 and (zero_conv is None or zero_conv.abs().max() == 0)
        assert state.recurrent_BHKV.abs().max() > 0  # advanced
        assert (zero_conv is None) == (kind == "simple_gdn")
        if zero_conv is not None:
            assert state.conv_BCW.abs().max() > 0
        before = state.recurrent_BHKV, state.conv_BCW
        copies = [None if t is None else t.clone() for t in before]
        ours(x[:, :2], _step(2, state))
    for t, copy in zip(before, copies, strict=True):
        assert (t is None and copy is None) or torch.equal(t, copy)
    assert not torch.equal(state.recurrent_BHKV, copies[0])


# --- SimpleGDN ---------------------------------------------------------------------------------

def _gqa_cfg():
    return ModelConfig.from_preset("tiny", attention_types=["gqa"] * 4, num_key_value_heads=2, attention_bias=True,
                                   index_n_heads=0, index_head_dim=0, use_dsa=False)


@pytest.mark.parametrize("decay", ["learned", "constant"])
def test_simple_gdn_prefill_then_steps_equals_full(tiny_cfg, decay):
    torch.manual_seed(0)
    layer = _randomize(SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, num_kv_heads=2,
                                 decay=decay, chunk_size=4))
    x = _x(T=10)
    with torch.no_grad():
        full = layer(x, _step(10))
        state = layer.new_state(2)
        outs = [layer(x[:, :6], _step(6, state))]
        for t in range(6, 10):
            outs.append(layer(x[:, t:t + 1], _step(1, state)))
        assert_close(torch.cat(outs, dim=1), full)
        assert_close(layer(x, _step(10, reference=True)), full)
    assert state.conv_BCW is None and state.recurrent_BHKV.shape == (2, 4, K, V)


def test_simple_gdn_matches_explicit_formula(tiny_cfg):
    """Against the formulas of the docstring, written out: q/k L2-normalised, k/v repeated over
    the query group, learned g and beta, one delta-rule state per query head."""
    torch.manual_seed(0)
    layer = _randomize(SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, num_kv_heads=2))
    x = _x(T=6)
    B, T = x.shape[:2]
    q = l2_normalize((x @ layer.q_proj.weight.T).view(B, T, 4, K))
    k = l2_normalize((x @ layer.k_proj.weight.T).view(B, T, 2, K))[:, :, [0, 0, 1, 1]]
    v = (x @ layer.v_proj.weight.T).view(B, T, 2, V)[:, :, [0, 0, 1, 1]]
    g = -layer.A_log.exp() * torch.nn.functional.softplus(x @ layer.a_proj.weight.T + layer.dt_bias)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T + layer.b_bias)
    S, outs = torch.zeros(B, 4, K, V), []
    for t in range(T):
        S = S * g[:, t, :, None, None].exp()
        kt = k[:, t]
        S = S + beta[:, t, :, None, None] * kt[..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))[:, :, None]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K**-0.5))
    expected = torch.stack(outs, 1).reshape(B, T, 4 * V) @ layer.o_proj.weight.T
    with torch.no_grad():
        assert_close(layer(x, _step(T)), expected)


def test_simple_gdn_decay_option_changes_behaviour(tiny_cfg):
    torch.manual_seed(0)
    learned = SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, decay="learned")
    constant = SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, decay="constant")
    missing, unexpected = constant.load_state_dict(learned.state_dict(), strict=False)
    assert not missing and set(unexpected) == {"a_proj.weight", "b_proj.weight"}
    x = _x(T=8)
    with torch.no_grad():
        # zero-initialised w_a / w_b: both options start from the same per-head gates
        assert_close(learned(x, _step(8)), constant(x, _step(8)))
        g_c, beta_c = constant.gates(x)
        assert (g_c == g_c[:1, :1]).all() and (beta_c == beta_c[:1, :1]).all()  # data-independent
        learned.a_proj.weight.normal_(0, 0.5)
        learned.b_proj.weight.normal_(0, 0.5)
        g_l, beta_l = learned.gates(x)
        assert g_l.std(dim=1).min() > 0 and beta_l.std(dim=1).min() > 0     # varies over tokens
        assert (g_l <= 0).all() and ((beta_l > 0) & (beta_l < 1)).all()
        assert (learned(x, _step(8)) - constant(x, _step(8))).abs().max() > 1e-3


def test_simple_gdn_from_gqa_reproduces_projections():
    cfg = _gqa_cfg()
    torch.manual_seed(0)
    gqa = GQAttention(cfg, cfg.layers[0])
    layer = SimpleGDN.from_gqa(gqa, decay="constant")
    assert (layer.n_heads, layer.n_kv, layer.k_dim, layer.v_dim) == (4, 2, cfg.qk_head_dim, cfg.v_head_dim)
    x = _x(T=5)
    B, T = x.shape[:2]
    with torch.no_grad():
        q, k, v = layer.project(x)
        assert_close(q, gqa.q_proj(x).view(B, T, 4, cfg.qk_head_dim), atol=0, rtol=0)
        assert_close(k, gqa.k_proj(x).view(B, T, 2, cfg.qk_head_dim), atol=0, rtol=0)
        assert_close(v, gqa.v_proj(x).view(B, T, 2, cfg.v_head_dim), atol=0, rtol=0)
        assert_close(layer.o_proj.weight, gqa.o_proj.weight, atol=0, rtol=0)
        assert layer.q_proj.bias is not None  # attention_bias carried over
        # copies, not shared: training the new layer leaves the attention layer alone
        layer.q_proj.weight.add_(1.0)
        assert not torch.equal(layer.q_proj.weight, gqa.q_proj.weight)
        state = layer.new_state(B)
        step = _step(T, state, use_dsa=True, index_topk=2, indexer_loss=True)
        out = layer(x, step)
    assert torch.is_tensor(out) and out.shape == x.shape
    assert state.recurrent_BHKV.shape == (B, 4, cfg.qk_head_dim, cfg.v_head_dim)


# --- validation --------------------------------------------------------------------------------

def test_validation_errors(tiny_cfg, gdn_pair):
    ours, _ = gdn_pair
    x = _x(T=3)
    plain = _step(3).step
    cached = Step(T=3, extent=3, cos=plain.cos, sin=plain.sin, offsets=torch.zeros(2, dtype=torch.long), cache=object())
    with pytest.raises(ValueError, match="no recurrent state.*KVCache.for_model"):
        ours(x, LayerStep(cached, None))  # a cached step without this layer's state
    with pytest.raises(ValueError, match="x_BTD"):
        ours(x[..., :32], _step(3))
    with pytest.raises(ValueError, match="x_BTD"):
        ours(x[0], _step(3))
    for bad_batch in (1, 3):
        state = ours.new_state(bad_batch)
        with pytest.raises(ValueError, match=f"recurrent state holds {bad_batch} rows, x_BTD 2"):
            ours(x, _step(3, state))
        assert state.last is None and state.recurrent_BHKV.abs().max() == 0  # refused before any change
    with pytest.raises(ValueError, match="num_k_heads"):
        GatedDeltaNet(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, num_k_heads=3)
    with pytest.raises(ValueError, match="conv_kernel"):
        GatedDeltaNet(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, conv_kernel=0)
    with pytest.raises(ValueError, match="head_k_dim"):
        SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=2.5, head_v_dim=V)
    with pytest.raises(ValueError, match="decay"):
        SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, decay="fixed")
    with pytest.raises(ValueError, match="num_kv_heads"):
        SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, num_kv_heads=3)
    simple = SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V)
    with pytest.raises(ValueError, match="recurrent state holds 3 rows, x_BTD 2"):
        simple(x, _step(3, simple.new_state(3)))
    with pytest.raises(ValueError, match="x_BTD"):
        simple(x[..., :32], _step(3))
    with pytest.raises(ValueError, match=r"SimpleGDN's state must have .*new_state"):
        simple(x, _step(3, ours.new_state(2)))  # a Gated DeltaNet state (with a conv window) in a SimpleGDN
    with pytest.raises(ValueError, match=r"GatedDeltaNet's state must have .*new_state"):
        ours(x, _step(3, simple.new_state(2)))  # no conv window
    mla_spec = dataclasses.replace(tiny_cfg.layers[0], indexer="none", has_indexer_weights=False, index_cache=False)
    with pytest.raises(TypeError, match="GQAttention"):
        SimpleGDN.from_gqa(MLAttention(tiny_cfg, mla_spec))


def test_reference_rule_is_what_the_layer_runs(tiny_cfg):
    """Guard against a silently skipped rule: with beta = 0 nothing is written, so the output is 0."""
    layer = SimpleGDN(tiny_cfg, num_heads=4, head_k_dim=K, head_v_dim=V, decay="constant")
    with torch.no_grad():
        layer.b_bias.fill_(-1e4)
        assert layer(_x(T=4), _step(4)).abs().max() == 0
    o, _ = gated_delta_rule_recurrent(*(torch.ones(1, 1, 1, 1),) * 3, torch.zeros(1, 1, 1), torch.ones(1, 1, 1))
    assert o.item() == 1.0
