"""The balance figures a MoE user reads (`glm5lab.train.balance`), against hand-computed values."""

import math

from glm5lab.train.balance import DEAD_WINDOW, balance_metrics, cv, dead_experts, max_mean


def test_max_mean_and_cv_by_hand():
    assert max_mean([2, 2, 2, 2]) == 1.0 and cv([2, 2, 2, 2]) == 0.0
    assert max_mean([8, 0, 0, 0]) == 4.0 and math.isclose(cv([8, 0, 0, 0]), math.sqrt(3))  # one hot expert: sqrt(E-1)
    # loads 1, 2, 3, 6: mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5
    assert max_mean([1, 2, 3, 6]) == 2.0 and math.isclose(cv([1, 2, 3, 6]), math.sqrt(3.5) / 3)
    assert max_mean([0, 0]) == 1.0 and cv([0, 0]) == 0.0  # no tokens: nothing to call unbalanced


def test_dead_experts_over_the_window():
    assert dead_experts([[0, 1, 0], [0, 0, 2]]) == 1  # expert 0 got nothing in either step
    history = [[[5, 0, 1]]] * (DEAD_WINDOW - 1) + [[[5, 0, 0]]] + [[[4, 0, 2]]]
    m = balance_metrics(history)
    assert m == {"load_max_mean": [2.0], "load_cv": [round(math.sqrt(8 / 3) / 2, 4)], "dead_experts": [1]}
    # only the last DEAD_WINDOW steps count: an expert idle for exactly that long is dead
    assert balance_metrics([[[1, 1]]] + [[[2, 0]]] * DEAD_WINDOW)["dead_experts"] == [1]
    assert balance_metrics([]) == {} and balance_metrics([[]]) == {}
