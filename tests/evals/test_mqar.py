import pytest
import torch
import torch.nn.functional as F

from glm5lab.evals import (
    TaskVocab,
    generation_prompts,
    make_mqar,
    make_mqar_batch,
    mqar_accuracy,
    score_generated,
)

V = 512
VOCAB = TaskVocab.from_range(V, 400, 40, 60)


@pytest.mark.parametrize("seq_len, n, q", [(16, 4, 4), (64, 8, 3), (257, 16, 16)])
def test_layout_and_labels(seq_len, n, q):
    ex = make_mqar(VOCAB, seq_len, n, q, seed=seq_len)
    x, y = ex.input_ids, ex.labels
    assert x.shape == y.shape == (seq_len,) and x.dtype == y.dtype == torch.long
    kv = dict(ex.pairs)
    assert len(kv) == n and x[:2 * n:2].tolist() == list(kv) and x[1:2 * n:2].tolist() == list(kv.values())
    answer_pos = (y != -100).nonzero().flatten().tolist()
    assert answer_pos == ex.query_positions and len(answer_pos) == q
    asked = [int(x[t]) for t in answer_pos]
    assert len(set(asked)) == q and all(t >= 2 * n for t in answer_pos)
    for t in answer_pos:  # label = the key's value = the next input token (when inside the window)
        assert int(y[t]) == kv[int(x[t])]
        if t + 1 < seq_len:
            assert int(x[t + 1]) == int(y[t])
    rest = [int(x[t]) for t in range(2 * n, seq_len) if t not in answer_pos and t - 1 not in answer_pos]
    assert all(r in VOCAB.filler for r in rest)


def test_batch_determinism():
    a = make_mqar_batch(VOCAB, 5, 64, 8, seed=1)
    b = make_mqar_batch(VOCAB, 5, 64, 8, seed=1)
    c = make_mqar_batch(VOCAB, 5, 64, 8, seed=2)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == a[1].shape == (5, 64)
    assert len({tuple(r) for r in a[0].tolist()}) == 5


def test_accuracy_hand_made():
    labels = torch.full((2, 5), -100)
    labels[0, 1], labels[0, 3], labels[1, 4] = 7, 2, 3
    logits = torch.zeros(2, 5, 10)
    logits[0, 1, 7] = 1.0  # right
    logits[0, 3, 5] = 1.0  # wrong
    logits[1, 4, 3] = 2.0  # right
    logits[1, 0, 9] = 5.0  # ignored position
    assert mqar_accuracy(logits, labels) == pytest.approx(2 / 3)
    logits[0, 3, 2] = 1.0  # a tie between 2 and 5: argmax takes the lowest id, 2 = right
    assert mqar_accuracy(logits, labels) == 1.0
    assert F.cross_entropy(logits.flatten(0, 1), labels.flatten()).isfinite()  # -100 is ignored
    with pytest.raises(ValueError, match="no answer"):
        mqar_accuracy(logits, torch.full((2, 5), -100))
    with pytest.raises(ValueError, match="shape|\\[B, T"):
        mqar_accuracy(logits[0], labels)


def test_generation_scoring():
    ex = make_mqar(VOCAB, 40, 6, 3, seed=0)
    prompts, expected = generation_prompts(ex)
    assert [len(p) - 1 for p in prompts] == ex.query_positions
    assert [p[-1] for p in prompts] == [int(ex.input_ids[t]) for t in ex.query_positions]
    assert expected == [dict(ex.pairs)[p[-1]] for p in prompts]
    s = score_generated([[expected[0], 1], [0], []], expected)
    assert s.per_example == [1.0, 0.0, 0.0] and s.mean == pytest.approx(1 / 3)


@pytest.mark.parametrize("args, match", [
    ((8, 4, 4), "too short"),
    ((64, 4, 5), "num_queries"),
    ((200, 41, 1), "num_kv_pairs"),
    ((0, 1, 1), "seq_len"),
])
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        make_mqar(VOCAB, *args)
