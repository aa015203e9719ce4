"""The speculative draft head is the trained MTP module: cached drafting reproduces what training
computes. Draft 1 after accepted tokens x_0..x_{m-1} is MTP(h_{m-2}, x_{m-1}), i.e. the depth-1
MTP logits at position m-2 of an uncached forward with mtp_depth=1 (fp32 tolerance, conftest)."""

import torch

from glm5lab import GLM5ForCausalLM, KVCache, ModelConfig
from tests.conftest import assert_close


def test_cached_mtp_drafts_equal_training_time_depth1_logits():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, 512, (2, 20))
    with torch.no_grad():
        full = model(ids, mtp_depth=1)
        cache, mtp_cache = KVCache.for_model(model, 2, 20), KVCache.for_mtp(model, 2, 20)
        out = model(ids[:, :11], cache=cache)  # prefill: h_0..h_10
        _, drafts = model.mtp_step(out.hidden_states, ids[:, 1:12], cache=mtp_cache)
        got = [drafts]
        for t in range(11, 19):  # then one token at a time, as decoding does
            out = model(ids[:, t:t + 1], cache=cache)
            got.append(model.mtp_step(out.hidden_states, ids[:, t + 1:t + 2], cache=mtp_cache)[1])
    assert_close(torch.cat(got, dim=1), full.mtp_logits[0])
