"""DSA never selects a key after its query, whatever the index scores hold (issue 24).

Every selector (the reference `select_topk`, `select_topk_fast`, its grouped shortlist for
long rows, the blocked kernel), prefill and decode (per-row offsets), is fed scores with NaN of
both signs (a -NaN is what inf * 0 gives on x86), +-inf, ties and block edges. The rule: NaN
ranks first, as torch.topk (and so transformers) ranks it; keys after the query (-inf by
construction) rank after every visible key, a visible -inf included. Indices are exact.
"""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.infer.steps import decode_step, prefill
from glm5lab.model.cache import KVCache
from glm5lab.model.dsa import LightningIndexer
from glm5lab.model.topk import select_topk, select_topk_fast
from glm5lab.model.dsa_blocked import index_topk_blocked
from glm5lab.model.rope import rope_angles

NAN = float("nan")
INF = float("inf")


def _neg_nan() -> torch.Tensor:
    t = -(torch.tensor(NAN).abs())
    assert t.view(torch.int32) < 0  # the sign bit is set
    return t


def _visible(q_offset, B, T, S):
    offset = q_offset[:, None] if torch.is_tensor(q_offset) else torch.full((B, 1), q_offset)
    return torch.arange(S) <= (offset + torch.arange(T))[..., None]  # [B, T, S]


def _assert_causal(topk, q_offset, S):
    """Every valid slot holds a key at or before its query's position; each row's valid keys distinct."""
    B, T, K = topk.idx_BTK.shape
    pos_BT1 = ((q_offset[:, None] if torch.is_tensor(q_offset) else q_offset) + torch.arange(T)).reshape(-1, T, 1)
    future = (topk.idx_BTK > pos_BT1) & topk.valid_BTK
    assert not future.any(), f"a future key is selected at {future.nonzero().tolist()[:5]}"
    n_causal = (pos_BT1[..., 0] + 1).clamp(max=S).expand(B, T)
    assert torch.equal(topk.valid_BTK.sum(-1), n_causal.clamp(max=K))


def _poisoned(B, T, S, q_offset, seed):
    """Random scores with NaN of both signs, +-inf and ties at visible keys; -inf after each query."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, S, generator=g).round(decimals=1)
    kinds = torch.tensor([NAN, _neg_nan().item(), INF, -INF, 0.0, -0.0])
    pick = torch.randint(0, 12, (B, T, S), generator=g)
    s = torch.where(pick < len(kinds), kinds[pick.clamp(max=len(kinds) - 1)], s)
    return s.masked_fill(~_visible(q_offset, B, T, S), -INF)


def test_the_issue_example_selects_no_future_key():
    s = torch.tensor([[[1.0, 1.0, 1.0, -INF]]])
    s[0, 0, 1] = _neg_nan()
    for select in (select_topk, select_topk_fast):
        top = select(s, 3, q_offset=2)
        assert top.idx_BTK.tolist() == [[[1, 0, 2]]]  # NaN first (torch.topk's rank), then ties by position
        assert top.valid_BTK.all()


@pytest.mark.parametrize("nan", [NAN, "neg"])
def test_nan_ranks_first_as_torch_topk_ranks_it(nan):
    """A NaN of either sign is chosen before +inf, like torch.topk; distinct scores otherwise."""
    s = torch.tensor([[[0.5, 3.0, 0.0, INF, -1.0, 2.0]]])
    s[0, 0, 4] = _neg_nan() if nan == "neg" else NAN
    expected = s.topk(4, dim=-1).indices  # NaN, inf, 3, 2: no ties among the four
    for select in (select_topk, select_topk_fast):
        assert torch.equal(select(s, 4, q_offset=5).idx_BTK, expected)


@pytest.mark.parametrize("T, S, k", [(1, 1, 1), (5, 5, 4), (5, 5, 5), (5, 5, 6), (7, 40, 8), (9, 300, 9), (3, 9000, 16)])
def test_every_selector_is_causal_on_poisoned_scores(T, S, k):
    """Reference and fast (and, at 9000 keys, the grouped shortlist) on scores full of NaN of both
    signs, +-inf and ties, int offset: no future key, and the fast choice is the reference's."""
    for seed in range(4):
        offset = S - T
        s = _poisoned(2, T, S, offset, seed)
        ref, fast = select_topk(s, k, q_offset=offset), select_topk_fast(s, k, q_offset=offset)
        _assert_causal(ref, offset, S)
        assert torch.equal(fast.idx_BTK, ref.idx_BTK) and torch.equal(fast.valid_BTK, ref.valid_BTK)


def test_decode_rows_of_different_lengths_are_causal():
    """Decode (T = 1) and a verification chunk (T = 4) over a cache of 30 slots with per-row
    offsets 3, 17 and 29: slots past a short row's length are -inf and are never chosen."""
    for T in (1, 4):
        offset = torch.tensor([3, 17, 29 - T + 1])
        for seed in range(4):
            s = _poisoned(3, T, 30, offset, seed)
            for k in (1, 5, 8):
                ref, fast = select_topk(s, k, q_offset=offset), select_topk_fast(s, k, q_offset=offset)
                _assert_causal(ref, offset, 30)
                assert torch.equal(fast.idx_BTK, ref.idx_BTK)


def _indexer_inputs(T, S, poison_at, sign, seed=0):
    """An indexer whose queries at the tokens `poison_at` are +-inf: their scores are +-inf or
    NaN (inf - inf in the head sum, inf * 0 where a ReLU is 0)."""
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(seed)
    ix = LightningIndexer(cfg)
    for p in ix.parameters():
        torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, S, cfg.hidden_size, generator=g)
    q_lat = torch.randn(2, T, cfg.q_lora_rank, generator=g)
    cos, sin = rope_angles(torch.arange(S), cfg.qk_rope_head_dim, cfg.rope_theta)
    k_BSJ = ix.keys(x, cos, sin)
    q_BTIJ, w_BTI = ix.queries(x[:, S - T:], q_lat, cos[S - T:], sin[S - T:])
    q_BTIJ[:, poison_at] = sign * INF
    w_BTI[:, poison_at, 0] = 0.0  # inf * 0 in the head sum: a -NaN on x86
    return ix, q_BTIJ, w_BTI, k_BSJ


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("T, S, qb, kb", [(23, 23, 5, 7), (23, 23, 64, 1024), (9, 30, 4, 9), (17, 17, 16, 16)])
def test_blocked_kernel_is_causal_with_infinite_queries(sign, T, S, qb, kb):
    """The blocked kernel with +-inf queries at block edges (the first and last query of a query
    block, the last token): no future key, and the same indices as the reference selector on the
    same scores, NaN rows included."""
    poison = sorted({p for p in (0, qb - 1, qb, T - 1) if p < T})
    ix, q_BTIJ, w_BTI, k_BSJ = _indexer_inputs(T, S, poison, sign)
    offset = S - T
    fast = index_topk_blocked(q_BTIJ, w_BTI, k_BSJ, 8, scale=ix.head_dim**-0.5, q_offset=offset,
                              query_block=qb, key_block=kb)
    with torch.no_grad():
        dots = torch.einsum("btij,bsj->btis", q_BTIJ, k_BSJ) * ix.head_dim**-0.5
        scores = torch.einsum("bti,btis->bts", w_BTI, dots.relu()).masked_fill(~_visible(offset, 2, T, S), -INF)
    assert scores[:, poison].isnan().any()  # the poison reached the scores
    ref = select_topk(scores, 8, q_offset=offset)
    _assert_causal(fast, offset, S)
    assert torch.equal(fast.idx_BTK, ref.idx_BTK) and torch.equal(fast.valid_BTK, ref.valid_BTK)


def _poison_indexer_queries(model, position: int, sign: float):
    """Hook layer 0's indexer query projection: +-inf at one token (an fp16 overflow's result)."""
    def hook(module, args, out):
        out = out.clone()
        out[:, position] = sign * INF
        return out
    return model.model.layers[0].self_attn.indexer.wq_b.register_forward_hook(hook)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("T", [12, 24])
def test_model_logits_do_not_depend_on_the_future_under_infinite_index_queries(sign, T):
    """The tiny model (top-8) with layer 0's indexer queries forced to +-inf at token 9 (T = 12:
    the reference selection, T = 24: the blocked one): the logits at positions 0..9 are finite
    and do not change when every later token changes."""
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    other = ids.clone()
    other[:, 10:] = torch.randint(0, cfg.vocab_size, (2, T - 10), generator=g)
    handle = _poison_indexer_queries(model, 9, sign)
    try:
        with torch.no_grad():
            a, b = model(ids, use_dsa=True).logits[:, :10], model(other, use_dsa=True).logits[:, :10]
    finally:
        handle.remove()
    assert torch.isfinite(a).all()
    # equal up to the rounding of batched expert matmuls, whose row groups hold the later tokens
    # too (fp32, 1e-5: a future key that is attended moves these logits by ~0.1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cached_decode_with_infinite_index_queries_matches_full_recompute():
    """Prefill 9 tokens into a cache of 20 slots, then decode token 9 with its indexer queries at
    -inf: the slots after it are empty (never written) and are not attended; the decoded logits
    equal the full forward's at position 9."""
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    handle = _poison_indexer_queries(model, 9, -1.0)
    try:
        with torch.no_grad():
            full = model(ids, use_dsa=True).logits[:, 9]
    finally:
        handle.remove()
    cache = KVCache.for_model(model, batch=2, capacity=20)
    with torch.no_grad():
        prefill(model, ids[:, :9], cache)
        handle = _poison_indexer_queries(model, 0, -1.0)
        try:
            last = decode_step(model, ids[:, 9], cache)
        finally:
            handle.remove()
    assert torch.isfinite(last).all()
    torch.testing.assert_close(last, full, atol=1e-5, rtol=1e-5)
