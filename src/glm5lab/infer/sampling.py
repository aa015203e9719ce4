"""Token choice: greedy, temperature, top-k, top-p (nucleus).

Legend: N rows (any leading shape), V vocab. `distribution` turns logits into the distribution a token is
drawn from: temperature 0 is greedy (a one-hot at the argmax, ties to the lowest id), otherwise softmax(logits
/ temperature) restricted to the `top_k` largest logits and then to the smallest set of most likely tokens
whose mass reaches `top_p`, renormalised. Speculative decoding draws target and draft tokens from the
distributions this function returns, so its accept rule sees exactly what plain sampling draws from. Source:
Holtzman et al. 2020 (nucleus sampling); transformers' `TopKLogitsWarper` / `TopPLogitsWarper` (same order:
temperature, top-k, top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature >= 0 (0 = greedy); top_k: None or an int in 1..vocab; top_p: None or a float
    in (0, 1]. Raises ValueError naming the field for anything else (see `check`)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self, vocab_size: int) -> Sampling:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size):
            raise ValueError(f"top_k must be None or an int in 1..vocab_size={vocab_size}, got {k!r}")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {p!r}")
        if t == 0 and (k is not None or p is not None):
            raise ValueError(f"top_k={k!r} / top_p={p!r} restrict sampling, but temperature=0 is greedy: set "
                             "temperature > 0, or drop top_k/top_p")
        return self


def distribution(logits_NV: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 probabilities [..., V] that sum to 1 per row (see module doc)."""
    logits = logits_NV.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = (logits - logits.max(-1, keepdim=True).values) / sampling.temperature  # <= 0: no overflow
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= sampling.top_p  # keeps the first token always
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs_NV: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
    """int64 [...]: one token per row of `probs_NV` (argmax when greedy, else a seeded draw).

    The draw is the exponential race: argmax_v p_v / E_v with E_v = -log(U_v), U uniform in
    [0, 1) from `generator` (a torch.Generator, a `BatchGenerator`, or None), which picks v with
    probability exactly p_v (the Gumbel-max trick in ratio form) and uses one uniform per (row,
    token): a row's draw depends only on its own numbers."""
    if sampling.greedy:
        return probs_NV.argmax(-1)
    u = uniform(tuple(probs_NV.shape), generator, probs_NV.device)
    return (probs_NV.float() / -torch.log(u)).argmax(-1)


class BatchGenerator:
    """A torch.Generator for a batch whose rows may leave it (`generate`'s finished rows). Every
    draw is made for all `batch` rows of the starting batch, then restricted to the rows still
    present (`rows`, int64 [N] indices into the starting batch; None = all), so a row receives
    the same random numbers whether finished rows are dropped (eager generate) or kept, frozen
    (compiled generate): the same seed gives the same tokens on both paths."""

    def __init__(self, generator: torch.Generator, batch: int):
        self.generator, self.batch = generator, batch
        self.rows: torch.Tensor | None = None

    def rand(self, shape: tuple[int, ...], device) -> torch.Tensor:
        """Uniform [0, 1) fp32 of `shape` = (N present rows, ...)."""
        u = torch.rand((self.batch, *shape[1:]), generator=self.generator, device=device)
        return u if self.rows is None else u[self.rows]


def uniform(shape: tuple[int, ...], generator, device) -> torch.Tensor:
    """Uniform [0, 1) fp32 of `shape` from a torch.Generator, a `BatchGenerator` or None."""
    if isinstance(generator, BatchGenerator):
        return generator.rand(shape, device)
    return torch.rand(shape, generator=generator, device=device)
