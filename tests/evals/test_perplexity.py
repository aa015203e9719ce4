import math

import pytest
import torch
import torch.nn.functional as F

from glm5lab.evals import perplexity


@pytest.fixture(scope="module")
def model():
    from glm5lab import GLM5ForCausalLM, ModelConfig
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(1))


def by_hand(model, ids, window, stride):
    """Each target t (1..N-1) scored by the first window [b, b + window) that predicts it."""
    nll, done = 0.0, 0
    for b in range(0, len(ids), stride):
        e = min(b + window, len(ids) - 1)
        logits = model(ids[b:e][None]).logits[0].float()
        ce = F.cross_entropy(logits, ids[b + 1:e + 1], reduction="none")
        for t in range(b + 1, e + 1):
            if t > done:
                nll += float(ce[t - b - 1])
        done = max(done, e)
        if done == len(ids) - 1:
            break
    return nll / (len(ids) - 1)


@torch.no_grad()
def test_matches_cross_entropy(model, ids):
    full = F.cross_entropy(model(ids[:-1][None]).logits[0].float(), ids[1:]).item()
    r = perplexity(model, ids, window=32)
    assert r.tokens == 32 and r.windows == 1
    assert r.nll == pytest.approx(full, rel=1e-5) and r.ppl == pytest.approx(math.exp(full), rel=1e-5)
    for window, stride in [(8, 8), (8, 3), (13, None)]:
        r = perplexity(model, ids.tolist(), window=window, stride=stride)
        assert r.tokens == 32
        assert r.nll == pytest.approx(by_hand(model, ids, window, stride or window), rel=1e-5)


def test_errors(model, ids):
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, ids, window=8, stride=9)
    with pytest.raises(ValueError, match="window"):
        perplexity(model, ids, window=1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        perplexity(model, ids, window=4096)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(model, ids[:1], window=8)
    with pytest.raises(ValueError, match="outside"):
        perplexity(model, torch.tensor([1, 512]), window=8)
    with pytest.raises(ValueError, match="1-D"):
        perplexity(model, ids[None], window=8)
