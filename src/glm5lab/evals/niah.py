"""Needle-in-a-haystack on token ids, in the RULER variants (Hsieh et al. 2024, "RULER: What's
the Real Context Size of Your Long-Context Language Models?", section 3.1 / their niah.py).

Template (ids from `TaskVocab`; K = key_len, L = value_len):
  needle: [needle] k_1..k_K [sep] v_1..v_L [end]                     (3 + K + L tokens)
  query:  [query] k_1..k_K   once per asked key, in the order of `answers`, then one [answer]
  prompt: haystack with the needles inserted, then the query section; exactly context_length ids.

Variants (RULER's defaults in brackets; any count may be overridden within the variant's rule):
  single     (S-NIAH):  1 key, 1 value, 1 query.
  multikey   (MK-NIAH): num_keys >= 2 keys [4], 1 value each, 1 asked: the others are distractors.
  multiquery (MQ-NIAH): num_keys [4] >= num_queries >= 2 [4] asked; every asked value expected.
  multivalue (MV-NIAH): 1 key, num_values >= 2 [4] values, each in its own needle; all expected.
Keys of one example are distinct sequences; values of one example are distinct sequences. So each
asked key's needle(s) appear once and every expected value occurs exactly once in the prompt.

Haystack: `haystack=None` gives noise (uniform ids from vocab.filler; RULER's "noise" haystack is a repeated
sentence instead); a 1-D id array (e.g. a validation split, `glm5lab.data.pipeline.prepare_data`) gives
a window of it starting at a uniform random offset, in which every reserved id (marker, key, value) is
replaced by a random filler id so no needle or answer can occur by accident. Needles go between haystack
tokens, not at sentence boundaries (RULER's essay haystack does that).

Depth: needle j goes at haystack offset round(depth_j * H), H = haystack length (0 = before the
first haystack token, 1 = after the last); needles at one offset go in a seeded random order.
depth=None draws each offset uniformly from 0..H; a float puts all needles in one block there; a
sequence gives one depth per needle (needles in the order: key 0's values, key 1's values, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from glm5lab.data.batches import token_ids
from glm5lab.evals.tasks import IGNORE_INDEX, Scores, TaskVocab, contains, derive_seed, rng
from glm5lab.validate import int_at_least, one_of

VARIANTS = {  # name: (num_keys, num_values, num_queries) defaults, as RULER's configs
    "single": (1, 1, 1),
    "multikey": (4, 1, 1),
    "multiquery": (4, 1, 4),
    "multivalue": (1, 4, 1),
}
SCORE_RULES = ("all", "fraction")


@dataclass
class Needle:
    """One inserted needle: key and value token ids, `position` = prompt index of its [needle]
    marker, `depth` = its haystack offset / H (0.0 when H = 0), `asked` = its key is queried."""

    key: list[int]
    value: list[int]
    position: int
    depth: float
    asked: bool


@dataclass
class NIAHExample:
    """prompt: exactly context_length ids, ending with vocab.answer. answers: the expected value sequences
    (asked keys in query order, each key's values in needle order). completion: the canonical continuation,
    each answer followed by vocab.end (training target). needles: every inserted needle, distractors included,
    sorted by position. haystack_start: start of the corpus window (None for noise)."""

    variant: str
    prompt: list[int]
    answers: list[list[int]]
    completion: list[int]
    needles: list[Needle]
    query_keys: list[list[int]]
    haystack_start: int | None
    seed: int


def make_niah(vocab: TaskVocab, context_length: int, variant: str = "single", *, num_keys: int | None = None,
              num_values: int | None = None, num_queries: int | None = None, key_len: int = 2,
              value_len: int = 2, depth: float | Sequence[float] | None = None,
              haystack: np.ndarray | Sequence[int] | torch.Tensor | None = None, seed: int = 0) -> NIAHExample:
    """One NIAH example of exactly `context_length` prompt tokens (see the module docstring).

    Needs context_length >= num_keys * num_values * (3 + key_len + value_len)
    + num_queries * (1 + key_len) + 1 (a haystack of >= 0 tokens), and a corpus haystack of at
    least the haystack length. Raises ValueError naming the parameter when: variant is not one
    of VARIANTS; a count breaks the variant's rule; key_len / value_len < 1; the context is too
    short; there are fewer than num_keys distinct keys (len(vocab.keys) ** key_len) or
    num_keys * num_values distinct values; depth is outside [0, 1] or has the wrong length;
    haystack is not 1-D or has ids outside [0, vocab_size) or is too short; seed is not an int >= 0.
    """
    one_of("variant", variant, VARIANTS)
    dk, dv, dq = VARIANTS[variant]
    nk = int_at_least("num_keys", dk if num_keys is None else num_keys, 1)
    nv = int_at_least("num_values", dv if num_values is None else num_values, 1)
    nq = int_at_least("num_queries", dq if num_queries is None else num_queries, 1)
    _check_variant(variant, nk, nv, nq)
    key_len, value_len = int_at_least("key_len", key_len, 1), int_at_least("value_len", value_len, 1)
    context_length = int_at_least("context_length", context_length, 1)
    n_needles = nk * nv
    fixed = n_needles * (3 + key_len + value_len) + nq * (1 + key_len) + 1  # needles, queries, [answer]
    if context_length < fixed:
        raise ValueError(f"context_length = {context_length} is too short: {n_needles} needle(s) and "
                         f"{nq} query(ies) need {fixed} tokens")
    H = context_length - fixed
    depths = _depths(depth, n_needles)
    if haystack is not None:
        haystack = token_ids("haystack", haystack, vocab.vocab_size)
        if len(haystack) < H:
            raise ValueError(f"haystack has {len(haystack)} tokens, fewer than the {H} this context needs")

    g = rng(seed)
    keys = _distinct(g, vocab.keys, key_len, nk, "keys")
    values = _distinct(g, vocab.values, value_len, n_needles, "values")
    asked = g.choice(nk, size=nq, replace=False).tolist()  # asked key indices, in query order
    pairs = [(k, keys[k], values[k * nv + j]) for k in range(nk) for j in range(nv)]
    if depths is None:
        offsets = g.integers(0, H + 1, size=n_needles)
    else:
        offsets = np.array([round(d * H) for d in depths], dtype=np.int64)
    tiebreak = g.permutation(n_needles)
    start = None
    if haystack is None:
        hay = g.choice(np.asarray(vocab.filler, dtype=np.int64), size=H)
    else:
        start = int(g.integers(0, len(haystack) - H + 1))
        hay = haystack[start:start + H].copy()
        bad = np.isin(hay, vocab.reserved)
        hay[bad] = g.choice(np.asarray(vocab.filler, dtype=np.int64), size=int(bad.sum()))

    order = sorted(range(n_needles), key=lambda i: (int(offsets[i]), int(tiebreak[i])))
    prompt: list[int] = []
    needles: list[Needle] = []
    cursor = 0
    for i in order:
        off = int(offsets[i])
        prompt += hay[cursor:off].tolist()
        cursor = off
        k, key, value = pairs[i]
        needles.append(Needle(list(key), list(value), len(prompt), off / H if H else 0.0, k in asked))
        prompt += [vocab.needle, *key, vocab.sep, *value, vocab.end]
    prompt += hay[cursor:].tolist()
    for k in asked:
        prompt += [vocab.query, *keys[k]]
    prompt.append(vocab.answer)
    assert len(prompt) == context_length
    answers = [list(values[k * nv + j]) for k in asked for j in range(nv)]
    completion = [t for a in answers for t in (*a, vocab.end)]
    return NIAHExample(variant, prompt, answers, completion, needles, [list(keys[k]) for k in asked], start, seed)


def make_niah_batch(vocab: TaskVocab, n: int, context_length: int, variant: str = "single", *, seed: int = 0,
                    **kwargs) -> list[NIAHExample]:
    """n examples; example i is `make_niah(..., seed=derive_seed(seed, i, "niah"))`, so a batch is
    reproducible from (seed, n) and its examples differ. kwargs go to `make_niah`."""
    n = int_at_least("n", n, 1)
    rng(seed)  # validates seed
    return [make_niah(vocab, context_length, variant, seed=derive_seed(seed, i, "niah"), **kwargs) for i in range(n)]


def prompts_tensor(examples: Sequence[NIAHExample]) -> torch.LongTensor:
    """int64 [N, T] of the prompts (for `glm5lab.generate`); ValueError if lengths differ."""
    lengths = {len(e.prompt) for e in examples}
    if len(lengths) != 1:
        raise ValueError(f"prompts have lengths {sorted(lengths)}: stacking needs one length")
    return torch.tensor([e.prompt for e in examples], dtype=torch.long)


def training_pair(example: NIAHExample) -> tuple[torch.LongTensor, torch.LongTensor]:
    """(input_ids, labels), int64 [T + C - 1] each, for s = prompt + completion (C tokens):
    input_ids = s[:-1], labels = s[1:] with IGNORE_INDEX (-100, F.cross_entropy's default, as
    `glm5lab.train.losses.cross_entropy` uses) except at the C completion targets. Labels are
    already shifted: `cross_entropy(model(input_ids[None]).logits, labels[None])`."""
    s = torch.tensor(example.prompt + example.completion, dtype=torch.long)
    labels = s[1:].clone()
    labels[:len(example.prompt) - 1] = IGNORE_INDEX
    return s[:-1], labels


def score_niah(answers: Sequence[NIAHExample] | Sequence[Sequence[Sequence[int]]],
               generated: Sequence[Sequence[int]], rule: str = "all") -> Scores:
    """Score generated token lists (e.g. `glm5lab.generate(...).tokens`) against the answers.

    answers: NIAHExamples, or per example a list of expected value id sequences. An expected value counts as
    present when its ids occur as a contiguous run anywhere in the generated ids (exact ids; order between
    values, extra tokens and repeats do not matter). rule "all": 1.0 if every expected value is present, else
    0.0 (strict; one missing MQ/MV value gives 0). rule "fraction": the fraction present (RULER's
    string_match_all, which RULER reports for all NIAH variants). Returns Scores(per_example, mean). Raises
    ValueError if rule is not one of SCORE_RULES, the counts differ, or there are none.
    """
    one_of("rule", rule, SCORE_RULES)
    expected = [a.answers if isinstance(a, NIAHExample) else a for a in answers]
    if len(expected) != len(generated):
        raise ValueError(f"{len(expected)} answer sets but {len(generated)} generated rows")
    per = []
    for exp, gen in zip(expected, generated, strict=True):
        if not exp:
            raise ValueError("an example has no expected values")
        hits = [contains(gen, v) for v in exp]
        per.append(float(all(hits)) if rule == "all" else sum(hits) / len(hits))
    return Scores.of(per)


def _check_variant(variant: str, nk: int, nv: int, nq: int) -> None:
    rules = {
        "single": (nk == 1 and nv == 1 and nq == 1, "num_keys = num_values = num_queries = 1"),
        "multikey": (nk >= 2 and nv == 1 and nq == 1, "num_keys >= 2, num_values = num_queries = 1"),
        "multiquery": (nk >= nq >= 2 and nv == 1, "num_keys >= num_queries >= 2, num_values = 1"),
        "multivalue": (nk == 1 and nv >= 2 and nq == 1, "num_keys = 1, num_values >= 2, num_queries = 1"),
    }
    ok, rule = rules[variant]
    if not ok:
        raise ValueError(f"num_keys = {nk}, num_values = {nv}, num_queries = {nq} are not allowed for "
                         f"variant {variant!r}: it needs {rule}")


def _depths(depth, n: int) -> list[float] | None:
    if depth is None:
        return None
    ds = [depth] * n if isinstance(depth, (int, float, np.floating)) and not isinstance(depth, bool) else list(depth)
    if len(ds) != n:
        raise ValueError(f"depth has {len(ds)} entries but there are {n} needles (give one per needle, a float, "
                         "or None)")
    for d in ds:
        if isinstance(d, bool) or not isinstance(d, (int, float, np.floating)) or not 0.0 <= d <= 1.0:
            raise ValueError(f"depth {d!r} is not allowed: it must be a number in [0, 1] (or None = random)")
    return [float(d) for d in ds]


def _distinct(g: np.random.Generator, pool: Sequence[int], length: int, n: int, name: str) -> list[tuple[int, ...]]:
    """n distinct sequences of `length` ids from `pool`, drawn uniformly without replacement."""
    capacity = len(pool) ** length
    if n > capacity:
        raise ValueError(f"{name}: {n} distinct sequences of {length} ids are needed but vocab.{name} "
                         f"({len(pool)} ids) gives only {capacity}")
    pool = np.asarray(pool, dtype=np.int64)
    if capacity <= 1 << 20:
        codes = g.choice(capacity, size=n, replace=False)
        digits = [(codes // len(pool) ** p) % len(pool) for p in range(length)]
        return [tuple(int(pool[d[i]]) for d in digits) for i in range(n)]
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < n:
        seen.setdefault(tuple(int(t) for t in g.choice(pool, size=length)), None)
    return list(seen)
