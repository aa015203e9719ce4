"""Training-aware IndexCache: multi-layer distillation of a kept indexer (IndexCache, Bai et al. 2026, section 4).

With IndexCache some DSA layers keep their indexer ("own") and the "shared" layers after one reuse its top-k. The
usual indexer loss (DeepSeek-V3.2 section 2.1, `MLAttention.indexer_kl`) trains an own layer's indexer towards its
own layer's attention p_own only: indexer_target "own", what public trainers do. Multi-layer distillation
(indexer_target "served") trains it towards every layer it serves: the own layer g and the shared layers after
it, S(g), |S(g)| = n_g. The paper's loss sums KL(p_l || q_g) over l in S(g); its gradient in q_g (the indexer's
softmax) is that of n_g KL(pbar_g || q_g), pbar_g = (1/n_g) sum_l p_l, since the p log p terms do not depend on
the indexer (the paper's reduction). Here each served layer returns KL(p_l || q_g) and `distill_loss` weights
them 1/n_g per group and averages over groups, so the gradient is the mean over own layers of
grad KL(pbar_g || q_g); its value is mean_g KL(pbar_g || q_g) plus mean_g (1/n_g) sum_l KL(p_l || pbar_g) (the
served layers' spread, >= 0, constant in the indexer). With every layer own, both targets give the same loss.

The own layer hands its index scores on with its top-k (`Teacher`, returned like `TopK`, never stored: a block
returns what later layers read), so the shared layers' KL flows back to the own layer's indexer; p_l is
computed without gradient, on the same keys as the own layer's KL (all causal keys in the dense warm-up, the
selected ones in sparse adaptation). One process, no context parallelism (`check_served`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from glm5lab.model.topk import TopK


class Teacher(NamedTuple):
    """What an own DSA layer hands on under indexer_target "served": its selection (None when DSA is off, the
    warm-up) and its index scores with their gradient, fp32 [B, T, K] at topk's keys (sparse) or [B, T, S]
    (dense: -inf after each query); the shared layers score their attention on the same keys
    (`MLAttention.attention_target`)."""

    topk: TopK | None
    scores: torch.Tensor


def selection(handoff) -> TopK | None:
    """The top-k in what the previous layers handed on (a `TopK`, a `Teacher` or None)."""
    return handoff.topk if isinstance(handoff, Teacher) else handoff


def distill_loss(kls: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Mean over groups of the mean KL of each group's layers: kls, in layer order, (role, KL) with role "own"
    (opens a group) or "shared" (joins the last one). Raises ValueError for a shared KL before any own one."""
    groups: list[list[torch.Tensor]] = []
    for role, kl in kls:
        if role == "own":
            groups.append([kl])
        elif not groups:
            raise ValueError("a 'shared' layer's indexer KL came before any 'own' layer's")
        else:
            groups[-1].append(kl)
    return torch.stack([torch.stack(g).mean() for g in groups]).mean()


def check_served(indexer_target: str, context_parallel) -> None:
    """Refuse indexer_target "served" under context parallelism (not implemented: the scores handed on are
    this rank's queries only, which is right, but untested)."""
    if indexer_target == "served" and context_parallel is not None:
        raise ValueError("indexer_target = 'served' (multi-layer distillation) is not available with context "
                         "parallelism: train it with --cp 1")
