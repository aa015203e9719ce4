"""The fast DSA kernels against their references: the blocked lightning indexer and its top-k
(`dsa_blocked`, `select_topk_fast`) against `LightningIndexer.scores` + `select_topk`; the
gathered index scores and the sparse-stage indexer KL against the dense-mask forms (forward and
backward); the query-blocked sparse core attention against `attention_reference`.

Tolerances: fp32 scores and attention outputs 1e-5 absolute (values O(1)); gradients 1e-4
of their largest entry (fp32 sums in another order). Selected indices: exact (ties by position
in both; the blocked scores are computed in the reference's order, bitwise equal in these
shapes; see dsa_blocked's docstring for where a GEMM's edge tiles can differ by 1 ulp)."""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.model.attention import TopK, attention_latent_gathered, attention_reference, topk_mask
from glm5lab.model.visibility import visible
from glm5lab.model.dsa import LightningIndexer
from glm5lab.model.topk import select_topk, select_topk_fast
from glm5lab.model.dsa_blocked import index_score_blocks, index_topk_blocked
from glm5lab.model.rope import rope_angles

ATOL = 1e-5
GRAD_RTOL = 1e-4


def _indexer(preset="tiny", seed=0, **overrides):
    cfg = ModelConfig.from_preset(preset, **overrides)
    torch.manual_seed(seed)
    ix = LightningIndexer(cfg)
    for p in ix.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return cfg, ix


def _inputs(cfg, B, T, S, seed=1):
    """Query inputs for positions S-T..S-1 and keys for 0..S-1 (a cached call when S > T)."""
    g = torch.Generator().manual_seed(seed)
    x_keys = torch.randn(B, S, cfg.hidden_size, generator=g)
    q_lat = torch.randn(B, T, cfg.q_lora_rank, generator=g)
    cos, sin = rope_angles(torch.arange(S), cfg.qk_rope_head_dim, cfg.rope_theta)
    return x_keys, q_lat, cos, sin


def _both(ix, x_keys, q_lat, cos, sin, k, q_offset, **blocks):
    """(reference TopK, blocked TopK, reference scores) of the last T positions."""
    T, S = q_lat.shape[1], x_keys.shape[1]
    x_q, cq, sq = x_keys[:, S - T:], cos[S - T:], sin[S - T:]
    k_BSJ = ix.keys(x_keys, cos, sin)
    scores = ix.scores(x_q, q_lat, k_BSJ, cq, sq, q_offset=q_offset)
    ref = select_topk(scores, k, q_offset=q_offset)
    q_BTIJ, w_BTI = ix.queries(x_q, q_lat, cq, sq)
    fast = index_topk_blocked(q_BTIJ, w_BTI, k_BSJ, k, scale=ix.head_dim**-0.5, q_offset=q_offset, **blocks)
    return ref, fast, scores


@pytest.mark.parametrize("T", [1, 7, 8, 9, 23])
@pytest.mark.parametrize("k", [1, 7, 8, 9])
def test_blocked_topk_equals_reference_exactly(T, k):
    """Odd shapes: T = 1, T around index_topk (8), blocks that do not divide T or S (5 x 7)."""
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 2, T, T)
    ref, fast, _ = _both(ix, x, q_lat, cos, sin, k, 0, query_block=5, key_block=7)
    assert torch.equal(fast.idx_BTK, ref.idx_BTK)
    assert torch.equal(fast.valid_BTK, ref.valid_BTK)


@pytest.mark.parametrize("T, S", [(1, 30), (6, 30), (16, 17), (17, 40)])
def test_blocked_topk_cached_int_and_per_row_offsets(T, S):
    """A chunk of T queries over S keys (offset S - T): int offset and per-row [B] offsets, equal
    or ragged (the second row 5 tokens shorter: cached rows of different lengths)."""
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 2, T, S)
    for offset in (S - T, torch.tensor([S - T, S - T]), torch.tensor([S - T, max(0, S - T - 5)])):
        ref, fast, _ = _both(ix, x, q_lat, cos, sin, 8, offset, query_block=4, key_block=9)
        assert torch.equal(fast.idx_BTK, ref.idx_BTK)
        assert torch.equal(fast.valid_BTK, ref.valid_BTK)


def test_blocked_scores_equal_reference_to_fp32_tolerance():
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 2, 19, 19)
    k_BSJ = ix.keys(x, cos, sin)
    ref = ix.scores(x, q_lat, k_BSJ, cos, sin)
    q_BTIJ, w_BTI = ix.queries(x, q_lat, cos, sin)
    for t0, block in index_score_blocks(q_BTIJ, w_BTI, k_BSJ, scale=ix.head_dim**-0.5, query_block=6, key_block=5):
        want = ref[:, t0:t0 + block.shape[1], :block.shape[2]]
        assert torch.equal(block.isinf(), want.isinf())
        torch.testing.assert_close(block, want, atol=ATOL, rtol=0)
        assert torch.isinf(ref[:, t0:t0 + block.shape[1], block.shape[2]:]).all()  # skipped keys: all future


def test_indexer_topk_method_dispatch_and_bench_shapes():
    """`LightningIndexer.topk` (auto: blocked above 16 queries) equals the reference at the bench
    preset's indexer (4 heads x 128, top-256), T = 300 > index_topk."""
    cfg, ix = _indexer("bench")
    x, q_lat, cos, sin = _inputs(cfg, 1, 300, 300)
    k_BSJ = ix.keys(x, cos, sin)
    ref = select_topk(ix.scores(x, q_lat, k_BSJ, cos, sin), cfg.index_topk)
    for blocked in (None, True):
        got = ix.topk(x, q_lat, k_BSJ, cos, sin, cfg.index_topk, blocked=blocked)
        assert torch.equal(got.idx_BTK, ref.idx_BTK)
    with pytest.raises(ValueError, match="index_topk must be >= 1"):
        ix.topk(x, q_lat, k_BSJ, cos, sin, 0, blocked=True)


def _tie_heavy(B, T, S, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, (B, T, S), generator=g).float() / 2  # 7 values: ties everywhere
    s[s == 0.5] = -0.0
    return s.masked_fill(~visible(S - T, T, S)[0], float("-inf"))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 3, 10, 29])
def test_select_topk_fast_is_the_stable_sort_prefix(seed, k):
    """Exact ties (and -0.0 against +0.0, and -inf slots) at and inside the boundary."""
    s = _tie_heavy(2, 9, 30, seed)
    ref, fast = select_topk(s, k, q_offset=21), select_topk_fast(s, k, q_offset=21)
    assert torch.equal(fast.idx_BTK, ref.idx_BTK) and torch.equal(fast.valid_BTK, ref.valid_BTK)
    distinct = torch.randn(2, 9, 30)
    assert torch.equal(select_topk_fast(distinct, k).idx_BTK, select_topk(distinct, k).idx_BTK)


def test_scores_at_equals_reference_forward_and_backward():
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 2, 13, 13)
    x.requires_grad_(True)
    idx, valid = select_topk(ix.scores(x, q_lat, ix.keys(x, cos, sin), cos, sin).detach(), 5)
    weight = torch.randn(2, 13, 5) * valid  # invalid slots (future keys of early queries) carry no loss

    def loss(gathered: bool):
        ix.zero_grad()
        x.grad = None
        k_BSJ = ix.keys(x, cos, sin)
        if gathered:
            s = ix.scores_at(x, q_lat, k_BSJ, cos, sin, idx)
        else:
            s = ix.scores(x, q_lat, k_BSJ, cos, sin).gather(-1, idx)
        (s.masked_fill(~valid, 0.0) * weight).sum().backward()
        return s.detach(), [p.grad.clone() for p in ix.parameters()] + [x.grad.clone()]

    (s_ref, g_ref), (s_fast, g_fast) = loss(False), loss(True)
    torch.testing.assert_close(s_fast[valid], s_ref[valid], atol=ATOL, rtol=0)
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=GRAD_RTOL * b.abs().max().item(), rtol=0)


def test_sparse_indexer_kl_equals_dense_mask_reference_forward_and_backward():
    """The sparse stage's indexer KL at the selected keys only (auto) against the dense-mask form
    (attn_impl="naive"): same loss, same indexer gradients. T = 40 > index_topk = 8."""
    cfg = ModelConfig.from_preset("tiny", num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))

    def kl(attn_impl):
        model.zero_grad()
        out = model(ids, use_dsa=True, indexer_loss=True, attn_impl=attn_impl)
        out.indexer_loss.backward()
        return out.indexer_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}

    (kl_ref, g_ref), (kl_fast, g_fast) = kl("naive"), kl("auto")
    torch.testing.assert_close(kl_fast, kl_ref, atol=1e-6, rtol=1e-5)
    assert set(g_fast) == set(g_ref) and all(".indexer." in n for n in g_ref)
    for n in g_ref:
        torch.testing.assert_close(g_fast[n], g_ref[n], atol=GRAD_RTOL * g_ref[n].abs().max().item(), rtol=0)


@pytest.mark.parametrize("T, S, K, block", [(1, 9, 4, 16), (5, 9, 4, 2), (17, 17, 16, 16), (18, 33, 17, 5)])
def test_sparse_core_equals_reference_forward_and_backward(T, S, K, block):
    """Blocked gathered latent attention vs the explicit masked reference, per-row offsets
    (cached rows of different lengths), invalid slots included; T = 1, K around T, odd blocks."""
    g = torch.Generator().manual_seed(T * 100 + K)
    B, H, X, V = 2, 3, 11, 7
    q = torch.randn(B, T, H, X, generator=g, requires_grad=True)
    kv = torch.randn(B, S, X, generator=g, requires_grad=True)
    offsets = torch.tensor([S - T, S - T - 2 if S - T >= 2 else 0])
    scores = torch.randn(B, T, S, generator=g).masked_fill(~_visible_rows(offsets, T, S), float("-inf"))
    topk = select_topk(scores, K, q_offset=offsets)
    mask = topk_mask(topk, S)

    def run(fast: bool):
        q.grad = kv.grad = None
        if fast:
            o = attention_latent_gathered(q, kv, v_dim=V, scale=0.3, topk=topk, query_block=block)
        else:
            o = attention_reference(q, kv[:, :, None], kv[:, :, None, :V], scale=0.3, mask_BTS=mask)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        return o.detach(), q.grad.clone(), kv.grad.clone()

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)
    with pytest.raises(ValueError, match="query_block must be >= 1"):
        attention_latent_gathered(q, kv, v_dim=V, scale=0.3, topk=topk, query_block=0)


def _visible_rows(offsets, T, S):
    return torch.arange(S) <= (offsets[:, None] + torch.arange(T))[..., None]


def test_model_logits_blocked_equal_reference_selection():
    """A whole DSA forward (T = 40 > 16: the blocked selection) equals the same forward with the
    reference selection, bit for bit (same keys, same order, same kernels after selection)."""
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fast = model(ids, use_dsa=True).logits
        original = LightningIndexer.topk
        try:
            LightningIndexer.topk = lambda self, *a, **kw: original(self, *a, **{**kw, "blocked": False})
            ref = model(ids, use_dsa=True).logits
        finally:
            LightningIndexer.topk = original
    assert torch.equal(fast, ref)


def test_topk_namedtuple_is_what_blocked_returns():
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 1, 3, 3)
    _, fast, _ = _both(ix, x, q_lat, cos, sin, 8, 0)
    assert isinstance(fast, TopK) and fast.idx_BTK.dtype == torch.long and fast.idx_BTK.shape == (1, 3, 3)


@pytest.mark.parametrize("S", [4096, 8195, 49155])
@pytest.mark.parametrize("decimals", [None, 2, 0])
def test_select_topk_fast_on_long_rows_with_ties(S, decimals):
    """Long rows (8195 and 49155: the grouped shortlist of `_topk_grouped`, groups of 8 and 32,
    with a tail that fills no group), scores rounded to 2 or 0 decimals (at 0 every row ties at
    the boundary and is re-ranked), -inf keys of a chunk's early queries: the values are
    torch.topk's, the choice the stable sort's."""
    from glm5lab.model.topk import _topk_grouped

    g = torch.Generator().manual_seed(7)
    s = torch.randn(2, 5, S, generator=g)
    s = s if decimals is None else s.round(decimals=decimals)
    s = s.masked_fill(~visible(S - 5, 5, S)[0], float("-inf"))
    vals, idx = _topk_grouped(s, 10)
    assert torch.equal(vals, s.topk(10, dim=-1).values) and torch.equal(s.gather(-1, idx), vals)
    ref, fast = select_topk(s, 9, q_offset=S - 5), select_topk_fast(s, 9, q_offset=S - 5)
    assert torch.equal(fast.idx_BTK, ref.idx_BTK) and torch.equal(fast.valid_BTK, ref.valid_BTK)


def test_blocked_topk_small_preset_bitwise_over_seeds():
    """The small preset's indexer (16 heads x 32: 1/sqrt(J) is not a power of two), T = 600: the
    blocked scores are the reference's bit for bit, so every index matches (3 inputs)."""
    cfg, ix = _indexer("small")
    for seed in range(3):
        x, q_lat, cos, sin = _inputs(cfg, 1, 600, 600, seed=seed)
        ref, fast, _ = _both(ix, x, q_lat, cos, sin, cfg.index_topk, 0)
        assert torch.equal(fast.idx_BTK, ref.idx_BTK)


def test_select_topk_fast_nan_rows_follow_the_reference():
    """Both rank NaN (either sign) first, torch.topk in no defined order among NaNs: rows with a
    NaN are re-ranked, so both choose alike (tests/model/test_topk_causal.py: never a future key)."""
    nan = torch.tensor(float("nan"))
    s = torch.tensor([[[0.1, 0.5, 0.0, 0.2, 0.4, 0.6], [0.3, 0.1, 0.2, 0.9, 0.8, 0.7]]])
    s[0, 0, 2] = -(nan.abs())  # -NaN, as inf - inf gives on x86
    s[0, 1, 0] = nan.abs()
    for k in (1, 3, 5):
        assert torch.equal(select_topk_fast(s, k).idx_BTK, select_topk(s, k).idx_BTK)


def test_blocked_kernels_under_a_float64_default_dtype():
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 1, 20, 20)
    k_BSJ = ix.keys(x, cos, sin)
    ref = select_topk(ix.scores(x, q_lat, k_BSJ, cos, sin), 8)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = ix.topk(x, q_lat, k_BSJ, cos, sin, 8, blocked=True)
        q, kv = torch.randn(1, 20, 2, 5, dtype=torch.float32), torch.randn(1, 20, 5, dtype=torch.float32)
        with torch.no_grad():
            o = attention_latent_gathered(q, kv, v_dim=3, scale=0.5, topk=got)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(got.idx_BTK, ref.idx_BTK) and o.dtype == torch.float32


def test_blocked_kernels_refuse_bad_shapes_at_the_call():
    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 2, 9, 9)
    q, w = ix.queries(x, q_lat, cos, sin)
    k_BSJ = ix.keys(x, cos, sin)
    with pytest.raises(ValueError, match="query_block and key_block must be >= 1"):
        index_score_blocks(q, w, k_BSJ, scale=1.0, query_block=0)  # raised before the first block
    with pytest.raises(ValueError, match=r"indexer shapes do not agree: q \(2, 9, 16, 16\)"):
        index_topk_blocked(q, w, k_BSJ[:1], 4, scale=1.0)
    with pytest.raises(ValueError, match="indexer shapes do not agree"):
        index_topk_blocked(q, w[..., :3], k_BSJ, 4, scale=1.0)
    topk = select_topk(ix.scores(x, q_lat, k_BSJ, cos, sin), 4)
    with pytest.raises(ValueError, match="sparse attention shapes do not agree"):
        attention_latent_gathered(torch.randn(2, 8, 2, 5), torch.randn(2, 9, 5), v_dim=3, scale=0.5, topk=topk)


@pytest.mark.parametrize("q_offset", [0, 5])
def test_score_blocks_make_nothing_on_the_cpu(q_offset):
    """Device-agnostic: on the meta device every tensor the blocks make must be on meta too. A mask made with an
    int offset and no device= lands on the CPU: that made `glm5lab train` fail on CUDA at the first sparse step
    ("Expected all tensors to be on the same device, cuda:0 and cpu", scripts/gpu_check.sh), and fails here."""
    B, T, I, J, S = 2, 20, 3, 8, 25
    q, w, k = (torch.empty(*shape, device="meta") for shape in ((B, T, I, J), (B, T, I), (B, S, J)))
    blocks = list(index_score_blocks(q, w, k, scale=J**-0.5, q_offset=q_offset, query_block=8, key_block=16))
    assert [t0 for t0, _ in blocks] == [0, 8, 16] and all(s.device.type == "meta" for _, s in blocks)
    assert visible(q_offset, 4, torch.arange(3, device="meta")).device.type == "meta"  # keys' device by default


@pytest.mark.parametrize("layout", ["head_tail", "round_robin", "contiguous"])
@pytest.mark.parametrize("T, k", [(24, 8), (16, 7), (40, 9)])
def test_blocked_topk_at_explicit_positions_equals_one_process(layout, T, k):
    """A context-parallel rank's queries (explicit positions [1, n], `glm5lab.model.visibility`) over all T
    keys: the blocked kernel and the reference choose exactly the rows of the whole sequence's choice, on
    every rank of a CP group of 2 and 4, with blocks that do not divide n or T."""
    from glm5lab.parallel.context_parallel import positions

    cfg, ix = _indexer()
    x, q_lat, cos, sin = _inputs(cfg, 2, T, T)
    whole, _, _ = _both(ix, x, q_lat, cos, sin, k, 0)
    k_BSJ = ix.keys(x, cos, sin)
    for cp in (2, 4):
        for rank in range(cp):
            pos = positions(T, cp, rank, layout)
            xq, ql, cq, sq = x[:, pos], q_lat[:, pos], cos[pos], sin[pos]
            ref = select_topk(ix.scores(xq, ql, k_BSJ, cq, sq, q_offset=pos[None]), k, q_offset=pos[None])
            q_BTIJ, w_BTI = ix.queries(xq, ql, cq, sq)
            fast = index_topk_blocked(q_BTIJ, w_BTI, k_BSJ, k, scale=ix.head_dim**-0.5, q_offset=pos[None],
                                      query_block=3, key_block=5)
            for got in (ref, fast):
                assert torch.equal(got.idx_BTK, whole.idx_BTK[:, pos])
                assert torch.equal(got.valid_BTK, whole.valid_BTK[:, pos])
