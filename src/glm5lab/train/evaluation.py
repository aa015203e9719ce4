"""A training run's validation: mean next-token CE over packed validation windows, and the sums
behind bits per byte (`glm5lab.evals.bpb`).

Legend: N windows, L = seq_len, B = stage batch size, V vocab. A window w [L + 1] gives inputs
w[:-1] and targets w[1:]. Every rank evaluates every window it is given (no sharding of the
validation rows and so no reduction across ranks: under FSDP2 each rank must run the same
forwards anyway), so every figure is the same on every rank and for any world size. Under context
parallelism the ranks of a CP group split each window (`context_parallel=`): each scores its own
positions and the group sums the CE, so the figures still equal one process's.

The periodic validation scores a set fixed by tokens (`eval_tokens`: the first
ceil(eval_tokens / L) windows, `subset_windows`), so the same recipe scores the same targets
whatever its batch size, gradient accumulation or process count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5lab.evals.bpb import bits_per_byte, target_bytes, token_byte_lengths
from glm5lab.train.stages import Stage


@dataclass(frozen=True)
class Evaluation:
    """nll_sum: CE summed over every scored target (nats; fp32 per target, summed in fp64).
    tokens: the scored targets. utf8_bytes: the UTF-8 bytes those same targets stand for (None
    when no byte lengths were given). `loss` is nll_sum / tokens: one definition of validation
    loss for the periodic subset and the whole split alike."""

    nll_sum: float
    tokens: int
    utf8_bytes: int | None = None

    @property
    def loss(self) -> float:
        """Mean target CE, nats/token (nll_sum / tokens); NaN when nothing was scored."""
        return self.nll_sum / self.tokens if self.tokens else math.nan

    @property
    def bits_per_byte(self) -> float | None:
        """nll_sum / (ln 2 x utf8_bytes) (`glm5lab.evals.bpb.bits_per_byte`); None without byte
        lengths. Raises ValueError when the targets stand for 0 bytes."""
        return None if self.utf8_bytes is None else bits_per_byte(self.nll_sum, self.utf8_bytes)


def subset_windows(eval_tokens: int, seq_len: int) -> int:
    """Windows of `seq_len` + 1 tokens the periodic validation scores: ceil(eval_tokens / seq_len), so at least
    `eval_tokens` targets (the split may hold fewer: then every window). Independent of batch size, gradient
    accumulation and process count. Raises ValueError for eval_tokens or seq_len below 1."""
    if eval_tokens < 1 or seq_len < 1:
        raise ValueError(f"eval_tokens = {eval_tokens!r} and seq_len = {seq_len!r}: both must be integers >= 1")
    return -(-eval_tokens // seq_len)


@torch.no_grad()
def evaluate_nll(model, windows_NL1: torch.Tensor, stage: Stage, n_windows: int | None,
                 byte_lengths_V: torch.Tensor | None = None, *, context_parallel=None) -> Evaluation:
    """Next-token CE of `model` on the first n_windows validation windows (rows[: n_windows]; None = every
    window; the periodic validation passes `subset_windows(eval_tokens, seq_len)`), in batches of
    stage.batch_size (the last possibly shorter), with the stage's DSA switch. byte_lengths_V: int64 [V] UTF-8
    bytes per id (`token_byte_lengths`); the byte count covers exactly the targets the CE is taken over. Each
    batch is moved to the model's device; the model is left in train mode (eval-mode forwards count no expert
    load, so validation never steers the router bias) and, under FSDP2, resharded. context_parallel: a
    `ContextParallel` (None: the whole window here): the model returns this rank's positions' logits, their CE is
    summed over the CP group (collective: every rank of it calls this with the same windows)."""
    rows = windows_NL1 if n_windows is None else windows_NL1[:n_windows]
    device = next(model.parameters()).device
    model.eval()
    sums, targets, utf8 = [], 0, 0
    for i in range(0, len(rows), stage.batch_size):
        rows_BL1 = rows[i:i + stage.batch_size]  # read per batch: a token folder's windows are never all loaded
        batch = rows_BL1.to(device)
        labels_BL = batch[:, 1:]
        if context_parallel is None:
            logits_BLV = model(batch[:, :-1], use_dsa=stage.use_dsa).logits
        else:  # this rank's positions' logits [B, L / cp, V], scored against their labels
            logits_BLV = model(batch[:, :-1], use_dsa=stage.use_dsa, context_parallel=context_parallel).logits
            labels_BL = context_parallel.local(labels_BL)
        nll = F.cross_entropy(logits_BLV.flatten(0, 1).float(), labels_BL.flatten(), reduction="none")
        sums.append(nll.double().sum())
        targets += rows_BL1[:, 1:].numel()
        utf8 += 0 if byte_lengths_V is None else target_bytes(byte_lengths_V, rows_BL1[:, 1:])
    model.train()
    total = torch.stack(sums).sum()
    if context_parallel is not None and context_parallel.group is not None:
        torch.distributed.all_reduce(total, group=context_parallel.group)  # the group's positions: every target
    if hasattr(model, "reshard"):  # FSDP2 leaves the root unsharded after a forward without backward
        model.reshard()
    return Evaluation(float(total), targets, None if byte_lengths_V is None else utf8)


def run_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor | None:
    """`token_byte_lengths` of a run's tokenizer, or None when it is not a byte-level BPE (a
    user's --tokenizer): the run then records no bits per byte rather than failing at its end."""
    try:
        return token_byte_lengths(tokenizer, vocab_size)
    except ValueError:
        return None


def summary_fields(result: Evaluation) -> dict:
    """The validation entries of summary.json: val_loss (nats/token), val_perplexity, val_tokens
    (the targets scored) and, when the targets' bytes were counted (and are > 0),
    val_bits_per_byte with the val_bytes it was taken over. A diverged model's NaN loss is recorded as NaN (bits per byte
    too) and a loss above ~709 nats as perplexity inf, so a finished run always writes its summary."""
    finite = math.isfinite(result.nll_sum)
    out = {"val_loss": result.loss, "val_perplexity": math.exp(result.loss) if result.loss < 709.0 else math.inf,
           "val_tokens": result.tokens}
    if result.utf8_bytes:
        out.update(val_bits_per_byte=result.bits_per_byte if finite else math.nan, val_bytes=result.utf8_bytes)
    return out
