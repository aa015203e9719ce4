"""Sliding-window attention ("swa" mixer): each query sees exactly min(position + 1, window)
keys, in the full forward and in cached decoding, on MLA and GQA layers; every impl equals the
naive reference (fp32 tolerance, conftest)."""

import pytest
import torch

from glm5lab import ConfigError, GLM5ForCausalLM, KVCache, ModelConfig
from glm5lab.model.visibility import visible, visible_count
from tests.conftest import assert_close

W = 4


def _model(**overrides) -> GLM5ForCausalLM:
    cfg = ModelConfig.from_preset("tiny").replace(**overrides)
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).eval()


@pytest.mark.parametrize("offset", [0, 3, 9])
def test_window_mask_sees_exactly_min_pos_plus_one_and_window_keys(offset):
    T, S = 6, offset + 6
    mask = visible(offset, T, S, window=W)[0]
    pos = torch.arange(T) + offset
    assert mask.sum(-1).tolist() == torch.clamp(pos + 1, max=W).tolist()
    for t in range(T):
        assert mask[t].nonzero()[:, 0].tolist() == list(range(max(0, int(pos[t]) - W + 1), int(pos[t]) + 1))
    rows = visible(torch.tensor([offset, offset]), T, S, window=W)
    assert torch.equal(rows, mask.expand(2, T, S))
    for window in (None, W):  # the count is the mask's, per row, also past the keys (S < position + 1)
        for offsets in (offset, torch.tensor([offset, max(0, offset - 2)])):
            for keys in (S, S - 2):
                assert torch.equal(visible_count(offsets, T, keys, window=window),
                                   visible(offsets, T, keys, window=window).sum(-1))


def test_one_swa_layer_reads_only_its_window():
    """In a 1-layer model the logits at position p depend on tokens p-W+1..p only."""
    m = _model(num_hidden_layers=1, mixer_types=["swa"], indexer_types=["full"], mlp_layer_types=["dense"],
               sliding_window=W, num_nextn_predict_layers=0)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    p = 9
    with torch.no_grad():
        base = m(ids).logits[0, p]
        outside, inside = ids.clone(), ids.clone()
        outside[0, p - W] = (ids[0, p - W] + 1) % 512
        inside[0, p - W + 1] = (ids[0, p - W + 1] + 1) % 512
        assert torch.equal(m(outside).logits[0, p], base)
        assert (m(inside).logits[0, p] - base).abs().max() > 1e-3


CONFIGS = {
    "mla+dsa": dict(mixer_types=["full", "full", "swa", "swa"], sliding_window=W),
    "gqa": dict(attention_types=["gqa"] * 4, mixer_types=["swa", "full", "swa", "full"], sliding_window=W,
                index_n_heads=0, use_dsa=False, num_key_value_heads=2, q_lora_rank=0, kv_lora_rank=0),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_swa_impls_and_cached_decoding_equal_the_reference(name):
    m = _model(**CONFIGS[name])
    ids = torch.randint(0, 512, (2, 25), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(ids, attn_impl="naive").logits
        full = GLM5ForCausalLM(m.config.replace(mixer_types=["full"] * 4, sliding_window=None)).eval()
        full.load_state_dict(m.state_dict())
        assert (full(ids).logits[:, W + 1:] - ref[:, W + 1:]).abs().max() > 1e-3  # the window matters
        for impl in ("auto", "absorbed"):
            assert_close(m(ids, attn_impl=impl).logits, ref)
        for impl in ("naive", "auto", "absorbed"):
            cache = KVCache.for_model(m, 2, 25)
            got = [m(ids[:, :W - 1], cache=cache, attn_impl=impl).logits]
            for t0, t1 in ((W - 1, W), (W, W + 3), (W + 3, 20), (20, 25)):
                got.append(m(ids[:, t0:t1], cache=cache, attn_impl=impl).logits)
            assert_close(torch.cat(got, dim=1), ref)


def test_swa_config_is_validated():
    tiny = ModelConfig.from_preset("tiny")
    with pytest.raises(ConfigError, match="sliding_window"):
        tiny.replace(mixer_types=["full", "full", "swa", "full"])
    with pytest.raises(ConfigError, match="sliding_window"):
        tiny.replace(sliding_window=0)
    with pytest.raises(ConfigError, match=r"mixer_types\[1\]"):
        tiny.replace(mixer_types=["attention", "global", "attention", "attention"], sliding_window=2)
    # "full" is the old name of "attention": accepted, stored under the new name
    assert tiny.replace(mixer_types=["full", "attention", "swa", "full"], sliding_window=2).mixer_types == [
        "attention", "attention", "swa", "attention"]
    with pytest.raises(ConfigError, match=r"indexer_types\[1\].*'simple_gdn' layers select none"):
        tiny.replace(mixer_types=["swa", "full", "full", "full"], sliding_window=2)
    cfg = tiny.replace(mixer_types=["full", "full", "swa", "full"], sliding_window=3)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
