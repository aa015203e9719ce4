import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glm5lab.evals import (
    VARIANTS,
    TaskVocab,
    make_niah,
    make_niah_batch,
    prompts_tensor,
    score_niah,
    training_pair,
)
from glm5lab.evals.tasks import count

V = 512
VOCAB = TaskVocab.from_range(V, 400, 40, 60)


def corpus(n=10_000, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=n).astype(np.int32)  # includes reserved ids


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("length", [64, 257, 4096])
@pytest.mark.parametrize("noise", [True, False])
def test_exact_length_and_structure(variant, length, noise):
    ex = make_niah(VOCAB, length, variant, haystack=None if noise else corpus(), seed=length)
    p = ex.prompt
    assert len(p) == length and p[-1] == VOCAB.answer
    assert all(0 <= t < V for t in p)
    nk, nv, nq = VARIANTS[variant]
    assert len(ex.needles) == nk * nv and len(ex.query_keys) == nq and len(ex.answers) == nq * nv
    for nd in ex.needles:  # the needle template at the recorded position
        k, v = len(nd.key), len(nd.value)
        assert p[nd.position:nd.position + 3 + k + v] == [VOCAB.needle, *nd.key, VOCAB.sep, *nd.value, VOCAB.end]
    for a in ex.answers:  # every expected value occurs exactly once in the prompt
        assert count(p, a) == 1
    for key in ex.query_keys:  # each asked key: its needles (one per value) are present exactly that often
        assert count(p, [VOCAB.needle, *key]) == nv
        assert count(p, [VOCAB.query, *key]) == 1
    asked = {tuple(k) for k in ex.query_keys}
    distractors = {tuple(n.key) for n in ex.needles if not n.asked}
    assert {tuple(n.key) for n in ex.needles if n.asked} == asked
    assert not distractors & asked
    assert len(distractors) == nk - nq
    assert len({tuple(n.value) for n in ex.needles}) == len(ex.needles)  # values distinct
    assert ex.completion == [t for a in ex.answers for t in (*a, VOCAB.end)]
    # markers occur only in the template: needles, queries, one answer marker
    assert p.count(VOCAB.needle) == len(ex.needles) and p.count(VOCAB.query) == nq and p.count(VOCAB.answer) == 1


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_depth(depth):
    ex = make_niah(VOCAB, 1000, "single", depth=depth, seed=1)
    (nd,) = ex.needles
    H = 1000 - (3 + 2 + 2) - (1 + 2) - 1
    assert nd.position == round(depth * H) and nd.depth == pytest.approx(round(depth * H) / H)
    ex = make_niah(VOCAB, 1000, "multikey", depth=[0.1, 0.9, 0.5, 0.3], seed=1)
    H = 1000 - 4 * 7 - 3 - 1
    assert [round(n.depth * H) for n in ex.needles] == sorted(round(d * H) for d in [0.1, 0.9, 0.5, 0.3])
    block = make_niah(VOCAB, 500, "multivalue", depth=0.5, seed=2)  # one block of 4 adjacent needles
    pos = [n.position for n in block.needles]
    assert [b - a for a, b in itertools.pairwise(pos)] == [7, 7, 7]


def test_corpus_haystack_window_and_scrub():
    c = corpus()
    ex = make_niah(VOCAB, 300, "single", haystack=c, depth=1.0, seed=5)
    H = 300 - 7 - 3 - 1
    hay, window = np.array(ex.prompt[:H]), c[ex.haystack_start:ex.haystack_start + H]
    keep = ~np.isin(window, VOCAB.reserved)
    assert keep.sum() < H  # the random corpus does contain reserved ids, which were replaced
    assert (hay[keep] == window[keep]).all()
    assert np.isin(hay[~keep], VOCAB.filler).all()
    assert make_niah(VOCAB, 300, "single", haystack=torch.from_numpy(c), depth=1.0, seed=5) == ex


def test_determinism_and_batches():
    a = make_niah(VOCAB, 257, "multiquery", seed=7)
    assert a == make_niah(VOCAB, 257, "multiquery", seed=7)
    assert a.prompt != make_niah(VOCAB, 257, "multiquery", seed=8).prompt
    b1 = make_niah_batch(VOCAB, 4, 128, "multikey", seed=3, haystack=corpus())
    b2 = make_niah_batch(VOCAB, 4, 128, "multikey", seed=3, haystack=corpus())
    assert b1 == b2
    assert len({tuple(e.prompt) for e in b1}) == 4
    assert make_niah_batch(VOCAB, 4, 128, "multikey", seed=4)[0].prompt != b1[0].prompt
    t = prompts_tensor(b1)
    assert t.dtype == torch.long and t.shape == (4, 128)


def test_score_rules():
    ex = make_niah(VOCAB, 128, "multivalue", seed=0)
    a = ex.answers
    assert len(a) == 4
    shuffled = [t for v in reversed(a) for t in (7, *v)]  # other order, junk between: still all present
    missing = [t for v in a[:3] for t in v]
    broken = [t for v in a for t in (v[0], 9, v[1])]  # values split: not contiguous
    s = score_niah([ex, ex, ex, ex], [ex.completion, shuffled, missing, broken])
    assert s.per_example == [1.0, 1.0, 0.0, 0.0] and s.mean == 0.5
    f = score_niah([ex, ex, ex], [shuffled, missing, []], rule="fraction")
    assert f.per_example == [1.0, 0.75, 0.0] and f.mean == pytest.approx(1.75 / 3)
    assert score_niah([[[1, 2]], [[3]]], [[0, 1, 2], [4]]).per_example == [1.0, 0.0]
    with pytest.raises(ValueError, match="rule"):
        score_niah([ex], [[]], rule="any")
    with pytest.raises(ValueError, match="generated rows"):
        score_niah([ex], [])


def test_training_pair():
    ex = make_niah(VOCAB, 64, "multiquery", seed=1)
    x, y = training_pair(ex)
    T, C = len(ex.prompt), len(ex.completion)
    assert x.shape == y.shape == (T + C - 1,)
    assert x[:T].tolist() == ex.prompt
    assert (y[:T - 1] == -100).all() and y[T - 1:].tolist() == ex.completion
    logits = torch.randn(1, T + C - 1, V)
    assert torch.isfinite(F.cross_entropy(logits.flatten(0, 1), y))


@pytest.mark.parametrize("kwargs, match", [
    ({"context_length": 10}, "too short"),
    ({"context_length": 64, "variant": "nope"}, "variant"),
    ({"context_length": 64, "variant": "multikey", "num_keys": 1}, "multikey"),
    ({"context_length": 64, "variant": "multiquery", "num_keys": 2, "num_queries": 3}, "multiquery"),
    ({"context_length": 64, "variant": "multivalue", "num_values": 1}, "multivalue"),
    ({"context_length": 64, "depth": 1.5}, "depth"),
    ({"context_length": 64, "variant": "multikey", "depth": [0.1, 0.2]}, "depth"),
    ({"context_length": 64, "key_len": 0}, "key_len"),
    ({"context_length": 64, "seed": -1}, "seed"),
    ({"context_length": 64, "haystack": np.array([0, 1, 512])}, "haystack"),
    ({"context_length": 64, "haystack": np.arange(10)}, "haystack"),
    ({"context_length": 4096, "variant": "multikey", "num_keys": 50, "key_len": 1}, "keys"),
])
def test_errors(kwargs, match):
    kwargs = {"variant": "single", **kwargs}
    with pytest.raises(ValueError, match=match):
        make_niah(VOCAB, kwargs.pop("context_length"), kwargs.pop("variant"), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"needle": 512}, "needle"),
    ({"keys": (420, 460)}, "keys and values"),
    ({"filler": (0, 400)}, "filler and markers"),
    ({"values": ()}, "values is empty"),
    ({"sep": 400}, "distinct"),
])
def test_vocab_errors(kwargs, match):
    base = {"vocab_size": V, "needle": 400, "sep": 401, "end": 402, "query": 403, "answer": 404, "keys": tuple(range(405, 445)),
                "values": tuple(range(445, 505)), "filler": tuple(range(400))}
    TaskVocab(**base)
    with pytest.raises(ValueError, match=match):
        TaskVocab(**{**base, **kwargs})
    with pytest.raises(ValueError, match="outside"):
        TaskVocab.from_range(V, 500, 40, 60)


def test_scores_generate_output(tiny_model):
    from glm5lab import generate
    exs = make_niah_batch(VOCAB, 2, 64, "single", seed=0)
    out = generate(tiny_model, prompts_tensor(exs), 4)
    s = score_niah(exs, out.tokens)  # an untrained model: the scorer just has to run on .tokens
    assert len(s.per_example) == 2 and 0.0 <= s.mean <= 1.0
    assert score_niah(exs, [e.completion for e in exs]).mean == 1.0
