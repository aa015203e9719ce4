"""`prefill`'s default chunk ("auto": `prefill_chunk_for`) and the key-blocked route it drives: a model whose
every layer is dense MLA full attention prefills in `DENSE_PREFILL_CHUNK` pieces, the others in 256; chunks past
`latent_max_queries` over a cache take "expanded_blocked"; the logits equal the uncached forward's (fp32 tolerance
of `tests.conftest.TOL`) and greedy `generate` gives the same tokens whatever the chunk."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from glm5lab import KVCache, generate
from glm5lab.infer import DEFAULT_PREFILL_CHUNK, DENSE_PREFILL_CHUNK, prefill, prefill_chunk_for
from glm5lab.model import mla
from tests.conftest import assert_close
from tests.infer.conftest import MIXED, seeded_model


@pytest.mark.parametrize("overrides, chunk", [
    ({}, DEFAULT_PREFILL_CHUNK),  # tiny: DSA on
    (dict(use_dsa=False), DENSE_PREFILL_CHUNK),
    (dict(index_n_heads=0, use_dsa=False), DENSE_PREFILL_CHUNK),
    (MIXED | dict(use_dsa=False), DEFAULT_PREFILL_CHUNK),  # GQA and SWA layers
    (dict(use_dsa=False, mixer_types=["attention", "gdn", "attention", "attention"]), DEFAULT_PREFILL_CHUNK),
])
def test_the_default_chunk_is_dense_only_for_all_dense_mla(overrides, chunk):
    assert DEFAULT_PREFILL_CHUNK == 256 and DENSE_PREFILL_CHUNK == 4096
    assert prefill_chunk_for(seeded_model(**overrides)) == chunk


def _routes(model, fn):
    """fn()'s result and the `attention_route` of every MLA call it made."""
    natural, seen = mla.attention_route, []

    def spy(**kw):
        seen.append(natural(**kw))
        return seen[-1]

    with mock.patch.object(mla, "attention_route", spy):
        return fn(), seen


@pytest.mark.parametrize("chunk", ["auto", None, 31, 40])
def test_dense_prefill_equals_the_uncached_forward(chunk):
    """tiny without DSA (latent_max_queries 25): a 101-token prompt in chunks of 31 (31, 31, 31, 8: the last
    latent) or 40 (40, 40, 21: the last latent), with 7-key blocks, or whole; the first chunk has no cached keys."""
    model = seeded_model(use_dsa=False)
    assert model.model.layers[0].self_attn.latent_max_T == 25
    ids = torch.randint(0, model.config.vocab_size, (2, 101), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), mock.patch.object(mla, "KEY_BLOCK", 7):
        want = model(ids).logits[:, -1]
        cache = KVCache.for_model(model, 2, 128)
        got, routes = _routes(model, lambda: prefill(model, ids, cache, chunk=chunk).logits_BV)
    assert_close(got, want)
    layers = model.config.num_hidden_layers
    blocked, latent = "expanded_blocked", "latent_masked"
    expect = {31: [blocked] * 3 + [latent], 40: [blocked] * 2 + [latent]}.get(chunk, [blocked])
    assert routes == [r for r in expect for _ in range(layers)]


def test_greedy_tokens_do_not_depend_on_the_chunk():
    model = seeded_model(use_dsa=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (90, 57)]
    want = generate(model, prompts, 8, prefill_chunk=None).tokens
    for chunk in ("auto", 30, 26, 7):
        with mock.patch.object(mla, "KEY_BLOCK", 5):
            assert generate(model, prompts, 8, prefill_chunk=chunk).tokens == want, chunk


@pytest.mark.parametrize("bad", ["whole", 0, 2.5, True])
def test_a_bad_chunk_is_refused_by_name(bad):
    model = seeded_model(use_dsa=False)
    with pytest.raises(ValueError, match="prefill_chunk = .* is not allowed"):
        generate(model, [1, 2, 3], 2, prefill_chunk=bad)
    with pytest.raises(ValueError, match="chunk = .* is not allowed"):
        prefill(model, torch.tensor([[1, 2, 3]]), KVCache.for_model(model, 1, 8), chunk=bad)
