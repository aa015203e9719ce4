import math

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.evals import TaskVocab
from glm5lab.evals.search_swa import (
    interleave_pattern,
    loss_scorer,
    mqar_scorer,
    niah_scorer,
    search_swa,
    with_mixers,
)

W = 4  # window; every scored sequence is longer
VOCAB = TaskVocab.from_range(512, 400, 40, 60)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many tiny forwards: on a shared 2-core CPU intra-op threads mostly spin (4x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(layers: int, shared: bool = False) -> GLM5ForCausalLM:
    idx = ["full", "shared"] * (layers // 2) if shared else ["full"] * layers
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=layers, indexer_types=idx, first_k_dense_replace=1)
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).eval()


def ids(T: int = 24, B: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(1))


def swa_set(mixers):
    return {i for i, m in enumerate(mixers) if m == "swa"}


class Counting:
    """A synthetic scorer reading the pattern: minus the number of SWA layers in `forbidden`
    (plus a small per-layer preference so the optimum is unique), counting its calls."""

    def __init__(self, forbidden, prefer=()):
        self.forbidden, self.prefer, self.calls = set(forbidden), set(prefer), []

    def __call__(self, m):
        s = swa_set(m.config.mixer_types)
        self.calls.append(tuple(sorted(s)))
        return -float(len(s & self.forbidden)) + 0.01 * len(s & self.prefer)


def test_interleave_pattern():
    assert interleave_pattern(4) == ["swa", "attention", "swa", "attention"]
    assert interleave_pattern(5, every=3) == ["swa", "swa", "attention", "swa", "swa"]
    assert interleave_pattern(3, every=1) == ["attention"] * 3
    with pytest.raises(ValueError, match="every"):
        interleave_pattern(4, every=0)
    with pytest.raises(ValueError, match="num_layers"):
        interleave_pattern(0)


def test_with_mixers_shares_weights_and_changes_long_logits():
    model = make_model(4)
    m = with_mixers(model, ["swa", "full", "swa", "full"], W)
    assert m.config.mixer_types == ["swa", "attention", "swa", "attention"] and m.config.sliding_window == W  # "full": old alias
    assert m.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr() and not m.training
    x = ids()
    with torch.no_grad():
        a, b = model(x).logits, m(x).logits
    torch.testing.assert_close(a[:, :W], b[:, :W])  # positions < W see the same keys
    assert not torch.allclose(a[:, W:], b[:, W:])


def test_reaches_target_and_patterns_valid():
    model = make_model(4, shared=True)  # indexer full, shared, full, shared: some patterns invalid
    res = search_swa(model, loss_scorer(ids(T=12, B=1)), window=W, beam=3, per_round=1)
    assert len(swa_set(res.mixer_types)) == 2 and res.swa_layers == tuple(sorted(swa_set(res.mixer_types)))
    assert len(res.history) == 2 and res.skipped_invalid > 0  # layer 0 alone as swa leaves layer 1 orphaned
    for r, rnd in enumerate(res.history, 1):
        assert 1 <= len(rnd) <= 3 and [s for _, s in rnd] == sorted((s for _, s in rnd), reverse=True)
        for mixers, s in rnd:
            assert len(swa_set(mixers)) == r and math.isfinite(s)
            model.config.replace(mixer_types=mixers, sliding_window=W)  # valid config
    assert res.history[-1][0] == (res.mixer_types, res.score)
    assert res.score <= 0 and math.isfinite(res.full_score)
    one = search_swa(model, Counting([]), window=W, target_fraction=1.0, beam=1, per_round=3)
    assert one.mixer_types == ["swa"] * 4 and len(one.history) == 2  # 3 then the last 1


def test_greedy_equals_brute_force():
    model = make_model(4)
    loss, memo = loss_scorer(ids(T=12, B=1)), {}

    def score_fn(m):  # the real loss scorer, memoised so the brute force below reruns no forward
        key = tuple(m.config.mixer_types)
        if key not in memo:
            memo[key] = loss(m)
        return memo[key]

    res = search_swa(model, score_fn, window=W, beam=1, per_round=1, target_fraction=0.75)  # 3 of 4
    chosen, evals = [], 1
    for _ in range(3):
        scores = {}
        for i in range(4):
            if i not in chosen:
                mixers = ["swa" if j in chosen or j == i else "full" for j in range(4)]
                scores[i] = score_fn(with_mixers(model, mixers, W))
                evals += 1
        chosen.append(max(scores, key=lambda i: (scores[i], -i)))
    assert len(set(memo.values())) == len(memo)  # no ties: the greedy path is unique
    assert swa_set(res.mixer_types) == set(chosen)
    assert res.evaluations == evals == len(memo) == 1 + 4 + 3 + 2
    assert res.score == scores[chosen[-1]]
    assert [swa_set(r[0][0]) for r in res.history] == [set(chosen[:k]) for k in (1, 2, 3)]


def test_finds_preferred_set():
    model = make_model(6)
    for beam, per_round in [(1, 2), (3, 1)]:
        res = search_swa(model, Counting([0, 2, 3]), window=W, beam=beam, per_round=per_round)
        assert swa_set(res.mixer_types) == {1, 4, 5} and res.score == 0.0
    res = search_swa(model, Counting([], prefer=[0, 5, 3]), window=W, beam=2, per_round=2, max_candidates=4)
    assert len(swa_set(res.mixer_types)) == 3


def test_evaluation_count_with_caching():
    model = make_model(4)
    sc = Counting([], prefer=[0, 1])
    res = search_swa(model, sc, window=W, beam=2, per_round=1)  # 2 of 4
    # round 1: the 4 singles; beam {0}, {1}; round 2: {0,1} {0,2} {0,3} {1,2} {1,3} (= {1,0} cached)
    assert res.evaluations == len(sc.calls) == len(set(sc.calls)) == 1 + 4 + 5
    assert swa_set(res.mixer_types) == {0, 1} and res.score == pytest.approx(0.02)
    sc = Counting([])
    res = search_swa(model, sc, window=W, beam=8, per_round=2, max_candidates=3, seed=5)
    assert res.evaluations == len(sc.calls) == 1 + 3  # one round of at most 3 sampled pairs
    again = Counting([])
    assert search_swa(model, again, window=W, beam=8, per_round=2, max_candidates=3, seed=5).history == res.history
    assert again.calls == sc.calls  # deterministic sampling


def test_task_scorers():
    model = make_model(4)
    for fn in (mqar_scorer(VOCAB, 2, 16, 3, seed=3), niah_scorer(VOCAB, 2, 16, "single", seed=3)):
        s = fn(model)
        assert 0.0 <= s <= 1.0 and fn(model) == s
    res = search_swa(model, mqar_scorer(VOCAB, 1, 16, 3), window=W, beam=1, per_round=2)
    assert len(swa_set(res.mixer_types)) == 2 and 0.0 <= res.score <= 1.0
    with pytest.raises(ValueError, match="ids"):
        loss_scorer(torch.zeros(3, 1, 2, dtype=torch.long))


@pytest.mark.parametrize("kw, name", [
    ({"window": 0}, "window"), ({"target_fraction": 0.0}, "target_fraction"),
    ({"target_fraction": 1.5}, "target_fraction"), ({"beam": 0}, "beam"), ({"per_round": 0}, "per_round"),
    ({"max_candidates": 0}, "max_candidates"),
])
def test_errors(kw, name):
    with pytest.raises(ValueError, match=name):
        search_swa(make_model(4), Counting([]), **{"window": W, **kw})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "x"])
def test_non_finite_scorer(bad):
    with pytest.raises(ValueError, match="score_fn"):
        search_swa(make_model(4), lambda m: bad, window=W)
