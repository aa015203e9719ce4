"""Cached decoding of Gated DeltaNet ("gdn") and SimpleGDN ("simple_gdn") layers: their
`RecurrentState` in the KVCache. Cached prefill + steps equal the full forward (fp32 tolerance,
conftest); rollback (`truncate`) inside the last forward equals never having seen the dropped
tokens, per row; rolling back further is refused by name; generation (plain, chunked prefill,
prompts of different lengths, MTP speculative) equals the full-recompute greedy loop token for
token. The mixed model has an MLA layer with DSA (top-8; prompts longer than 8), a GQA layer, a
"gdn" layer and a "simple_gdn" layer."""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, KVCache, ModelConfig, generate, ledger
from tests.conftest import assert_close, random_prompts, recompute_greedy

MIXED = dict(attention_types=["mla", "mla", "gqa", "gqa"], mixer_types=["full", "gdn", "full", "simple_gdn"],
             num_key_value_heads=2)


def _model(seed=0, **overrides) -> GLM5ForCausalLM:
    torch.manual_seed(seed)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(**{**MIXED, **overrides})).eval()


@pytest.fixture(scope="module")
def mixed():
    return _model()


def _ids(B, T, seed=1, vocab=512):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [1, 3, 7, 8, 9, 20])
@torch.no_grad()
def test_cached_chunks_equal_the_full_forward(mixed, chunk):
    ids = _ids(2, 20)
    full = mixed(ids).logits
    cache = KVCache.for_model(mixed, 2, 20)
    got = torch.cat([mixed(ids[:, i:i + chunk], cache=cache).logits for i in range(0, 20, chunk)], dim=1)
    assert_close(got, full)
    assert cache.lengths.tolist() == [20, 20]


@torch.no_grad()
def test_rollback_inside_the_last_forward_forgets_the_dropped_tokens_per_row(mixed):
    ids = _ids(2, 16)
    cache = KVCache.for_model(mixed, 2, 24)
    mixed(ids[:, :10], cache=cache)
    mixed(ids[:, 10:15], cache=cache)           # the last forward: tokens 10..14
    cache.truncate(torch.tensor([12, 10]))       # row 0 keeps 2 of them, row 1 none
    tail = torch.tensor([[7, 8, 9], [4, 5, 6]])
    got = mixed(tail, cache=cache).logits
    for b, keep in enumerate((12, 10)):
        ref = mixed(torch.cat([ids[b:b + 1, :keep], tail[b:b + 1]], dim=1)).logits[:, -3:]
        assert_close(got[b:b + 1], ref)


@torch.no_grad()
def test_long_rollback_uses_the_chunked_replay(mixed):
    ids = _ids(1, 40)
    cache = KVCache.for_model(mixed, 1, 41)
    mixed(ids, cache=cache)                      # one 40-token forward: replay of 33 > 16 tokens is chunked
    cache.truncate(33)
    got = mixed(ids[:, 33:34], cache=cache).logits
    assert_close(got, mixed(ids[:, :34]).logits[:, -1:])


@torch.no_grad()
def test_rolling_back_past_the_last_forward_is_refused_by_name(mixed):
    cache = KVCache.for_model(mixed, 1, 16)
    mixed(_ids(1, 6), cache=cache)
    mixed(_ids(1, 3, seed=2), cache=cache)
    cache.truncate(9)                             # no change: allowed
    with pytest.raises(ValueError, match=r"Gated DeltaNet layers.*within the last forward.*\[6\]"):
        cache.truncate(5)
    assert cache.lengths.tolist() == [9]


@torch.no_grad()
def test_keep_rows_keeps_each_rows_state(mixed):
    ids = _ids(3, 9)
    cache = KVCache.for_model(mixed, 3, 12)
    mixed(ids[:, :8], cache=cache)
    cache.keep_rows(torch.tensor([2, 0]))
    got = mixed(ids[[2, 0], 8:9], cache=cache).logits
    assert_close(got, mixed(ids[[2, 0]]).logits[:, -1:])


def test_state_bytes_are_fixed_per_row_and_per_token_bytes_match_the_ledger(mixed):
    cache = KVCache.for_model(mixed, 2, 10)
    cfg = mixed.config
    assert cache.bytes_per_token() == ledger.state(cfg, dtype="fp32")["main"]["bytes_per_token"]
    hv, _, k, v = cfg.gdn_dims
    conv = (2 * cfg.gdn_dims[1] * k + hv * v) * (cfg.linear_conv_kernel_dim - 1)
    simple = cfg.num_attention_heads * cfg.qk_head_dim * cfg.v_head_dim
    assert cache.state_bytes_per_row() == 4 * (hv * k * v + conv + simple)
    assert cache.state_bytes_per_row() == ledger.state(cfg, dtype="fp32", context=10)["main"]["recurrent_bytes"]
    assert cache.nbytes() == 2 * (10 * cache.bytes_per_token() + cache.state_bytes_per_row())


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_generate_with_recurrent_layers_matches_full_recompute(mixed, prefill_chunk):
    prompts = random_prompts(512, (3, 11, 17), seed=3)  # rows end their prompt in different chunks
    out = generate(mixed, prompts, 5, prefill_chunk=prefill_chunk)
    assert out.tokens == [recompute_greedy(mixed, p, 5) for p in prompts]


@pytest.mark.parametrize("draft_steps", [1, 3])
def test_speculative_greedy_with_recurrent_layers_equals_plain_greedy(draft_steps):
    model = _model(seed=1, vocab_size=4)  # vocab 4: drafts are often accepted, so rollback runs both ways
    prompts = random_prompts(4, (11, 16, 1), seed=1)
    plain = generate(model, prompts, 10)
    spec = generate(model, prompts, 10, speculative="mtp", draft_steps=draft_steps, prefill_chunk=5)
    assert spec.tokens == plain.tokens == [recompute_greedy(model, p, 10) for p in prompts]
    assert spec.stats.acceptance_length > 1.0  # some drafts accepted: partial rollbacks happened
