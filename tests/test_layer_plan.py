"""One per-layer plan (`ModelConfig.layers`, `LayerSpec`) read by every consumer: for mixed
models (SWA layers whose `indexer_types` entry is "full", shared layers after them, GQA, Gated
DeltaNet, SimpleGDN), the cache's buffers, the ledger's state and FLOPs and the indexers the
forward actually runs all agree with the plan, and with each other."""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, KVCache, ModelConfig, ledger
from glm5lab.model.dsa import LightningIndexer

MIXES = {
    # layer 1: SWA with indexer weights ("full"); layer 3 "shared" reuses layer 0's top-k, not layer 1's
    "swa-full-then-shared": dict(mixer_types=["attention", "swa", "attention", "attention"],
                                 indexer_types=["full", "full", "full", "shared"], sliding_window=3),
    "gdn-and-gqa": dict(attention_types=["mla", "mla", "gqa", "gqa"], mixer_types=["attention", "gdn", "attention",
                                                                                     "simple_gdn"],
                        indexer_types=["full", "full", "shared", "full"], num_key_value_heads=2),
    "swa-first": dict(mixer_types=["swa", "attention", "swa", "attention"], indexer_types=["full", "full", "shared",
                                                                                          "shared"], sliding_window=2),
}


def _cfg(name: str) -> ModelConfig:
    return ModelConfig.from_preset("tiny").replace(**MIXES[name])


def test_plan_of_the_swa_mix_is_what_the_docs_say():
    specs = _cfg("swa-full-then-shared").layers
    assert [s.indexer for s in specs] == ["own", "none", "own", "shared"]
    assert [s.has_indexer_weights for s in specs] == [True, True, True, False]
    assert [s.index_cache for s in specs] == [True, False, True, False]
    assert [s.window for s in specs] == [None, 3, None, None]
    assert specs[3].reuses_from == 2
    mtp = _cfg("swa-full-then-shared").mtp_layer
    assert (mtp.index, mtp.indexer, mtp.index_cache, mtp.mlp) == (4, "own", True, "sparse")


@pytest.mark.parametrize("name", list(MIXES))
@pytest.mark.parametrize("use_dsa", [True, False])
def test_cache_bytes_equal_ledger_state_and_the_indexers_the_forward_runs(name, use_dsa):
    cfg = _cfg(name).replace(use_dsa=use_dsa)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).eval()
    cache = KVCache.for_model(model, 1, 32)
    state = ledger.state(cfg, dtype="fp32", context=32)
    assert cache.bytes_per_token() == state["main"]["bytes_per_token"]
    assert KVCache.for_mtp(model, 1, 32).bytes_per_token() == state["mtp"]["bytes_per_token"]
    with_keys = {i for i, layer in enumerate(cache.states) if "index_keys" in layer.buffers}
    assert with_keys == {s.index for s in cfg.layers if s.index_cache}

    owner = {layer.self_attn.indexer: i for i, layer in enumerate(model.model.layers)
             if getattr(layer.self_attn, "indexer", None) is not None}

    def runs(fn) -> set[int]:
        called: set[int] = set()
        originals = {}
        for ix, i in owner.items():
            originals[ix] = ix.queries
            ix.queries = (lambda f, i: lambda *a, **k: (called.add(i), f(*a, **k))[1])(ix.queries, i)
        try:
            with torch.no_grad():
                fn()
        finally:
            for ix in owner:
                del ix.queries
        return called

    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    uncached = runs(lambda: model(ids))
    cached = runs(lambda: model(ids, cache=cache))
    flops = {s.index for s in cfg.layers if ledger.block_flops(cfg, s, 20, prefill=True)["indexer_scoring"] > 0}
    assert uncached == cached == flops == ({s.index for s in cfg.layers if s.indexer == "own"} if use_dsa else set())
    assert with_keys == (flops if use_dsa else set())
    weights = {i for i, layer in enumerate(model.model.layers) if isinstance(getattr(layer.self_attn, "indexer", None),
                                                                            LightningIndexer)}
    assert weights == {s.index for s in cfg.layers if s.has_indexer_weights}
    main = ledger.main_params(cfg)
    assert main["indexer"] == len(weights) * ledger.indexer_params(cfg)
