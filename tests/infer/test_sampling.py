"""Token choice (`glm5lab.infer.sampling`): `distribution` against hand-computed distributions
(greedy ties, temperature, top-k, top-p and their order), `Sampling.check` refusing bad values
by name, and `draw` (seeded, and its frequencies against the probabilities)."""

import math

import pytest
import torch

from glm5lab.infer.sampling import Sampling, distribution, draw
from tests.conftest import assert_close

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs, dtype=torch.float32):
    return torch.tensor(probs, dtype=torch.float64).log().to(dtype)


# -- distribution -------------------------------------------------------------------------------
def test_greedy_is_one_hot_at_argmax_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],   # tie between 1 and 2 -> 1
                           [2.0, 2.0, 2.0, 2.0],   # all tied -> 0
                           [-1.0, -5.0, 0.0, -0.5],
                           [0.0, 0.0, 0.0, 7.0]])
    probs = distribution(logits, Sampling(0.0))
    expected = torch.zeros(4, 4)
    expected[[0, 1, 2, 3], [1, 0, 2, 3]] = 1.0
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected)
    # top_k / top_p do not change greedy
    assert torch.equal(distribution(logits, Sampling(0.0, top_k=2, top_p=0.3)), expected)


def test_greedy_accepts_bf16_and_returns_fp32():
    logits = torch.tensor([[0.5, 0.25, 2.0]], dtype=torch.bfloat16)
    probs = distribution(logits, Sampling(0.0))
    assert probs.dtype == torch.float32 and probs.tolist() == [[0.0, 0.0, 1.0]]


@pytest.mark.parametrize("temperature", [0.25, 1.0, 2.5])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0)) * 3
    probs = distribution(logits, Sampling(temperature))
    assert_close(probs, (logits.double() / temperature).softmax(-1).float())


def test_temperature_by_hand():
    # logits log([0.5, 0.3, 0.15, 0.05]) at T=2: probabilities proportional to sqrt(p)
    probs = distribution(logits_of(PROBS), Sampling(2.0))
    roots = [math.sqrt(p) for p in PROBS]
    assert_close(probs, torch.tensor([r / sum(roots) for r in roots]))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([0.0, 3.0, -1.0, 2.0, 1.0])
    probs = distribution(logits, Sampling(1.0, top_k=2))
    e = 1 / (1 + math.exp(-1.0))  # exp(3) / (exp(3) + exp(2))
    assert_close(probs, torch.tensor([0.0, e, 0.0, 1 - e, 0.0]))
    assert (probs > 0).tolist() == [False, True, False, True, False]
    one = distribution(logits, Sampling(1.0, top_k=1))
    assert one.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_k_equal_to_vocab_and_top_p_one_change_nothing():
    logits = torch.randn(2, 7, generator=torch.Generator().manual_seed(1))
    full = distribution(logits, Sampling(1.0))
    assert_close(distribution(logits, Sampling(1.0, top_k=7)), full)
    assert_close(distribution(logits, Sampling(1.0, top_p=1.0)), full)


@pytest.mark.parametrize("top_p, expected", [
    (0.8, [0.625, 0.375, 0.0, 0.0]),            # 0.5 + 0.3 reaches 0.8: two kept, renormalised
    (0.5, [1.0, 0.0, 0.0, 0.0]),                # the first alone reaches 0.5
    (0.3, [1.0, 0.0, 0.0, 0.0]),                # the most likely token is always kept
    (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.8 < 0.85: the token crossing it is kept
    (0.96, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p_by_hand(top_p, expected):
    probs = distribution(logits_of(PROBS), Sampling(1.0, top_p=top_p))
    assert_close(probs, torch.tensor(expected))
    assert (probs > 0).tolist() == [e > 0 for e in expected]


def test_top_p_works_on_unsorted_vocab_and_per_row():
    # the same distribution permuted, and a second row with another nucleus
    logits = torch.stack([logits_of([0.15, 0.5, 0.05, 0.3]), logits_of([0.05, 0.15, 0.3, 0.5])])
    probs = distribution(logits, Sampling(1.0, top_p=0.8))
    assert_close(probs, torch.tensor([[0.0, 0.625, 0.0, 0.375], [0.0, 0.0, 0.375, 0.625]]))


def test_top_k_then_top_p_order():
    # probs [0.4, 0.3, 0.2, 0.1]. top-k=2 first -> [4/7, 3/7]; then top-p=0.5 on that keeps only
    # token 0 (4/7 >= 0.5). The other order (top-p first: 0.4 < 0.5 keeps {0, 1}) would give [4/7, 3/7].
    probs = distribution(logits_of([0.4, 0.3, 0.2, 0.1]), Sampling(1.0, top_k=2, top_p=0.5))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]
    probs = distribution(logits_of([0.4, 0.3, 0.2, 0.1]), Sampling(1.0, top_k=3, top_p=0.75))
    # top-3 renormalised: [4/9, 3/9, 2/9]; mass before token 2 is 7/9 >= 0.75 -> dropped
    assert_close(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_temperature_applies_before_top_p():
    # at T=2 the probabilities are ~[0.379, 0.294, 0.208, 0.120]: top-p 0.8 keeps three tokens
    # (at T=1 it would keep two)
    logits = logits_of(PROBS)
    probs = distribution(logits, Sampling(2.0, top_p=0.8))
    ref = (logits.double() / 2).softmax(-1)[:3]
    assert_close(probs, torch.cat([ref / ref.sum(), torch.zeros(1, dtype=torch.float64)]).float())


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(0.7), Sampling(1.3, top_k=5),
                                      Sampling(1.0, top_p=0.6), Sampling(0.9, top_k=20, top_p=0.95)])
def test_rows_sum_to_one_any_leading_shape(sampling):
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(2)) * 4
    probs = distribution(logits, sampling)
    assert probs.shape == (2, 3, 50) and probs.dtype == torch.float32
    assert bool((probs >= 0).all())
    assert_close(probs.sum(-1), torch.ones(2, 3))
    # a leading shape is only a batch of rows
    assert_close(probs.reshape(6, 50), distribution(logits.reshape(6, 50), sampling))
    if sampling.top_k is not None:
        assert bool(((probs > 0).sum(-1) <= sampling.top_k).all())


# -- Sampling.check -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 11}, r"top_k.*vocab_size=10"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": "0.9"}, "top_p"),
])
def test_check_refuses_bad_values_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**{"temperature": 1.0, **kwargs}).check(10)


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(0), Sampling(2), Sampling(1.0, top_k=10),
                                      Sampling(1.0, top_k=1), Sampling(1.0, top_p=1), Sampling(0.5, 3, 0.01)])
def test_check_accepts_good_values(sampling):
    assert sampling.check(10) is sampling


# -- draw ---------------------------------------------------------------------------------------
def test_draw_is_reproducible_with_a_seed():
    probs = distribution(torch.randn(1000, 9, generator=torch.Generator().manual_seed(3)), Sampling(1.0))
    a = draw(probs, Sampling(1.0), torch.Generator().manual_seed(7))
    b = draw(probs, Sampling(1.0), torch.Generator().manual_seed(7))
    c = draw(probs, Sampling(1.0), torch.Generator().manual_seed(8))
    assert a.dtype == torch.int64 and a.shape == (1000,)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 1000 draws from 9 tokens: equal with negligible probability


def test_draw_greedy_is_argmax_and_keeps_leading_shape():
    probs = distribution(torch.tensor([[[0.0, 2.0, 1.0], [5.0, 5.0, 1.0]]]), Sampling(0.0))
    assert draw(probs, Sampling(0.0), None).tolist() == [[1, 0]]
    sampled = draw(distribution(torch.zeros(2, 3, 4), Sampling(1.0)), Sampling(1.0), torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 3)


def test_draw_frequencies_match_probabilities():
    # 200k draws: the standard error of each frequency is sqrt(p(1-p)/N) <= 0.0011, so atol 0.005
    # is > 4.5 standard errors; a token of probability 0 is never drawn.
    N = 200_000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    tokens = draw(probs.expand(N, 5), Sampling(1.0), torch.Generator().manual_seed(11))
    freq = torch.bincount(tokens, minlength=5).float() / N
    assert_close(freq, probs, atol=0.005, rtol=0)
    assert freq[4] == 0
    # and through `distribution` with top-k + top-p: only the kept tokens, in their renormalised ratio
    p = distribution(logits_of(PROBS), Sampling(1.0, top_k=3, top_p=0.85))
    tokens = draw(p.expand(N, 4), Sampling(1.0), torch.Generator().manual_seed(12))
    freq = torch.bincount(tokens, minlength=4).float() / N
    assert_close(freq, torch.tensor([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]), atol=0.005, rtol=0)
    assert freq[3] == 0
