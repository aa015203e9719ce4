"""Cached decoding (`glm5lab.model.cache.KVCache`) against a full recompute.

What is tied to what:
- Logits of a cached forward (any chunk schedule, any `attn_impl`, rows of different lengths,
  after `truncate` rollbacks and `keep_rows`) == logits of `model(ids)` without a cache
  (`attn_impl="naive"`, the reference) at the same positions of the same sequence.
- `mtp_step` through `KVCache.for_mtp` == the MTP layer applied uncached over positions 0..T-1.
- DSA is on in the cached path: with `index_topk` < context, the cached logits differ from those
  of the same weights with `use_dsa=False` by far more than the tolerance (and are identical
  while every query has <= index_topk keys).
- `bytes_per_token()` == `glm5lab.ledger.state(...)[part]["bytes_per_token"]` (and hand counts);
  buffer shapes hold one latent (+ one indexer key on "full" layers) per token, nothing per head.
Tolerance: fp32 from `tests.conftest.TOL` (atol 1e-5 / rtol 1e-5; observed <= 3e-7 here);
lengths and other integers exactly.

Runtime: every test runs torch single-threaded (module fixture): on the 2-core CI box, shared with
other jobs, intra-op threads make each tiny forward ~10x slower.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.ledger import state
from glm5lab.model import mla as mla_module
from glm5lab.model.cache import CacheOverflowError, KVCache
from tests.conftest import TOL, assert_close, uncached_step

IMPLS = ("naive", "absorbed", "auto")
V = 512  # tiny vocab
ATOL = TOL[torch.float32]["atol"]


pytestmark = pytest.mark.usefixtures("single_thread_no_grad")


def gqa_cfg() -> ModelConfig:
    """Every layer GQA (4 query heads over 2 KV heads): no MLA, so no indexer and no DSA."""
    return ModelConfig.from_preset("tiny").replace(
        attention_types=["gqa"] * 4, num_key_value_heads=2, index_n_heads=0, index_head_dim=0, use_dsa=False)


def mixed_cfg() -> ModelConfig:
    """MLA / GQA alternating; layer 2 is a "shared" DSA layer reusing layer 0's top-k across the GQA
    layer 1; the MTP layer copies the last (GQA) layer."""
    return ModelConfig.from_preset("tiny").replace(
        attention_types=["mla", "gqa", "mla", "gqa"], indexer_types=["full", "shared", "shared", "full"])


def build(cfg: ModelConfig, like: GLM5ForCausalLM | None = None) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).eval()
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model


@pytest.fixture(scope="module")
def tiny() -> GLM5ForCausalLM:
    return build(ModelConfig.from_preset("tiny"))


@pytest.fixture(scope="module")
def tiny_k2(tiny) -> GLM5ForCausalLM:
    """tiny's weights with index_topk=2, so 16 * index_topk = 32 keys is a short context."""
    return build(tiny.config.replace(index_topk=2), like=tiny)


@pytest.fixture(scope="module")
def dense(tiny) -> GLM5ForCausalLM:
    """tiny's weights (indexer included) with DSA off."""
    return build(tiny.config.replace(use_dsa=False), like=tiny)


@pytest.fixture(scope="module")
def mixed() -> GLM5ForCausalLM:
    return build(mixed_cfg())


def rand_ids(seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def full(model, ids_BN: torch.Tensor) -> torch.Tensor:
    """The reference: logits [B, N, V] of an uncached forward over the whole sequence."""
    return model(ids_BN, attn_impl="naive").logits


def decode(model, ids_BN, chunks, *, impl="auto", capacity=None, cache=None):
    """Feed ids_BN through a cache in chunks of the given sizes; (logits [B, N, V], cache)."""
    B, N = ids_BN.shape
    assert sum(chunks) == N
    cache = KVCache.for_model(model, B, capacity or N) if cache is None else cache
    start, pos, out = int(cache.lengths[0]), 0, []
    for T in chunks:
        out.append(model(ids_BN[:, pos:pos + T], cache=cache, attn_impl=impl).logits)
        pos += T
        assert cache.lengths.tolist() == [start + pos] * B
    return torch.cat(out, dim=1), cache


# ---------------------------------------------------------------- 1. cached == full recompute

SCHEDULES = {  # tiny: index_topk = 8, DECODE_MAX_TOKENS = 16
    "prefill12-then-steps": [12, 1, 1, 1, 1],
    "prefill7(topk-1)-then-steps": [7, 1, 1, 1, 1],
    "prefill8(topk)-then-steps": [8, 1, 1, 1],
    "prefill9(topk+1)-then-steps": [9, 1, 1, 1],
    "T1-from-the-start": [1] * 10,
    "3-token-chunks-after-prefill": [6, 3, 3, 1],
    "18-token-chunk-after-prefill": [4, 18, 1],
}


@pytest.mark.parametrize("chunks", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_cached_decode_equals_full_recompute(tiny, impl, chunks):
    ids = rand_ids(1, 2, sum(chunks))
    got, _ = decode(tiny, ids, chunks, impl=impl)
    assert_close(got, full(tiny, ids))


LONG_SCHEDULES = {  # tiny_k2: index_topk = 2, gathered above 16 * 2 = 32 keys
    "prefill40-steps-chunk20": [40, 1, 1, 3, 20],
    "prefill20(masked)-then-chunk17": [20, 1, 17],
}


@pytest.mark.parametrize("chunks", LONG_SCHEDULES.values(), ids=LONG_SCHEDULES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_long_context_sparse_cached_equals_full_recompute(tiny_k2, impl, chunks, monkeypatch):
    ids = rand_ids(2, 2, sum(chunks))
    calls = []
    gathered = mla_module.attention_latent_gathered
    monkeypatch.setattr(mla_module, "attention_latent_gathered", lambda *a, **k: calls.append(1) or gathered(*a, **k))
    got, _ = decode(tiny_k2, ids, chunks, impl=impl)
    monkeypatch.undo()
    assert_close(got, full(tiny_k2, ids))
    if impl == "naive":
        assert not calls
    elif impl == "auto" and chunks[0] > 32:  # 4 layers x every forward: the 40-token prefill gathers too
        assert len(calls) >= 4 * len(chunks)


def test_logits_to_keep_and_hidden_states(tiny):
    ids = rand_ids(3, 2, 11)
    ref = tiny(ids, attn_impl="naive")
    cache = KVCache.for_model(tiny, 2, 11)
    out = tiny(ids[:, :9], cache=cache, logits_to_keep=1)
    assert out.logits.shape == (2, 1, V)
    assert_close(out.logits, ref.logits[:, 8:9])
    assert_close(out.hidden_states, ref.hidden_states[:, :9])
    out = tiny(ids[:, 9:], cache=cache, logits_to_keep=2)
    assert_close(out.logits, ref.logits[:, 9:])


def test_input_rows_must_match_cache_batch(tiny):
    cache = KVCache.for_model(tiny, 2, 8)
    for rows in (1, 3):
        with pytest.raises(ValueError, match="rows"):
            tiny(rand_ids(4, rows, 2), cache=cache)
    assert cache.lengths.tolist() == [0, 0]


# ---------------------------------------------------------------- 2. rollback

@pytest.mark.parametrize("impl", IMPLS)
def test_rollback_then_different_tokens(tiny, impl):
    ids = rand_ids(5, 2, 14)
    cache = KVCache.for_model(tiny, 2, 16)
    tiny(ids[:, :10], cache=cache, attn_impl=impl)
    tiny(ids[:, 10:14], cache=cache, attn_impl=impl)
    cache.truncate(11)  # reject the last 3 of the 4-token step
    assert cache.lengths.tolist() == [11, 11]
    new = (ids[:, 11:14] + 1 + rand_ids(6, 2, 3) % (V - 1)) % V  # differs from the rejected tokens everywhere
    assert bool((new != ids[:, 11:14]).all())
    got, _ = decode(tiny, new, [2, 1], impl=impl, cache=cache)
    assert_close(got, full(tiny, torch.cat([ids[:, :11], new], dim=1))[:, 11:])


@pytest.mark.parametrize("impl", IMPLS)
def test_rollback_per_row_masks_stale_slots(tiny, impl):
    """Row 0 rolls back 3 tokens, row 1 none: row 0's rejected slots stay inside the extent that
    the next step reads (row 1 is longer) and must be ignored."""
    ids = rand_ids(7, 2, 14)
    cache = KVCache.for_model(tiny, 2, 16)
    tiny(ids[:, :10], cache=cache, attn_impl=impl)
    tiny(ids[:, 10:14], cache=cache, attn_impl=impl)
    cache.truncate(torch.tensor([11, 14]))
    new = rand_ids(8, 2, 2)
    got = tiny(new, cache=cache, attn_impl=impl).logits
    assert cache.lengths.tolist() == [13, 16]
    assert_close(got[:1], full(tiny, torch.cat([ids[:1, :11], new[:1]], dim=1))[:, 11:])
    assert_close(got[1:], full(tiny, torch.cat([ids[1:], new[1:]], dim=1))[:, 14:])


# ---------------------------------------------------------------- 3. rows of different lengths

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["tiny", "dense", "mixed"])
def test_rows_of_different_lengths(kind, impl, request):
    """Right-padded prompts of 5 and 11 tokens (row 0 crosses index_topk while decoding), cut to
    their own lengths, then steps of 1, 1 and 2 tokens: each row == that row alone, uncached.
    (With DSA on, the top-k selection alone hides other rows' slots; the dense and GQA layers
    rely on the per-row causal mask.)"""
    model = request.getfixturevalue(kind)
    lens, extra = [5, 11], 4
    seqs = [rand_ids(10 + b, 1, n + extra) for b, n in enumerate(lens)]
    prompt = rand_ids(12, 2, max(lens))  # padding: arbitrary tokens, not a pad id
    for b, n in enumerate(lens):
        prompt[b, :n] = seqs[b][0, :n]
    cache = KVCache.for_model(model, 2, 16)
    prefill = model(prompt, cache=cache, attn_impl=impl).logits
    cache.truncate(torch.tensor(lens))
    steps, done = [], 0
    for T in (1, 1, 2):
        step = torch.cat([seqs[b][:, lens[b] + done:lens[b] + done + T] for b in range(2)])
        steps.append(model(step, cache=cache, attn_impl=impl).logits)
        done += T
    assert cache.lengths.tolist() == [n + extra for n in lens]
    decoded = torch.cat(steps, dim=1)
    for b, n in enumerate(lens):
        ref = full(model, seqs[b])
        assert_close(prefill[b:b + 1, :n], ref[:, :n])
        assert_close(decoded[b:b + 1], ref[:, n:])


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_random_schedules_of_steps_and_rollbacks(tiny, data):
    """Any interleaving of chunks (same T for both rows) and per-row rollbacks: each row's logits
    == the uncached forward over what that row holds."""
    cache = KVCache.for_model(tiny, 2, 24)
    rows = [torch.empty(1, 0, dtype=torch.long) for _ in range(2)]
    seed = 100
    for _ in range(data.draw(st.integers(2, 5), label="ops")):
        room = 24 - max(r.shape[1] for r in rows)
        if room and data.draw(st.booleans(), label="feed"):
            T = data.draw(st.integers(1, min(room, 6)), label="T")
            new = rand_ids(seed, 2, T)
            seed += 1
            impl = data.draw(st.sampled_from(IMPLS), label="impl")
            got = tiny(new, cache=cache, attn_impl=impl).logits
            rows = [torch.cat([rows[b], new[b:b + 1]], dim=1) for b in range(2)]
            for b in range(2):
                assert_close(got[b:b + 1], full(tiny, rows[b])[:, -T:])
        else:
            keep = [data.draw(st.integers(0, r.shape[1]), label="keep") for r in rows]
            cache.truncate(torch.tensor(keep))
            rows = [r[:, :k] for r, k in zip(rows, keep)]
        assert cache.lengths.tolist() == [r.shape[1] for r in rows]


# ---------------------------------------------------------------- 4. DSA engages in the cache

def test_dsa_topk_engages_in_cached_decode(tiny, dense):
    """The same weights dense vs sparse: identical while every query has <= index_topk keys, then
    far apart (so a cache path that ignored DSA would fail the recompute tests above)."""
    K = tiny.config.index_topk
    ids = rand_ids(20, 2, 16)
    chunks = [4] + [1] * 12
    sparse, sparse_cache = decode(tiny, ids, chunks)
    dense_logits, dense_cache = decode(dense, ids, chunks)
    assert "index_keys" in sparse_cache.states[0].buffers and "index_keys" not in dense_cache.states[0].buffers
    assert_close(sparse[:, :K], dense_logits[:, :K])
    diff_per_position = (sparse[:, K:] - dense_logits[:, K:]).abs().amax(dim=(0, 2))
    assert bool((diff_per_position > 100 * ATOL).all()), diff_per_position
    assert_close(sparse, full(tiny, ids))


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_model_cached_equals_full_recompute(dense, impl):
    """Chunks past DECODE_MAX_TOKENS take, under auto, the latent route up to latent_max_queries (25 at tiny's
    widths: 18 and 25 here), the expanded one past it (26)."""
    assert dense.model.layers[0].self_attn.latent_max_T == 25
    ids = rand_ids(21, 2, 72)
    got, _ = decode(dense, ids, [18, 1, 25, 26, 2], impl=impl)
    assert_close(got, full(dense, ids))


# ---------------------------------------------------------------- 5. GQA

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("make_cfg", [gqa_cfg, mixed_cfg], ids=["gqa", "mla-gqa-mixed"])
def test_gqa_cached_equals_full_recompute(make_cfg, impl):
    model = build(make_cfg())
    ids = rand_ids(30, 2, 31)
    got, _ = decode(model, ids, [9, 1, 3, 1, 17], impl=impl)
    assert_close(got, full(model, ids))


# ---------------------------------------------------------------- 6. bytes and buffer shapes

def meta_model(cfg: ModelConfig) -> GLM5ForCausalLM:
    with torch.device("meta"):
        return GLM5ForCausalLM(cfg)


@pytest.mark.parametrize("make_cfg", [lambda: ModelConfig.from_preset("tiny"), lambda: ModelConfig.from_preset("small"),
                                      gqa_cfg, mixed_cfg], ids=["tiny", "small", "gqa", "mla-gqa-mixed"])
@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("index", [None, "fp8"], ids=["index-keys-as-cache", "fp8-index-keys"])
def test_bytes_per_token_equals_ledger(make_cfg, dtype, name, index):
    """fp8 index keys (`index_cache_dtype="fp8"`): 1 byte per value + a 4-byte fp32 scale per token per layer."""
    cfg = make_cfg()
    model, ledger = meta_model(cfg), state(cfg, dtype=name, index_dtype=index)
    main = KVCache.for_model(model, 3, 8, dtype=dtype, index_cache_dtype=index)
    mtp = KVCache.for_mtp(model, 3, 8, dtype=dtype, index_cache_dtype=index)
    assert main.bytes_per_token() == ledger["main"]["bytes_per_token"]
    assert mtp.bytes_per_token() == ledger["mtp"]["bytes_per_token"]
    assert main.nbytes() == 3 * 8 * ledger["main"]["bytes_per_token"]


def test_bytes_per_token_hand_count():
    """tiny fp32: 4 layers x (32 + 8) latent values + 2 full-indexer layers x 16 keys; MTP: 40 + 16.
    GQA (2 KV heads of 16+8 / 16): 4 x 2 x (24 + 16)."""
    model = meta_model(ModelConfig.from_preset("tiny"))
    assert KVCache.for_model(model, 1, 4).bytes_per_token() == (4 * 40 + 2 * 16) * 4
    assert KVCache.for_mtp(model, 1, 4).bytes_per_token() == (40 + 16) * 4
    assert KVCache.for_model(meta_model(gqa_cfg()), 1, 4).bytes_per_token() == 4 * 2 * (24 + 16) * 4


def test_buffer_shapes_hold_nothing_per_head(tiny):
    cache = KVCache.for_model(tiny, 2, 6)
    assert [set(s.buffers) for s in cache.states] == [{"latent", "index_keys"}, {"latent"}] * 2  # full/shared
    for layer in [s.buffers for s in cache.states]:
        assert layer["latent"].shape == (2, 6, 32 + 8) and layer["latent"].dtype == torch.float32
        if "index_keys" in layer:
            assert layer["index_keys"].shape == (2, 6, 16)
    assert cache.lengths.dtype == torch.int64 and cache.lengths.tolist() == [0, 0]
    mtp = KVCache.for_mtp(tiny, 2, 6)
    assert {k: tuple(v.shape) for k, v in mtp.states[0].buffers.items()} == {"latent": (2, 6, 40),
                                                                               "index_keys": (2, 6, 16)}
    gqa = KVCache.for_model(build(gqa_cfg()), 2, 6)
    assert all({k: tuple(v.shape) for k, v in layer.items()} == {"k": (2, 6, 2, 24), "v": (2, 6, 2, 16)}
               for layer in (s.buffers for s in gqa.states))
    assert [set(s.buffers) for s in KVCache.for_model(meta_model(mixed_cfg()), 1, 2).states] == \
        [{"latent", "index_keys"}, {"k", "v"}, {"latent"}, {"k", "v"}]


def test_glm5_cache_is_576_latent_plus_128_index_key_per_layer():
    cfg = ModelConfig.from_preset("glm5")
    model = meta_model(cfg)
    cache = KVCache.for_model(model, 1, 8, dtype=torch.bfloat16)
    assert len(cache.states) == 78
    for layer in [s.buffers for s in cache.states]:
        assert layer["latent"].shape == (1, 8, 576) and layer["latent"].dtype == torch.bfloat16
        assert layer["index_keys"].shape == (1, 8, 128)
    ledger = state(cfg, dtype="bf16")
    assert cache.bytes_per_token() == ledger["main"]["bytes_per_token"] == 78 * (576 + 128) * 2
    mtp = KVCache.for_mtp(model, 1, 8, dtype=torch.bfloat16)
    assert mtp.bytes_per_token() == ledger["mtp"]["bytes_per_token"] == (576 + 128) * 2
    fp8 = KVCache.for_model(model, 1, 8, dtype=torch.bfloat16, index_cache_dtype="fp8")
    assert fp8.bytes_per_token() == state(cfg, dtype="bf16", index_dtype="fp8")["main"]["bytes_per_token"] \
        == 78 * (576 * 2 + 128 + 4)


# ---------------------------------------------------------------- 7. overflow and bad arguments

def test_overflow_leaves_the_cache_unchanged(tiny):
    ids = rand_ids(40, 2, 11)
    cache = KVCache.for_model(tiny, 2, 10)
    tiny(ids[:, :8], cache=cache)
    before = [{k: v.clone() for k, v in layer.items()} for layer in [s.buffers for s in cache.states]]
    with pytest.raises(CacheOverflowError, match=r"\b10\b"):
        tiny(ids[:, 8:11], cache=cache)
    assert isinstance(CacheOverflowError("x"), ValueError)
    assert cache.lengths.tolist() == [8, 8]
    for layer, old in zip([s.buffers for s in cache.states], before):
        for k in layer:
            assert torch.equal(layer[k], old[k])
    got = tiny(ids[:, 8:10], cache=cache).logits  # exactly full: allowed
    assert_close(got, full(tiny, ids[:, :10])[:, 8:])
    with pytest.raises(CacheOverflowError):
        tiny(ids[:, 10:11], cache=cache)
    assert cache.lengths.tolist() == [10, 10]


def test_mtp_overflow(tiny):
    cache = KVCache.for_mtp(tiny, 1, 3)
    hidden = torch.zeros(1, 4, tiny.config.hidden_size)
    with pytest.raises(CacheOverflowError, match=r"\b3\b"):
        tiny.mtp_step(hidden, rand_ids(41, 1, 4), cache=cache)
    assert cache.lengths.tolist() == [0]


def test_bad_truncate_and_capacity(tiny):
    cache = KVCache.for_model(tiny, 2, 8)
    tiny(rand_ids(42, 2, 5), cache=cache)
    for bad in (6, -1, torch.tensor([5, 6]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError):
            cache.truncate(bad)
        assert cache.lengths.tolist() == [5, 5]
    cache.truncate(torch.tensor([5, 0]))
    assert cache.lengths.tolist() == [5, 0]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        KVCache.for_model(tiny, 1, tiny.config.max_position_embeddings + 1)
    for bad_capacity in (0, 2.0, True):
        with pytest.raises(ValueError):
            KVCache.for_model(tiny, 1, bad_capacity)
    with pytest.raises(ValueError):
        KVCache.for_model(tiny, 0, 4)
    with pytest.raises(ValueError, match="MTP"):
        KVCache.for_mtp(meta_model(ModelConfig.from_preset("tiny").replace(num_nextn_predict_layers=0)), 1, 4)


# ---------------------------------------------------------------- 8. MTP

@pytest.mark.parametrize("impl", IMPLS)
def test_mtp_step_cached_equals_uncached(tiny, impl):
    """12 pairs (h_t, x_{t+1}) > index_topk, so the MTP layer's own DSA selects keys."""
    ids = rand_ids(50, 2, 13)
    hidden = tiny(ids).hidden_states[:, :12]
    next_ids = ids[:, 1:]
    layer, cfg = tiny.model.mtp_layers[0], tiny.config
    h_ref, _ = layer(hidden, tiny.model.embed_tokens(next_ids), uncached_step(cfg, 12, reference=True).layer(0))
    cache = KVCache.for_mtp(tiny, 2, 12)
    hs, logits, pos = [], [], 0
    for T in (5, 1, 3, 1, 2):
        h, lg = tiny.mtp_step(hidden[:, pos:pos + T], next_ids[:, pos:pos + T], cache=cache, attn_impl=impl)
        hs.append(h)
        logits.append(lg)
        pos += T
    assert cache.lengths.tolist() == [12, 12]
    assert_close(torch.cat(hs, dim=1), h_ref)
    assert_close(torch.cat(logits, dim=1), tiny.lm_head(h_ref))


def test_mtp_step_on_gqa_layer(mixed):
    """The mixed config's MTP layer is GQA (it copies the last layer): its k/v cache works too."""
    model = mixed
    ids = rand_ids(51, 2, 11)
    hidden = model(ids).hidden_states[:, :10]
    layer, cfg = model.model.mtp_layers[0], model.config
    h_ref, _ = layer(hidden, model.model.embed_tokens(ids[:, 1:]), uncached_step(cfg, 10, reference=True).layer(0))
    cache = KVCache.for_mtp(model, 2, 10)
    assert set(cache.states[0].buffers) == {"k", "v"}
    h1, l1 = model.mtp_step(hidden[:, :7], ids[:, 1:8], cache=cache)
    h2, l2 = model.mtp_step(hidden[:, 7:], ids[:, 8:], cache=cache)
    assert_close(torch.cat([h1, h2], dim=1), h_ref)
    assert_close(torch.cat([l1, l2], dim=1), model.lm_head(h_ref))


# ---------------------------------------------------------------- 9. keep_rows

def test_keep_rows(tiny):
    """3 rows of lengths 10, 7, 9: a step, rolled back; then rows (2, 1) only (reordered) redo the
    same step (same logits) and go on (== each row uncached)."""
    prompt = rand_ids(60, 3, 10)
    lens = [10, 7, 9]
    cache = KVCache.for_model(tiny, 3, 16)
    tiny(prompt, cache=cache)
    cache.truncate(torch.tensor(lens))
    step = rand_ids(61, 3, 1)
    before = tiny(step, cache=cache).logits
    cache.truncate(cache.lengths - 1)
    rows = torch.tensor([2, 1])
    cache.keep_rows(rows)
    assert cache.batch == 2 and cache.lengths.tolist() == [9, 7]
    assert all(buf.shape[0] == 2 for layer in [s.buffers for s in cache.states] for buf in layer.values())
    assert_close(tiny(step[rows], cache=cache).logits, before[rows])
    more = rand_ids(62, 2, 2)
    got = tiny(more, cache=cache).logits
    assert cache.lengths.tolist() == [12, 10]
    for i, r in enumerate(rows.tolist()):
        seq = torch.cat([prompt[r:r + 1, :lens[r]], step[r:r + 1], more[i:i + 1]], dim=1)
        assert_close(got[i:i + 1], full(tiny, seq)[:, -2:])


def test_truncate_refuses_wrong_shapes_and_non_integers():
    m = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
    c = KVCache.for_model(m, 2, 8)
    for bad in (torch.tensor([1, 2, 3]), [[1, 1]], 3.7, True):
        with pytest.raises(ValueError, match="truncate needs an int or 2 integer lengths"):
            c.truncate(bad)
    assert c.lengths.tolist() == [0, 0]
