"""The expert-parallel all-to-all contract (`glm5lab.parallel.alltoall.a2a_bytes`, re-exported by `glm5lab.ledger`).

Checked by hand on a 4-rank routing, against an independent construction (the rank-to-rank split
sizes a dispatcher passes to its all-to-all, off the diagonal), and against the uniform-routing
per-token form `a2a_per_token`; every refusal names the field, the value and what is allowed.
"""

from __future__ import annotations

import random

import pytest

from glm5lab import ModelConfig
from glm5lab.parallel import alltoall as lg
from glm5lab.parallel.alltoall import crossing_rows

LOAD = [[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 1, 0], [2, 0, 0, 3]]
"""4 ranks (2 data x ep 2), E = 4: experts 0-1 on EP index 0, 2-3 on EP index 1. Crossing rows:
rank 0 (EP 0) 3 + 4, rank 1 (EP 1) 5 + 6, rank 2 (EP 0) 1, rank 3 (EP 1) 2: 21."""


def test_a2a_bytes_by_hand():
    assert crossing_rows(LOAD, 2) == 21
    assert lg.a2a_bytes(LOAD, 2, 8, "bf16") == 21 * 8 * 2 * 2 * 2 == 1344
    assert lg.a2a_bytes(LOAD, 2, 8, "bf16", backward=False) == 672
    assert lg.a2a_bytes(LOAD, 2, 8, "fp8", backward=False) == 21 * 8 * 1 * 2 == 336
    assert lg.a2a_bytes(LOAD, 2, 8, "float32", backward=False) == 21 * 8 * 4 * 2  # torch names too
    assert lg.a2a_bytes(LOAD, 1, 8, "bf16") == 0  # one EP rank: every row is local
    # ep = 4 over 4 ranks: one expert per rank, rank r keeps only expert r
    assert crossing_rows(LOAD, 4) == sum(map(sum, LOAD)) - (1 + 6 + 1 + 3)


def split_sizes(load_RE, ep: int) -> list[list[int]]:
    """send[r][s]: rows rank r sends to world rank s, as a dispatcher's all-to-all split sizes: the
    destination of expert e is the rank of r's data replica with EP index e // (E / ep)."""
    R, E = len(load_RE), len(load_RE[0])
    send = [[0] * R for _ in range(R)]
    for r, row in enumerate(load_RE):
        for e, n in enumerate(row):
            send[r][(r // ep) * ep + e // (E // ep)] += n
    return send


@pytest.mark.parametrize("ep, replicas, E", [(2, 3, 8), (4, 2, 8), (8, 1, 16), (1, 4, 4)])
def test_a2a_bytes_equal_the_off_diagonal_split_sizes(ep, replicas, E):
    rng = random.Random(ep * 100 + E)
    load = [[rng.randrange(0, 50) for _ in range(E)] for _ in range(ep * replicas)]
    send = split_sizes(load, ep)
    off_diagonal = sum(n for r, row in enumerate(send) for s, n in enumerate(row) if r != s)
    assert lg.a2a_bytes(load, ep, 16, "bf16", backward=False) == off_diagonal * 16 * 2 * 2
    assert lg.a2a_bytes(load, ep, 16, "bf16") == 2 * off_diagonal * 16 * 2 * 2


@pytest.mark.parametrize("preset, ep, replicas", [("tiny", 2, 3), ("tiny", 4, 1), ("tiny", 8, 2), ("glm5", 8, 2),
                                                  ("glm5", 64, 1)])
def test_uniform_per_token_form_equals_a2a_bytes_on_uniform_counts(preset, ep, replicas):
    cfg = ModelConfig.from_preset(preset)
    E, K, D = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    tokens = E  # per rank: T K / E = K rows to each expert
    load = [[tokens * K // E] * E for _ in range(ep * replicas)]
    per_token = lg.a2a_per_token(cfg, ep=ep, dtype="bf16")
    assert per_token["dispatch"] == per_token["combine"] == K * D * 2 * (ep - 1) / ep
    expected = ep * replicas * tokens * (per_token["dispatch"] + per_token["combine"])
    assert lg.a2a_bytes(load, ep, D, "bf16", backward=False) == expected
    assert lg.a2a_bytes(load, ep, D, "bf16") == 2 * expected
    # garbage must fail: every row on its own rank (ep > 1) is not the uniform figure
    local = [[K * tokens // (E // ep) if e // (E // ep) == r % ep else 0 for e in range(E)] for r in range(ep)]
    assert lg.a2a_bytes(local, ep, D, "bf16") == 0 and (ep == 1 or expected > 0)


def test_glm5_per_token_by_hand():
    d = lg.a2a_per_token(ModelConfig.from_preset("glm5"), ep=8, dtype="bf16")
    assert d == {"dtype": "bf16", "bytes_per_value": 2, "dispatch": 8 * 6144 * 2 * 7 / 8, "combine": 86016.0}


@pytest.mark.parametrize("args, match", [
    ((LOAD, 0, 8, "bf16"), r"ep = 0 is not allowed: an integer >= 1"),
    ((LOAD, 3, 8, "bf16"), r"ep = 3 is not allowed: a divisor of the number of routed experts E = 4"),
    ((LOAD[:3], 2, 8, "bf16"), r"len\(load_RE\) = 3 is not allowed: a multiple of ep = 2"),
    (([[1, 2, 3, 4], [1, 2]], 2, 8, "bf16"), r"load_RE\[1\] = \[1, 2\] is not allowed: a list of E = 4 counts"),
    (([[1, 2, -1, 4], [0] * 4], 2, 8, "bf16"), r"load_RE\[0\]\[2\] = -1 is not allowed: an int >= 0"),
    (([[1, 2, True, 4], [0] * 4], 2, 8, "bf16"), r"load_RE\[0\]\[2\] = True is not allowed"),
    (([[1.0, 2, 3, 4], [0] * 4], 2, 8, "bf16"), r"load_RE\[0\]\[0\] = 1.0 is not allowed"),
    (([], 2, 8, "bf16"), r"load_RE = \[\] is not allowed: a non-empty list of lists"),
    (([[]], 1, 8, "bf16"), r"len\(load_RE\[0\]\) = 0 is not allowed"),
    ((LOAD, 2, 0, "bf16"), r"hidden_size = 0 is not allowed"),
    ((LOAD, 2, 8, "int4"), r"dtype = 'int4' is not allowed: one of fp32, bf16, fp16, fp8"),
])
def test_a2a_bytes_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        lg.a2a_bytes(*args)


def test_a2a_per_token_refuses_an_ep_that_does_not_divide_the_experts():
    with pytest.raises(ValueError, match=r"^ep = 3 is not allowed: a divisor of the routed experts, n_routed_experts = 8$"):
        lg.a2a_per_token(ModelConfig.from_preset("tiny"), ep=3)
