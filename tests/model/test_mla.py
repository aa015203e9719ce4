"""MLA: the absorbed latent-space path (with gathered top-k) against the naive path (materialised
per-head K/V, dense mask), forward and backward, dense and sparse, odd shapes; the route table of
`attention_route` row by row, and every route of `MLAttention.attend` against the reference one
(uncached with and without DSA, sliding window, cached rows at different offsets)."""

import dataclasses
from unittest import mock

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.model import mla
from glm5lab.model.cache import KVCache
from glm5lab.model.mla import ROUTES, MLAttention, attention_route
from glm5lab.model.rope import rope_angles
from glm5lab.model.step import DECODE_MAX_TOKENS, is_decode_sized
from tests.conftest import assert_close, grads, uncached_step

K = 6
IMPL_OPTIONS = {"naive": dict(reference=True), "absorbed": dict(absorbed=True), "auto": {}}
"""The model's `attn_impl` values as `Step` options."""


def _layer(spec_changes=None, layer_index=0, **changes):
    widths = dict(qk_nope_head_dim=5, v_head_dim=7, kv_lora_rank=11)
    cfg = ModelConfig.from_preset("tiny", index_topk=K, **(widths | changes))
    torch.manual_seed(0)
    spec = dataclasses.replace(cfg.layers[layer_index], **(spec_changes or {}))
    layer = MLAttention(cfg, spec)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, layer


def _run(layer, cfg, x, impl, topk=None, **options):
    """(out, the top-k the layer hands on) of one uncached forward (DSA as in `cfg`), given `topk`."""
    out, handed, _ = layer(x, uncached_step(cfg, x.shape[1], **IMPL_OPTIONS[impl], **options).layer(0, topk))
    return out, handed


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
    _, shared = _layer(layer_index=1)  # tiny's layer 1: "shared", reusing layer 0's selection
    assert shared.spec.indexer == "shared" and shared.indexer is None
    x = torch.randn(1, 2 * K, cfg.hidden_size)
    step = uncached_step(cfg, x.shape[1], absorbed=True)
    _, topk, _ = full(x, step.layer(0))
    assert topk is not None
    out, handed, _ = shared(x, step.layer(1, topk))
    assert handed is topk  # read, not replaced
    given, reused = _run(shared, cfg, x, "absorbed", topk=topk)
    assert reused is topk
    assert_close(given, out)
    with pytest.raises(ValueError, match="'shared' DSA layer needs the top-k"):
        _run(shared, cfg, x, "absorbed")


def test_unknown_impl_is_refused():
    """MLA layers take no impl any more: the model's `attn_impl` is checked once per forward."""
    cfg, _ = _layer()
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg)
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="impl = 'flash'.*one of"):
        model(ids, attn_impl="flash")
    with pytest.raises(ValueError, match="impl = 'flash'.*one of"):
        model.step(ids, None, attn_impl="flash")


# ---------------------------------------------------------------- the route table

LATENT_MAX_T = 20
"""The table's latent_max_T (a cached dense call of at most 20 queries a row attends in the latent space)."""
ROUTE_TABLE = [  # (reference, absorbed, sparse, cached, T, S, route), index_topk = K: 4 x K = 24 keys
    # reference: always the reference, whatever else holds
    (True, False, False, False, 1, 1, "reference"),
    (True, False, True, False, 17, 97, "reference"),
    (True, True, True, False, 16, 96, "reference"),
    (True, True, False, False, 17, 17, "reference"),
    # absorbed + top-k: gathered, at any T and S
    (False, True, True, False, 1, 7, "latent_gathered"),
    (False, True, True, False, 16, 96, "latent_gathered"),
    (False, True, True, False, 17, 96, "latent_gathered"),
    (False, True, True, False, 17, 97, "latent_gathered"),
    # absorbed, no top-k: masked latent, at any T and S
    (False, True, False, False, 1, 1, "latent_masked"),
    (False, True, False, False, 16, 16, "latent_masked"),
    (False, True, False, False, 17, 17, "latent_masked"),
    (False, True, False, False, 17, 97, "latent_masked"),
    # auto, top-k, T <= 16: gathered at any S
    (False, False, True, False, 1, 7, "latent_gathered"),
    (False, False, True, False, 16, 16, "latent_gathered"),
    (False, False, True, False, 16, 96, "latent_gathered"),
    (False, False, True, False, 16, 97, "latent_gathered"),
    # auto, top-k, T > 16, S > 16 x topk: gathered
    (False, False, True, False, 17, 25, "latent_gathered"),
    (False, False, True, False, 97, 97, "latent_gathered"),
    # auto, top-k, T > 16, S <= 4 x topk: masked latent (visible & top-k)
    (False, False, True, False, 17, 17, "latent_masked"),
    (False, False, True, False, 17, 24, "latent_masked"),
    (False, False, True, False, 24, 24, "latent_masked"),
    # auto, no top-k, T <= 16: masked latent
    (False, False, False, False, 1, 1, "latent_masked"),
    (False, False, False, False, 16, 16, "latent_masked"),
    (False, False, False, False, 16, 97, "latent_masked"),
    # auto, no top-k, T > 16: expanded
    (False, False, False, False, 17, 17, "expanded"),
    (False, False, False, False, 17, 96, "expanded"),
    (False, False, False, False, 97, 97, "expanded"),
]


@pytest.mark.parametrize("reference, absorbed, sparse, cached, T, S, route", ROUTE_TABLE)
def test_attention_route_follows_the_table(reference, absorbed, sparse, cached, T, S, route):
    assert DECODE_MAX_TOKENS == 16 and mla.GATHER_MIN_KEYS_PER_TOPK == 4  # the table's 16 and 4
    assert attention_route(reference=reference, absorbed=absorbed, sparse=sparse, decode_sized=is_decode_sized(T), S=S,
                           index_topk=K, cached=cached, T=T, latent_max_T=LATENT_MAX_T) == route


def test_latent_max_queries_is_the_flop_break_even():
    """C(N+V) / (2(C+R) - (N+R+V)), floored: 512 * 448 / 640 = 358 at GLM-5's widths (the bench preset's too);
    a config whose latent is narrower than the expanded key and value never re-expands."""
    for preset in ("glm5", "bench"):
        assert mla.latent_max_queries(ModelConfig.from_preset(preset)) == 358
    cfg, layer = _layer()
    C, R, N, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    assert layer.latent_max_T == C * (N + V) // (2 * (C + R) - (N + R + V))
    narrow = ModelConfig.from_preset("tiny", kv_lora_rank=2, qk_rope_head_dim=2, qk_nope_head_dim=8, v_head_dim=8)
    assert mla.latent_max_queries(narrow) == narrow.max_position_embeddings


CACHED_DENSE_TABLE = [  # (cached, one_offset, T, route): no reference, absorbed nor top-k; S = 97
    (True, False, LATENT_MAX_T, "latent_masked"),
    (True, True, LATENT_MAX_T, "latent_masked"),
    (True, False, LATENT_MAX_T + 1, "expanded"),  # rows at different offsets: the mask
    (True, True, LATENT_MAX_T + 1, "expanded_blocked"),
    (True, True, 97, "expanded_blocked"),
    (False, False, LATENT_MAX_T + 1, "expanded"),
]


@pytest.mark.parametrize("cached, one_offset, T, route", CACHED_DENSE_TABLE)
def test_cached_dense_rows_of_the_route_table(cached, one_offset, T, route):
    assert attention_route(reference=False, absorbed=False, sparse=False, decode_sized=False, S=97, index_topk=K,
                           cached=cached, T=T, latent_max_T=LATENT_MAX_T, one_offset=one_offset) == route


def test_route_table_covers_every_route():
    assert {row[-1] for row in ROUTE_TABLE + CACHED_DENSE_TABLE} == set(ROUTES)


W = 3  # sliding window of the "swa" scenario (< K - 1: the window matters at every T >= 4)
SCENARIOS = {  # spec changes of tiny's layer 0 and the step's DSA switch
    "dsa": ({}, True),
    "dense": ({}, False),
    "swa": (dict(mixer="swa", window=W, indexer="none", index_cache=False), True),
}
PREFIX, LENGTHS = 9, (3, 9)  # cached rows sit at offsets 3 and 9 (row 0's slots 3..8 hold stale keys)


def _cached_step(cfg, layer, T, use_dsa, lengths=LENGTHS, **options):
    """A cache of 2 rows at `lengths` (prefilled under no_grad with a fixed prefix, then
    truncated) and the step of the next T tokens. Fresh per call: a forward writes its cache."""
    cache = KVCache(cfg, (layer.spec,), 2, PREFIX + 32, dtype=torch.float32, device="cpu")
    x_pre = torch.randn(2, PREFIX, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cos, sin = rope_angles(cache.positions(PREFIX), cfg.qk_rope_head_dim, cfg.rope_theta)
        step = cache.begin(PREFIX, cos, sin, use_dsa=use_dsa, index_topk=K)
        layer(x_pre, step.layer(0))
        cache.commit(PREFIX)
    cache.truncate(torch.tensor(lengths))
    cos, sin = rope_angles(cache.positions(T), cfg.qk_rope_head_dim, cfg.rope_theta)
    step = cache.begin(T, cos, sin, use_dsa=use_dsa, index_topk=K, **options)
    assert step.offsets.tolist() == list(lengths) and step.extent >= max(lengths) + T
    return step, x_pre


def _forced(layer, x, step, route):
    """(out, the route the table would have chosen, the top-k) of `layer.forward` with `attention_route`
    forced to `route` (so `MLAttention.attend` runs it)."""
    natural, chosen = attention_route, []

    def force(**kw):
        chosen.append(natural(**kw))
        return route

    with mock.patch.object(mla, "attention_route", force):
        out, topk, _ = layer(x, step.layer(0))
    assert len(chosen) == 1
    return out, chosen[0], topk


@pytest.mark.parametrize("T", [1, K - 1, K, K + 1, 17])
@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_route_equals_the_reference_forward_and_backward(scenario, cached, T):
    spec_changes, use_dsa = SCENARIOS[scenario]
    cfg, layer = _layer(spec_changes)
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(T), requires_grad=True)
    params = (x, layer.q_b_proj.weight, layer.kv_b_proj.weight)

    def make_step():
        if cached:
            return _cached_step(cfg, layer, T, use_dsa)[0]
        return uncached_step(cfg, T, use_dsa=use_dsa)

    step = make_step()
    ref, natural, topk = _forced(layer, x, step, "reference")
    S = step.extent
    assert (topk is not None) == (scenario == "dsa" and S > K)
    assert natural == attention_route(reference=False, absorbed=False, sparse=topk is not None,
                                      decode_sized=is_decode_sized(T), S=S, index_topk=K, cached=cached, T=T,
                                      latent_max_T=layer.latent_max_T)
    ref_grads = grads(ref, *params)
    routes = [r for r in ROUTES if r != "latent_gathered" or topk is not None]  # gathering needs a top-k
    routes.remove("expanded_blocked")  # needs rows at one offset: test_blocked_route_equals_the_reference
    assert natural in routes
    for route in routes:
        step = make_step()
        out, _, got = _forced(layer, x, step, route)
        if topk is not None:
            assert torch.equal(got.idx_BTK, topk.idx_BTK) and torch.equal(got.valid_BTK, topk.valid_BTK)
        assert_close(out, ref, msg=lambda m, route=route: f"route {route}: {m}")
        for name, a, b in zip(("x", "q_b_proj", "kv_b_proj"), grads(out, *params), ref_grads, strict=True):
            assert_close(a, b, msg=lambda m, route=route, name=name: f"route {route}, grad {name}: {m}")
    if scenario == "swa":  # the window is in force: full attention differs beyond it
        _, full_layer = _layer(dict(indexer="none", index_cache=False))  # the same layer without its window
        full_layer.load_state_dict(layer.state_dict())
        full_step = _cached_step(cfg, full_layer, T, use_dsa)[0] if cached else make_step()  # its own cache: no ring
        full_out, _, _ = _forced(full_layer, x, full_step, "reference")
        if cached or T > W:
            assert (full_out - ref).abs().max() > 1e-3


@pytest.mark.parametrize("T", [1, K - 1, K, K + 1, 17])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cached_rows_at_different_offsets_equal_their_uncached_forward(scenario, T):
    """The reference route of a cached step whose rows sit at offsets 3 and 9 == each row's own
    uncached forward over its prefix and the T new tokens (at those T positions)."""
    spec_changes, use_dsa = SCENARIOS[scenario]
    cfg, layer = _layer(spec_changes)
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        step, x_pre = _cached_step(cfg, layer, T, use_dsa, reference=True)
        cached, _, _ = layer(x, step.layer(0))
        for b, L in enumerate(LENGTHS):
            seq = torch.cat([x_pre[b:b + 1, :L], x[b:b + 1]], dim=1)
            alone, _, _ = layer(seq, uncached_step(cfg, L + T, use_dsa=use_dsa, reference=True).layer(0))
            assert_close(cached[b:b + 1], alone[:, L:])


@pytest.mark.parametrize("T", [17, 24, 25, 26])
@pytest.mark.parametrize("scenario", ["dense", "swa"])
def test_cached_dense_calls_attend_in_the_latent_space_up_to_the_break_even(scenario, T):
    """A cached dense call (a prefill chunk; SWA's over [ring | chunk]) longer than decode-sized takes the latent
    route up to `latent_max_queries` queries a row (25 at tiny's widths), the expanded one past it; either equals
    the reference forward and backward."""
    spec_changes, use_dsa = SCENARIOS[scenario]
    cfg, layer = _layer(spec_changes, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32)
    assert layer.latent_max_T == 25
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(T), requires_grad=True)
    params = (x, layer.q_b_proj.weight, layer.kv_b_proj.weight)
    ref, natural, _ = _forced(layer, x, _cached_step(cfg, layer, T, use_dsa)[0], "reference")
    assert natural == ("latent_masked" if T <= 25 else "expanded")
    out, _, _ = layer(x, _cached_step(cfg, layer, T, use_dsa)[0].layer(0))
    assert_close(out, ref)
    for a, b in zip(grads(out, *params), grads(ref, *params), strict=True):
        assert_close(a, b)


BLOCK = 4
"""`mla.KEY_BLOCK` in the blocked-route tests: cached prefixes of 0..9 keys make 0..3 blocks, the last partial."""


@pytest.mark.parametrize("T", [1, K - 1, 26])
@pytest.mark.parametrize("offset", [0, BLOCK - 1, BLOCK, BLOCK + 1, PREFIX])
def test_blocked_route_equals_the_reference(offset, T):
    """A cached dense call whose rows share one offset (a prefill chunk) takes "expanded_blocked" past
    `latent_max_queries` (25 here); forced at any T it equals the reference forward and backward (fp32 tolerance
    `tests.conftest.TOL`), with stale keys in the slots past the offset."""
    cfg, layer = _layer(SCENARIOS["dense"][0], qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32)
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(T), requires_grad=True)
    params = (x, layer.q_b_proj.weight, layer.kv_b_proj.weight)
    ref, natural, _ = _forced(layer, x, _cached_step(cfg, layer, T, False, lengths=(offset, offset))[0], "reference")
    assert natural == ("expanded_blocked" if T > layer.latent_max_T else "latent_masked")
    with mock.patch.object(mla, "KEY_BLOCK", BLOCK):
        out, _, _ = _forced(layer, x, _cached_step(cfg, layer, T, False, lengths=(offset, offset))[0],
                            "expanded_blocked")
    assert_close(out, ref)
    for a, b in zip(grads(out, *params), grads(ref, *params), strict=True):
        assert_close(a, b)


def test_blocked_route_refuses_rows_at_different_offsets():
    cfg, layer = _layer(SCENARIOS["dense"][0])
    x = torch.randn(2, 3, cfg.hidden_size)
    with pytest.raises(ValueError, match="rows share one offset"):
        _forced(layer, x, _cached_step(cfg, layer, 3, False)[0], "expanded_blocked")
