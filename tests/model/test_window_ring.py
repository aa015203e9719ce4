"""Sliding-window layers decode in constant memory: a ring of `window` tokens (issue 28).

Pinned here, against the uncached naive forward under the window mask (fp32 tolerance, conftest):
- the ring's invariant (slot j holds the largest position < length that is j mod R) and its mask;
- cached prefill + decode in chunks of 1, w-1, w, w+1 tokens (and longer than the ring) equals the
  full recompute, on the pure-SWA, the 1:1 interleaved and a searched pattern, MLA (+DSA) and GQA;
- rollback inside the last forward (speculative verification, right-padded prompts), per row;
  rolling back further is refused; keep_rows keeps each row's ring;
- the ring holds min(window, capacity) tokens: cache bytes == the ledger's, whatever the capacity;
- generate (plain, chunked prefill, speculative, sampled) equals the uncached recompute.
"""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, KVCache, ModelConfig, generate, ledger
from glm5lab.evals.search_swa import interleave_pattern
from glm5lab.infer import decode_step, prefill, verify
from glm5lab.model.visibility import visible
from glm5lab.model.window_ring import ring_key_positions, ring_mask, slot_positions
from tests.conftest import assert_close

W = 5
PATTERNS = {
    "swa": ["swa"] * 4,
    "1:1 interleave": interleave_pattern(4),
    "searched": ["attention", "swa", "swa", "attention"],
}
ATTENTION = {
    "mla+dsa": dict(indexer_types=["full"] * 4, index_topk=4),
    "gqa": dict(attention_types=["gqa"] * 4, index_n_heads=0, use_dsa=False, num_key_value_heads=2, q_lora_rank=0,
                kv_lora_rank=0),
}


def _model(pattern: str, attention: str = "mla+dsa", window: int = W) -> GLM5ForCausalLM:
    cfg = ModelConfig.from_preset("tiny").replace(mixer_types=PATTERNS[pattern], sliding_window=window,
                                                  **ATTENTION[attention])
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).eval()


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("R", [1, 3, 5])
def test_slots_hold_the_last_positions_of_each_row(R):
    lengths = torch.tensor([0, 1, 4, 5, 13])
    pos = slot_positions(lengths, R)
    for b, n in enumerate(lengths.tolist()):
        for j in range(R):
            want = max([p for p in range(n) if p % R == j], default=None)
            assert int(pos[b, j]) == want if want is not None else int(pos[b, j]) < 0


@pytest.mark.parametrize("T", [1, 2, 4, 7])
def test_ring_mask_is_the_window_mask_over_the_ring_keys(T):
    """Over the keys a forward reads, the ring mask is `visible` with the window at the keys' positions."""
    R = window = 4
    lengths = torch.tensor([0, 3, 4, 9])
    keys = ring_key_positions(lengths, T, R)
    mask = ring_mask(lengths, T, R, window)
    for b in range(4):
        full = visible(lengths[b:b + 1], T, int(lengths[b]) + T, window=window)[0]  # [T, positions]
        for s, p in enumerate(keys[b].tolist()):
            assert mask[b, :, s].tolist() == (full[:, p].tolist() if p >= 0 else [False] * T)
        seen = {p for s, p in enumerate(keys[b].tolist()) if mask[b, :, s].any()}
        assert seen == set(full.any(0).nonzero()[:, 0].tolist())  # every visible key is read exactly once


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("pattern", list(PATTERNS))
@torch.no_grad()
def test_cached_chunks_equal_the_uncached_window_forward(pattern, attention):
    m = _model(pattern, attention)
    ids = _ids(2, 34)
    ref = m(ids, attn_impl="naive").logits
    for impl in ("auto", "naive"):
        cache = KVCache.for_model(m, 2, 34)
        got, t = [], 0
        for n in (1, W - 1, W, W + 1, 1, 2 * W + 3, 1, 3):  # 2W+3: a chunk longer than the ring
            got.append(m(ids[:, t:t + n], cache=cache, attn_impl=impl).logits)
            t += n
        assert t == 34
        assert_close(torch.cat(got, dim=1), ref)


@pytest.mark.parametrize("pattern", ["swa", "1:1 interleave"])
@torch.no_grad()
def test_rollback_inside_the_last_forward_per_row(pattern):
    """A verification of 4 tokens, then each row keeps 0..4 of them (a row past the window and a
    row inside it), then more tokens: equal to the uncached forward of each row's kept sequence.
    The same after a forward longer than the ring (right-padded prompts forget their pads)."""
    m = _model(pattern)
    ids = _ids(3, 40, seed=2)
    for first, T in ((12, 4), (3, 4), (9, 2 * W + 4)):
        for keep in ((0, 2, 4), (4, 1, 3), (3, 0, 0)):
            cache = KVCache.for_model(m, 3, 40)
            m(ids[:, :first], cache=cache)
            m(ids[:, first:first + T], cache=cache)
            cache.truncate(torch.tensor([first + min(k, T) for k in keep]))
            after = m(ids[:, 30:33], cache=cache).logits
            for b, k in enumerate(keep):
                seq = torch.cat([ids[b, :first + min(k, T)], ids[b, 30:33]])[None]
                assert_close(after[b], m(seq, attn_impl="naive").logits[0, -3:])


@torch.no_grad()
def test_rolling_back_past_the_last_forward_is_refused():
    m = _model("swa")
    cache = KVCache.for_model(m, 1, 20)
    m(_ids(1, 8), cache=cache)
    m(_ids(1, 2), cache=cache)
    with pytest.raises(ValueError, match=r"sliding-window \(ring buffer\) layers, whose state rolls back only "
                                         r"within the last forward \(to lengths >= \[8\]\)"):
        cache.truncate(7)
    assert cache.lengths.tolist() == [10]
    cache.truncate(8)  # the last forward's start is allowed
    assert cache.lengths.tolist() == [8]


@torch.no_grad()
def test_keep_rows_keeps_each_rows_ring():
    m = _model("1:1 interleave")
    ids = _ids(3, 15)
    cache = KVCache.for_model(m, 3, 16)
    m(ids[:, :10], cache=cache)
    m(ids[:, 10:14], cache=cache)
    cache.keep_rows(torch.tensor([2, 0]))
    cache.truncate(torch.tensor([12, 11]))  # the recorded forward follows the rows
    got = m(ids[[2, 0], 14:15], cache=cache).logits
    for i, (b, n) in enumerate(((2, 12), (0, 11))):
        seq = torch.cat([ids[b, :n], ids[b, 14:15]])[None]
        assert_close(got[i], m(seq, attn_impl="naive").logits[0, -1:])


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_ring_bytes_are_the_window_whatever_the_capacity(pattern, attention):
    m = _model(pattern, attention)
    cfg, swa = m.config, sum(s.mixer == "swa" for s in m.config.layers)
    width = cfg.mla_cache_width if attention == "mla+dsa" else cfg.gqa_cache_width
    for capacity in (3, W, 64, 512):
        cache = KVCache.for_model(m, 2, capacity)
        state = ledger.state(cfg, dtype="fp32", context=capacity)["main"]
        assert cache.state_bytes_per_row() == state["fixed_bytes"] == swa * min(W, capacity) * width * 4
        assert cache.bytes_per_token() == state["bytes_per_token"]
        assert cache.nbytes() == 2 * state["bytes_for_context"]
        for ring in (r for r in cache.rings if r is not None):
            assert all(buf.shape[1] == min(W, capacity) for buf in ring.buffers.values())


def test_swa_state_at_64k_is_window_over_64k_of_full_attention():
    """The issue's goal, by the ledger: all-SWA state at 64K = window / 64K of full attention's."""
    base = ModelConfig.from_preset("bench").replace(max_position_embeddings=65536, indexer_types=["full", "full"])
    full = ledger.state(base.replace(use_dsa=False), dtype="fp32", context=65536)["main"]["bytes_for_context"]
    swa = ledger.state(base.replace(mixer_types=["swa", "swa"], sliding_window=2048), dtype="fp32",
                       context=65536)["main"]["bytes_for_context"]
    assert swa * 65536 == full * 2048


@pytest.mark.parametrize("pattern", ["swa", "searched"])
@torch.no_grad()
def test_generate_equals_the_uncached_recompute(pattern):
    m = _model(pattern)
    prompts = [_ids(1, n, seed=n)[0].tolist() for n in (3, 11, 17)]  # rows end their prompt in different chunks
    plain = generate(m, prompts, 6, prefill_chunk=4)
    for row, p in zip(plain.tokens, prompts):
        seq = list(p)
        for _ in range(6):
            seq.append(int(m(torch.tensor([seq]), attn_impl="naive").logits[0, -1].argmax()))
        assert row == seq[len(p):]
    spec = generate(m, prompts, 6, prefill_chunk=4, speculative="mtp", draft_steps=3)
    assert spec.tokens == plain.tokens


@torch.no_grad()
def test_steps_over_a_ring_equal_the_uncached_forward():
    m = _model("1:1 interleave")
    ids = _ids(2, 20)
    ids[1, 13:] = 0
    cache = KVCache.for_model(m, 2, 24)
    lens = torch.tensor([20, 13])
    pre = prefill(m, ids, cache, chunk=6, lengths=lens)
    nxt = torch.tensor([5, 7])
    step = decode_step(m, nxt, cache)
    ver, _ = verify(m, torch.tensor([[9, 2, 3], [4, 4, 1]]), cache)
    for b, n in enumerate(lens.tolist()):
        seq = torch.cat([ids[b, :n], nxt[b:b + 1], torch.tensor([[9, 2, 3], [4, 4, 1]][b])])[None]
        full = m(seq, attn_impl="naive").logits[0]
        assert_close(pre.logits_BV[b], full[n - 1])
        assert_close(step[b], full[n])
        assert_close(ver[b], full[n + 1:n + 4])


@pytest.mark.slow
@pytest.mark.parametrize("attention", list(ATTENTION))
@torch.no_grad()
def test_compiled_generation_over_rings_equals_eager(attention):
    """The compiled steps (static shapes) write and roll back the rings as the eager ones do."""
    m = _model("1:1 interleave", attention)
    prompts = [_ids(1, n, seed=n)[0].tolist() for n in (3, 11, 17)]
    eager = generate(m, prompts, 8, prefill_chunk=4, speculative="mtp", draft_steps=3)
    assert generate(m, prompts, 8, prefill_chunk=4, speculative="mtp", draft_steps=3, compile=True).tokens == eager.tokens
    assert generate(m, prompts, 8, prefill_chunk=4, compile=True).tokens == eager.tokens
