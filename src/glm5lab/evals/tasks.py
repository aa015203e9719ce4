"""Shared pieces of the synthetic long-context tasks: the reserved token ids (`TaskVocab`),
seed derivation, id validation and the per-example score container.

Every task works on token ids only, so any tokenizer or vocabulary works: the caller reserves a
small range of ids (markers, keys, values) and says which ids may serve as filler noise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glm5lab.validate import int_at_least

IGNORE_INDEX = -100
"""The label of a position that is not scored: F.cross_entropy's default ignore_index (as
`glm5lab.train.losses.cross_entropy`)."""
MARKERS = ("needle", "sep", "end", "query", "answer")
"""Marker fields of `TaskVocab`, in the order `TaskVocab.from_range` assigns them."""


@dataclass(frozen=True)
class TaskVocab:
    """Which token ids the synthetic tasks use. All ids lie in [0, vocab_size).

    Markers (one id each) build the NIAH template (see `glm5lab.evals.niah`):
      needle: opens a needle; sep: between key and value tokens; end: closes a needle and ends each
      value of the canonical completion; query: opens a queried key; answer: last prompt token.
    keys / values: ids that key / value tokens are drawn from (a key or value is `key_len` /
    `value_len` such tokens). filler: ids of noise haystacks and MQAR gaps; also replaces any
    reserved id found in a corpus haystack.

    Markers, keys and values must be pairwise disjoint; filler must be disjoint from all of
    them. Raises ValueError naming the field otherwise, or when an id is outside
    [0, vocab_size), a pool is empty, or holds duplicates.
    """

    vocab_size: int
    needle: int
    sep: int
    end: int
    query: int
    answer: int
    keys: tuple[int, ...]
    values: tuple[int, ...]
    filler: tuple[int, ...]

    def __post_init__(self):
        int_at_least("vocab_size", self.vocab_size, 1)
        for name in MARKERS:
            _check_id(name, getattr(self, name), self.vocab_size)
        markers = [getattr(self, n) for n in MARKERS]
        if len(set(markers)) != len(markers):
            raise ValueError(f"markers {dict(zip(MARKERS, markers, strict=True))} must be distinct ids")
        for name in ("keys", "values", "filler"):
            pool = tuple(int(i) for i in getattr(self, name))
            object.__setattr__(self, name, pool)
            if not pool:
                raise ValueError(f"{name} is empty: it needs at least one id")
            if len(set(pool)) != len(pool):
                raise ValueError(f"{name} holds duplicate ids")
            for i in pool:
                _check_id(name, i, self.vocab_size)
        m, k, v, f = set(markers), set(self.keys), set(self.values), set(self.filler)
        for (a, sa), (b, sb) in [(("markers", m), ("keys", k)), (("markers", m), ("values", v)),
                                 (("keys", k), ("values", v)), (("filler", f), ("markers", m)),
                                 (("filler", f), ("keys", k)), (("filler", f), ("values", v))]:
            if sa & sb:
                raise ValueError(f"{a} and {b} share ids {sorted(sa & sb)[:8]}: they must be disjoint")

    @classmethod
    def from_range(cls, vocab_size: int, start: int, num_keys: int, num_values: int,
                   filler: Sequence[int] | None = None) -> TaskVocab:
        """Reserve ids start .. start + 5 + num_keys + num_values - 1: the 5 markers (order of
        `MARKERS`), then the keys, then the values. filler defaults to every other id of the
        vocabulary. Raises ValueError if the range leaves [0, vocab_size) (or as `TaskVocab`)."""
        n = len(MARKERS) + num_keys + num_values
        if num_keys < 1 or num_values < 1:
            raise ValueError(f"num_keys = {num_keys}, num_values = {num_values}: both must be >= 1")
        if start < 0 or start + n > vocab_size:
            raise ValueError(f"reserved range [{start}, {start + n}) is outside [0, vocab_size={vocab_size})")
        ids = list(range(start, start + n))
        if filler is None:
            filler = [i for i in range(vocab_size) if not start <= i < start + n]
        markers = dict(zip(MARKERS, ids[:len(MARKERS)], strict=True))
        return cls(vocab_size, **markers, keys=tuple(ids[5:5 + num_keys]), values=tuple(ids[5 + num_keys:]),
                   filler=tuple(filler))

    @property
    def reserved(self) -> np.ndarray:
        """Sorted int64 array of the marker, key and value ids."""
        return np.array(sorted({*(getattr(self, n) for n in MARKERS), *self.keys, *self.values}), dtype=np.int64)


@dataclass
class Scores:
    """per_example[i] in [0, 1] for example i; mean = their mean (a float)."""

    per_example: list[float]
    mean: float

    @classmethod
    def of(cls, per_example: Sequence[float]) -> Scores:
        per = [float(s) for s in per_example]
        if not per:
            raise ValueError("no examples to score")
        return cls(per, sum(per) / len(per))


def derive_seed(seed: int, index: int, task: str) -> int:
    """Seed of example `index` of a batch drawn with `seed`: the first 63 bits of
    SHA-256("glm5lab-evals:{task}:{seed}:{index}") (as `glm5lab.data.batches` derives epochs)."""
    digest = hashlib.sha256(f"glm5lab-evals:{task}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def rng(seed: int) -> np.random.Generator:
    """numpy's generator for `seed`, an int >= 0 (ValueError otherwise)."""
    return np.random.default_rng(int_at_least("seed", seed, 0))


def contains(tokens: Sequence[int], pattern: Sequence[int]) -> bool:
    """True if `pattern` occurs as a contiguous run of `tokens` (an empty pattern always does)."""
    tokens, pattern, n = list(tokens), list(pattern), len(pattern)
    return any(tokens[i:i + n] == pattern for i in range(len(tokens) - n + 1))


def count(tokens: Sequence[int], pattern: Sequence[int]) -> int:
    """Number of (possibly overlapping) contiguous occurrences of a non-empty `pattern`."""
    tokens, pattern, n = list(tokens), list(pattern), len(pattern)
    return sum(tokens[i:i + n] == pattern for i in range(len(tokens) - n + 1))


def _check_id(name: str, value, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < vocab_size:
        raise ValueError(f"{name} id {value!r} is not allowed: it must be an int in [0, vocab_size={vocab_size})")
