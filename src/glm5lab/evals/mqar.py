"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and Improving
Recall in Efficient Language Models", section 3 and their `multiquery_ar` generator).

Sequence s of seq_len + 1 ids (one token per key and per value, as in Zoology):
  s[0 : 2N]       = k_1 v_1 k_2 v_2 ... k_N v_N     N = num_kv_pairs distinct keys from
                                                    vocab.keys, values drawn from vocab.values
                                                    with replacement (as Zoology)
  s[2N : seq_len+1] = Q query pairs (k v, k one of the N keys, no key asked twice) placed in
                    uniformly chosen slots of 2 tokens, every other token a random filler id
                    (Zoology fills the gaps with 0 and draws slots from a power law).
input_ids = s[:-1], labels = s[1:] with IGNORE_INDEX (-100, F.cross_entropy's default, as
`glm5lab.train.losses.cross_entropy`) everywhere except the query keys' positions, where the
label is the key's value. So labels are already shifted: position t of the logits predicts
labels[t], and `F.cross_entropy(logits.flatten(0, 1), labels.flatten())` is the MQAR loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from glm5lab.evals.tasks import IGNORE_INDEX, Scores, TaskVocab, derive_seed, rng
from glm5lab.validate import int_at_least


@dataclass
class MQARExample:
    """input_ids, labels: int64 [seq_len] (see the module docstring). pairs: the N (key, value)
    ids in context order. query_positions: indices t with labels[t] != -100 (input_ids[t] is the
    queried key, labels[t] its value), increasing."""

    input_ids: torch.LongTensor
    labels: torch.LongTensor
    pairs: list[tuple[int, int]]
    query_positions: list[int]
    seed: int


def make_mqar(vocab: TaskVocab, seq_len: int, num_kv_pairs: int, num_queries: int | None = None, *,
              seed: int = 0) -> MQARExample:
    """One MQAR example. num_queries defaults to num_kv_pairs (Zoology's setting).

    Raises ValueError naming the parameter when: seq_len, num_kv_pairs or num_queries is not an
    int >= 1; num_queries > num_kv_pairs; num_kv_pairs > len(vocab.keys); the sequence is too
    short (needs seq_len + 1 >= 2 * (num_kv_pairs + num_queries)); seed is not an int >= 0.
    """
    seq_len, n = int_at_least("seq_len", seq_len, 1), int_at_least("num_kv_pairs", num_kv_pairs, 1)
    q = int_at_least("num_queries", n if num_queries is None else num_queries, 1)
    if q > n:
        raise ValueError(f"num_queries = {q} is not allowed: it must be <= num_kv_pairs = {n}")
    if n > len(vocab.keys):
        raise ValueError(f"num_kv_pairs = {n} exceeds the {len(vocab.keys)} ids of vocab.keys")
    need = 2 * (n + q)
    if seq_len + 1 < need:
        raise ValueError(f"seq_len = {seq_len} is too short: {n} pairs and {q} queries need seq_len >= {need - 1}")
    g = rng(seed)
    keys = g.choice(np.asarray(vocab.keys, dtype=np.int64), size=n, replace=False)
    values = g.choice(np.asarray(vocab.values, dtype=np.int64), size=n, replace=True)
    s = np.empty(seq_len + 1, dtype=np.int64)
    s[0:2 * n:2], s[1:2 * n:2] = keys, values
    tail = seq_len + 1 - 2 * n
    s[2 * n:] = g.choice(np.asarray(vocab.filler, dtype=np.int64), size=tail)
    slots = np.sort(g.choice(tail // 2, size=q, replace=False))
    asked = g.choice(n, size=q, replace=False)
    starts = 2 * n + 2 * slots
    s[starts], s[starts + 1] = keys[asked], values[asked]
    ids = torch.from_numpy(s)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    labels[torch.from_numpy(starts)] = ids[torch.from_numpy(starts + 1)]
    pairs = [(int(k), int(v)) for k, v in zip(keys, values, strict=True)]
    return MQARExample(ids[:-1].clone(), labels, pairs, starts.tolist(), seed)


def make_mqar_batch(vocab: TaskVocab, n: int, seq_len: int, num_kv_pairs: int, num_queries: int | None = None,
                    *, seed: int = 0) -> tuple[torch.LongTensor, torch.LongTensor]:
    """(input_ids, labels), int64 [n, seq_len] each: row i is
    `make_mqar(..., seed=derive_seed(seed, i, "mqar"))` (reproducible; rows differ)."""
    n = int_at_least("n", n, 1)
    rng(seed)
    rows = [make_mqar(vocab, seq_len, num_kv_pairs, num_queries, seed=derive_seed(seed, i, "mqar")) for i in range(n)]
    return torch.stack([r.input_ids for r in rows]), torch.stack([r.labels for r in rows])


def mqar_accuracy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> float:
    """Fraction of answer positions (labels != -100) where argmax over V of the logits equals the
    label (ties: the lowest id, torch.argmax's rule). logits [B, T, V] any float dtype, labels
    int64 [B, T] already shifted (as `make_mqar`). Pure function: no model, no grad.
    Raises ValueError on other shapes or when no label is an answer position."""
    if logits_BTV.ndim != 3 or labels_BT.ndim != 2 or logits_BTV.shape[:2] != labels_BT.shape:
        raise ValueError(f"logits must be [B, T, V] and labels [B, T], got {tuple(logits_BTV.shape)} and "
                         f"{tuple(labels_BT.shape)}")
    mask = labels_BT != IGNORE_INDEX
    if not bool(mask.any()):
        raise ValueError("labels have no answer positions (every label is -100)")
    pred = logits_BTV.detach().argmax(dim=-1)
    return float((pred[mask] == labels_BT[mask]).float().mean())


def generation_prompts(example: MQARExample) -> tuple[list[list[int]], list[int]]:
    """For generation-based scoring: one prompt per query, input_ids[: t + 1] for each query
    position t (the context, earlier queries with their values, then the queried key), and the
    expected value of each. Feed the prompts to `glm5lab.generate(model, prompts, 1)`."""
    ids = example.input_ids.tolist()
    return ([ids[:t + 1] for t in example.query_positions],
            [int(example.labels[t]) for t in example.query_positions])


def score_generated(generated: Sequence[Sequence[int]], expected: Sequence[int]) -> Scores:
    """Per prompt 1.0 if the first generated id equals the expected value, else 0.0 (an empty
    generation scores 0). Raises ValueError if the counts differ or are 0."""
    if len(generated) != len(expected):
        raise ValueError(f"{len(generated)} generated rows but {len(expected)} expected values")
    return Scores.of([float(len(g) > 0 and int(g[0]) == int(e)) for g, e in zip(generated, expected, strict=True)])
