"""Gated DeltaNet recurrence: chunked == recurrent, both == transformers' Qwen3-Next reference,
a hand-computed case, the gate's forgetting, shape errors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from glm5lab.model.gdn import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2_normalize,
)
from tests.conftest import assert_close, grads


def _inputs(B=2, T=5, H=3, K=7, V=5, *, init=False, seed=0, requires_grad=False):
    """Realistic inputs: L2-normalised q/k (as the layer feeds them), beta in (0, 1), g < 0."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    k = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)  # mostly mild decay
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen) if init else None
    xs = [q, k, v, g, beta] + ([s0] if init else [])
    if requires_grad:
        for x in xs:
            x.requires_grad_(True)
    return xs


def _call(fn, xs, **kw):
    q, k, v, g, beta, *s0 = xs
    return fn(q, k, v, g, beta, initial_state_BHKV=s0[0] if s0 else None, **kw)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
def test_chunked_matches_recurrent_forward_and_backward(T, chunk, init):
    xs = _inputs(T=T, init=init, requires_grad=True)
    o_ref, s_ref = _call(gated_delta_rule_recurrent, xs)
    o, s = _call(gated_delta_rule_chunked, xs, chunk_size=chunk)
    assert o.shape == (2, T, 3, 5) and s.shape == (2, 3, 7, 5)
    # fp32 table tolerance; observed max |diff| over this grid: out 4e-7, state 6e-7, grads 4e-6
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    g_ref = grads(torch.cat([o_ref.flatten(), s_ref.flatten()]), *xs)
    g_chk = grads(torch.cat([o.flatten(), s.flatten()]), *xs)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "s0"], g_chk, g_ref):
        assert a is not None and b is not None, name
        assert_close(a, b, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_matches_transformers_reference(init, qk_norm):
    # transformers: same layout [B, T, H, D], g/beta [B, T, H], state [B, H, K, V]; scale K^-0.5
    # always applied to q; use_qk_l2norm_in_kernel=True == our l2_normalize(eps=1e-6) before.
    T = 70  # > one 64-chunk, not a multiple of it
    q, k, v, g, beta, *s0 = _inputs(T=T, init=init, seed=1)
    if qk_norm:
        q, k = q * 3 + 0.5, k * 2 - 0.1  # un-normalised: their kernel normalises
    kw = {"initial_state": s0[0] if s0 else None, "output_final_state": True, "use_qk_l2norm_in_kernel": qk_norm}
    o_hf_rec, s_hf_rec = torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_hf_chk, s_hf_chk = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, **kw)
    qn, kn = (l2_normalize(q), l2_normalize(k)) if qk_norm else (q, k)
    ours = {"initial_state_BHKV": s0[0] if s0 else None}
    o_rec, s_rec = gated_delta_rule_recurrent(qn, kn, v, g, beta, **ours)
    o_chk, s_chk = gated_delta_rule_chunked(qn, kn, v, g, beta, chunk_size=64, **ours)
    for o, s in [(o_rec, s_rec), (o_chk, s_chk)]:  # observed max |diff| <= 3e-7
        assert_close(o, o_hf_rec)
        assert_close(s, s_hf_rec)
        assert_close(o, o_hf_chk)
        assert_close(s, s_hf_chk)


def test_hand_computed_two_tokens():
    # H=1, K=V=2, scale=1 (explicit), gate a = exp(g) = 0.5 both steps.
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]]).view(1, 2, 1, 2)
    v = torch.tensor([[2.0, 3.0], [1.0, -1.0]]).view(1, 2, 1, 2)
    g = torch.full((1, 2, 1), math.log(0.5))
    beta = torch.tensor([0.5, 1.0]).view(1, 2, 1)
    # t=1: S_0 = 0, so delta = beta_1 v_1 = [1, 1.5];  S_1 = k_1 delta^T = [[1, 1.5], [0, 0]]
    #      o_1 = S_1^T q_1 = row 0 of S_1 = [1, 1.5]
    # t=2: a S_1 = [[0.5, 0.75], [0, 0]];  (a S_1)^T k_2 = [0.5*0.6, 0.75*0.6] = [0.3, 0.45]
    #      delta = 1 * (v_2 - [0.3, 0.45]) = [0.7, -1.45]
    #      S_2 = a S_1 + k_2 delta^T = [[0.5 + 0.6*0.7, 0.75 - 0.6*1.45], [0.8*0.7, -0.8*1.45]]
    #          = [[0.92, -0.12], [0.56, -1.16]];  o_2 = S_2^T q_2 = row 1 of S_2 = [0.56, -1.16]
    o_exp = torch.tensor([[1.0, 1.5], [0.56, -1.16]]).view(1, 2, 1, 2)
    s_exp = torch.tensor([[0.92, -0.12], [0.56, -1.16]]).view(1, 1, 2, 2)
    for fn, kw in [(gated_delta_rule_recurrent, {}), (gated_delta_rule_chunked, {"chunk_size": 64}),
                   (gated_delta_rule_chunked, {"chunk_size": 1})]:
        o, s = fn(q, k, v, g, beta, scale=1.0, **kw)
        assert_close(o, o_exp)
        assert_close(s, s_exp)
        # default scale is K^-0.5 applied to q (o is linear in q)
        o_def, _ = fn(q, k, v, g, beta, **kw)
        assert_close(o_def, o_exp * 2**-0.5)


@pytest.mark.parametrize("fn", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_very_negative_gate_forgets(fn):
    # exp(-1e4) == 0 in fp32: every step wipes the state, so S_t = beta_t k_t v_t^T and
    # o_t = scale * beta_t (q_t . k_t) v_t -- the current token only, the initial state ignored.
    q, k, v, g, beta, s0 = _inputs(T=20, init=True, seed=2)
    g = torch.full_like(g, -1e4)
    o, s = fn(q, k, v, g, beta, initial_state_BHKV=s0)
    expected = 7**-0.5 * (beta * (q * k).sum(-1))[..., None] * v
    assert_close(o, expected)
    assert_close(s, beta[:, -1, :, None, None] * k[:, -1, :, :, None] * v[:, -1, :, None, :])
    # and changing every earlier token leaves the last output unchanged
    k2, v2 = k.clone(), v.clone()
    k2[:, :-1], v2[:, :-1] = l2_normalize(torch.randn_like(k2[:, :-1])), torch.randn_like(v2[:, :-1])
    o2, _ = fn(q, k2, v2, g, beta)
    torch.testing.assert_close(o2[:, -1], o[:, -1], atol=0, rtol=0)
    # sanity: with a mild gate the past does matter (the assertion above can fail)
    o3, _ = fn(q, k2, v2, torch.zeros_like(g), beta)
    o4, _ = fn(q, k, v, torch.zeros_like(g), beta)
    assert (o3[:, -1] - o4[:, -1]).abs().max() > 1e-3


def test_no_nan_gradients_with_very_negative_gate():
    xs = _inputs(T=40, init=True, requires_grad=False)
    xs[3] = torch.full_like(xs[3], -1e4)
    for x in xs:
        x.requires_grad_(True)
    o, s = _call(gated_delta_rule_chunked, xs, chunk_size=16)
    for gr in grads(torch.cat([o.flatten(), s.flatten()]), *xs):
        assert torch.isfinite(gr).all()


def test_dtypes_bf16_in_fp32_state():
    q, k, v, g, beta = (x.bfloat16() for x in _inputs(T=9))
    for fn in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        o, s = fn(q, k, v, g, beta)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta)
    o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=4)
    assert_close(o_c, o_r, torch.bfloat16)
    assert_close(s_c, s_r)  # both accumulate in fp32 from the same bf16 inputs


@pytest.mark.parametrize("fn", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_shape_errors(fn):
    q, k, v, g, beta, s0 = _inputs(T=4, init=True)
    bad = {
        "k_BTHK": {"k": k[..., :6]},
        "v_BTHV": {"v": v[:, :3]},
        "g_BTH": {"g": g[..., None]},
        "beta_BTH": {"beta": beta[:, :, :2]},
        "initial_state_BHKV": {"s0": s0.transpose(-1, -2)},
        "q_BTHK must be 4-D": {"q": q[0]},
    }
    for name, over in bad.items():
        a = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "s0": s0} | over
        with pytest.raises(ValueError, match=name):
            fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state_BHKV=a["s0"])
    if fn is gated_delta_rule_chunked:
        with pytest.raises(ValueError, match="chunk_size"):
            fn(q, k, v, g, beta, chunk_size=0)
