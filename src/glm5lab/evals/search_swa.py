"""Training-free searched sliding-window attention (SWA): which layers of a trained model can
switch from full attention to a `window`-token sliding window with the least damage.

Source: the GLM-5 report's efficient-attention ablations (../shared/SPEC.md, "searched SWA"):
on a trained model, a beam search (beam size 8, about two layers replaced per round, no training) picks the layers
that become SWA; the report compares it with the fixed 1:1 interleave of full and SWA layers
(`interleave_pattern`) and finds it far better at long context (e.g. at 128K, without training: 1:1 SWA 6.51 vs
searched SWA 53.95, full 75.28). The report does not give the scoring data or the exact round rule; ours is below.

Algorithm (`search_swa`), L = num_hidden_layers, n* = ceil(target_fraction * L) SWA layers:
  beam_0 = [all layers "attention"]
  round r: for each pattern P in the beam, with F = its remaining full layers, each candidate
    switches k = min(per_round, n* - |SWA(P)|) more layers of F to "swa": all C(|F|, k)
    combinations, or `max_candidates` of them sampled deterministically (seeded by `seed` and
    P) when there are more. Candidates whose config is invalid (a "shared" DSA layer left
    "full" with no earlier full layer that selects keys; see `ModelConfig._check_dsa`) are
    skipped, not scored. Each distinct candidate is scored once: score_fn(model with that
    pattern), higher is better; scores are cached by pattern, so a pattern reached from two
    beam entries costs one evaluation. The next beam = the `beam` best distinct candidates
    (ties: the lexicographically smallest tuple of SWA layer indices first).
  stop when every beam pattern has n* SWA layers; the answer is the best of the last beam.
Cost: one extra evaluation of the all-full model (`full_score`), then per round at most
beam * C(|F|, k) evaluations (or beam * max_candidates), fewer after de-duplication; rounds =
ceil(n* / per_round). With beam=1, per_round=1 it is greedy: sum_{j=0}^{n*-1} (L - j) + 1.
Each evaluation is one `score_fn` call on a model that shares the weights of `model` (no copy).

Units: `window` in tokens (keys per query on an SWA layer, `ModelConfig.sliding_window`); `target_fraction` a
fraction of main layers; scores in the scorer's units (accuracy in [0, 1] for `mqar_scorer` / `niah_scorer`, minus
nats/token for `loss_scorer`). The scoring context should be longer than `window`, or SWA changes nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from glm5lab.config import ConfigError
from glm5lab.evals.mqar import make_mqar_batch, mqar_accuracy
from glm5lab.evals.niah import make_niah_batch, training_pair
from glm5lab.data.batches import token_ids
from glm5lab.evals.tasks import IGNORE_INDEX, TaskVocab
from glm5lab.evals.variants import mean_nll, model_variant
from glm5lab.validate import fraction, int_at_least

Pattern = tuple[int, ...]  # sorted indices of the "swa" layers


@dataclass
class SWASearchResult:
    """mixer_types: the best pattern (one "attention"/"swa" per main layer); swa_layers: its SWA layer
    indices, increasing; score: its score_fn value. full_score: score of the all-full model.
    history[r]: the beam after round r, best first, as (mixer_types, score) pairs.
    evaluations: score_fn calls made (distinct valid patterns scored, the all-full one included).
    skipped_invalid: distinct candidate patterns skipped because their config is invalid."""

    mixer_types: list[str]
    swa_layers: tuple[int, ...]
    score: float
    window: int
    full_score: float
    history: list[list[tuple[list[str], float]]] = field(default_factory=list)
    evaluations: int = 0
    skipped_invalid: int = 0


def interleave_pattern(num_layers: int, every: int = 2) -> list[str]:
    """The fixed SWA interleave baseline: layer i is "attention" when i % every == every - 1, else "swa" (every=2:
    swa, full, swa, full, ... = the report's 1:1 interleave; the last layer of each group of `every` keeps full
    attention). Raises ValueError naming the argument if num_layers < 1 or every < 1 (every=1: all full)."""
    num_layers, every = int_at_least("num_layers", num_layers, 1), int_at_least("every", every, 1)
    return ["attention" if i % every == every - 1 else "swa" for i in range(num_layers)]


def with_mixers(model, mixer_types: Sequence[str], window: int | None):
    """`model_variant` with mixer_types = mixer_types and sliding_window = window (weights shared).
    Raises ConfigError (a ValueError) if the pattern is not a valid config."""
    return model_variant(model, mixer_types=list(mixer_types), sliding_window=window)


def search_swa(model, score_fn: Callable[[object], float], *, window: int, target_fraction: float = 0.5,
               beam: int = 8, per_round: int = 2, max_candidates: int | None = None,
               seed: int = 0) -> SWASearchResult:
    """Beam search for the layers to switch to `window`-token SWA (see the module docstring).

    model: a GLM5ForCausalLM (its own mixer_types are ignored: the search starts from all full).
    score_fn(model_with_pattern) -> float, higher is better (`loss_scorer`, `mqar_scorer`, `niah_scorer`, or
    your own). Returns a `SWASearchResult`. Raises ValueError naming the argument when: window < 1;
    target_fraction not in (0, 1]; beam < 1; per_round < 1; max_candidates not None and < 1; seed < 0;
    score_fn returns a non-finite or non-numeric value; no candidate of a round is a valid config.
    """
    window = int_at_least("window", window, 1)
    target_fraction = fraction("target_fraction", target_fraction)
    beam, per_round = int_at_least("beam", beam, 1), int_at_least("per_round", per_round, 1)
    if max_candidates is not None:
        max_candidates = int_at_least("max_candidates", max_candidates, 1)
    seed = int_at_least("seed", seed, 0)
    L = model.config.num_hidden_layers
    n_target = max(1, math.ceil(target_fraction * L - 1e-9))
    cache: dict[Pattern, float | None] = {}  # None = invalid config
    counts = {"evaluations": 0, "invalid": 0}

    def score(p: Pattern) -> float | None:
        if p not in cache:
            mixers = _mixers(L, p)
            try:
                m = with_mixers(model, mixers, window if p else None)
            except ConfigError:
                cache[p] = None
                counts["invalid"] += 1
                return None
            value = score_fn(m)
            try:
                finite = math.isfinite(float(value))
            except (TypeError, ValueError):
                finite = False
            if not finite:
                raise ValueError(f"score_fn returned {value!r} for mixer_types={mixers}: it must return a "
                                 "finite number")
            counts["evaluations"] += 1
            cache[p] = float(value)
        return cache[p]

    full_score = score(())
    current: list[Pattern] = [()]
    history: list[list[tuple[list[str], float]]] = []
    while len(current[0]) < n_target:
        scored: dict[Pattern, float] = {}
        for p in current:
            k = min(per_round, n_target - len(p))
            for cand in _candidates(L, p, k, max_candidates, seed):
                s = score(cand)
                if s is not None:
                    scored[cand] = s
        if not scored:
            raise ValueError(f"per_round = {per_round}: no candidate of round {len(history) + 1} is a valid config "
                             "(every one leaves a 'shared' DSA layer full with no earlier selecting layer); "
                             "try a larger per_round or max_candidates")
        current = sorted(scored, key=lambda c: (-scored[c], c))[:beam]
        history.append([(_mixers(L, c), scored[c]) for c in current])
    best = current[0]
    return SWASearchResult(_mixers(L, best), best, cache[best], window, full_score, history,
                           counts["evaluations"], counts["invalid"])


def _mixers(L: int, p: Pattern) -> list[str]:
    s = set(p)
    return ["swa" if i in s else "attention" for i in range(L)]


def _candidates(L: int, p: Pattern, k: int, max_candidates: int | None, seed: int) -> list[Pattern]:
    full = [i for i in range(L) if i not in p]
    combos = list(itertools.combinations(full, k))
    if max_candidates is not None and len(combos) > max_candidates:
        digest = hashlib.sha256(f"glm5lab-search-swa:{seed}:{p}:{k}".encode()).digest()
        g = random.Random(int.from_bytes(digest[:8], "big"))
        combos = [combos[i] for i in sorted(g.sample(range(len(combos)), max_candidates))]
    return [tuple(sorted(p + c)) for c in combos]


# --- ready-made scorers ---------------------------------------------------------------------------

def loss_scorer(ids) -> Callable[[object], float]:
    """score_fn = minus the mean next-token NLL (nats/token) of the model on `ids` (int64 [T] or
    [B, T], T >= 2, one forward over the whole sequence, fp32 log-probs). Make T > window. Raises ValueError
    if ids is not 1-D / 2-D integers >= 0 or T < 2 (ids >= vocab_size are caught when scoring)."""
    x = torch.as_tensor(ids)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.dtype.is_floating_point or x.dtype == torch.bool or x.shape[1] < 2:
        raise ValueError(f"ids must be int64 [T] or [B, T] with T >= 2, got shape {tuple(x.shape)} {x.dtype}")
    if int(x.min()) < 0:
        raise ValueError("ids has negative token ids")
    x = x.long()

    def score(model) -> float:
        token_ids("ids", x.flatten(), model.config.vocab_size)
        return -mean_nll(model, x.to(next(model.parameters()).device))

    return score


def mqar_scorer(vocab: TaskVocab, n: int, seq_len: int, num_kv_pairs: int, num_queries: int | None = None, *,
                seed: int = 0) -> Callable[[object], float]:
    """score_fn = teacher-forced MQAR accuracy (`mqar_accuracy`: argmax at the query positions) on
    a fixed `make_mqar_batch(vocab, n, seq_len, num_kv_pairs, num_queries, seed=seed)`, in [0, 1].
    The batch is drawn once, so every pattern sees the same data. Raises as `make_mqar_batch`."""
    return _accuracy_scorer(*make_mqar_batch(vocab, n, seq_len, num_kv_pairs, num_queries, seed=seed))


def niah_scorer(vocab: TaskVocab, n: int, context_length: int, variant: str = "single", *, seed: int = 0,
                **kwargs) -> Callable[[object], float]:
    """score_fn = teacher-forced NIAH token accuracy on a fixed `make_niah_batch(vocab, n,
    context_length, variant, seed=seed, **kwargs)`: the fraction of completion tokens (answer
    values and their end markers, `training_pair` labels != -100) whose argmax prediction given
    the prompt and the true earlier completion tokens is right, in [0, 1]. Cheap stand-in for
    generation + `score_niah` (one forward, no decoding). Raises as `make_niah_batch`."""
    pairs = [training_pair(e) for e in make_niah_batch(vocab, n, context_length, variant, seed=seed, **kwargs)]
    x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    assert bool((y != IGNORE_INDEX).any())
    return _accuracy_scorer(x, y)


def _accuracy_scorer(x_BT: torch.Tensor, labels_BT: torch.Tensor) -> Callable[[object], float]:
    """score_fn = `mqar_accuracy` (teacher-forced argmax accuracy at the labels != -100) of the model's logits
    on inputs x_BT (int64 [B, T]) against labels_BT (int64 [B, T], already shifted)."""

    @torch.no_grad()
    def score(model) -> float:
        d = next(model.parameters()).device
        return mqar_accuracy(model(x_BT.to(d)).logits, labels_BT.to(d))

    return score
