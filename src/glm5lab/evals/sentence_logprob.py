"""Whole-sequence log-probabilities of a causal LM, batched: the scorer behind `glm5lab eval blimp`.

Legend: B sequences per batch, T the longest sequence of the batch (prefix token included), V vocabulary.
A sequence is [prefix, x_1, ..., x_n]: its score is sum_{t=1..n} log p(x_t | prefix, x_1..x_{t-1}) in nats, so
the first real token is scored too, given the prefix (the model's start-of-text token). One code path serves any
model: `logits_fn(ids_BT, mask_BT) -> logits_BTV` is all it needs (a glm5lab model, a transformers causal LM).

Batches are right-padded (pad id 0, mask 0) after sorting by length (longest first: the first batch shows the
peak memory), so a causal model's logits at real positions never see the padding; the mask is passed on for
models that take one and zeroes the padded targets' terms. Log-softmax in fp32, sums in fp64.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def sequence_logprobs(logits_fn: LogitsFn, seqs: Sequence[Sequence[int]], *, batch_size: int = 32,
                      device="cpu", on_batch: Callable[[int], None] | None = None) -> list[float]:
    """Total log-probability (nats) of tokens 1.. of each sequence given those before (token 0 is the prefix,
    not scored), in the order given. on_batch(n) is called after each batch of n sequences (a progress bar).

    Raises ValueError when a sequence has fewer than 2 tokens or batch_size < 1."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size} is not allowed: at least 1")
    short = [i for i, s in enumerate(seqs) if len(s) < 2]
    if short:
        raise ValueError(f"sequence {short[0]} has {len(seqs[short[0]])} tokens: at least 2 (prefix + one token)")
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out = [0.0] * len(seqs)
    for begin in range(0, len(order), batch_size):
        rows = order[begin:begin + batch_size]
        ids_BT, mask_BT = _pad([seqs[i] for i in rows], device)
        for i, lp in zip(rows, batch_logprobs(logits_fn(ids_BT, mask_BT), ids_BT, mask_BT).tolist()):
            out[i] = lp
        if on_batch is not None:
            on_batch(len(rows))
    return out


def batch_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] fp64: sum over t >= 1 of log_softmax(logits[b, t-1])[ids[b, t]] where mask[b, t] = 1."""
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1)
    target_BT = ids_BT[:, 1:]
    picked_BT = logp_BTV.gather(-1, target_BT.unsqueeze(-1)).squeeze(-1).double()
    return (picked_BT * mask_BT[:, 1:].double()).sum(dim=1)


def _pad(seqs: list[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded int64 ids [B, T] (pad 0) and their 0/1 int64 mask."""
    width = max(len(s) for s in seqs)
    ids_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    mask_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BT[b, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask_BT[b, :len(s)] = 1
    return ids_BT.to(device), mask_BT.to(device)
