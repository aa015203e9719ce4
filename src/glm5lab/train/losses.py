"""Training losses on one packed window batch.

Legend: B batch, T input length, V vocab. A window w_B(T+1) gives inputs x = w[:, :T]; the main
head at position t predicts w[t+1]; MTP depth j at position t (t < T-j) predicts
x_{t+j+1} = w[t+j+1], so its labels are w[:, j+1:] (length T-j, the same as its logits): the
labels are shifted exactly once, here. Source: DeepSeek-V3 section 2.2 (MTP objective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5lab.train.stages import Stage


@dataclass
class StepLosses:
    total: torch.Tensor
    lm: torch.Tensor | None
    mtp: list[torch.Tensor]
    indexer: torch.Tensor | None

    def to_log(self) -> dict:
        item = lambda t: None if t is None else float(t.detach())  # noqa: E731
        return {"loss": item(self.total), "lm_loss": item(self.lm), "mtp_losses": [item(t) for t in self.mtp],
                "indexer_kl": item(self.indexer)}


def cross_entropy(logits_BLV: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in nats, computed in fp32."""
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), labels_BL.flatten())


def stage_losses(model, window_BT1: torch.Tensor, stage: Stage, *, context_parallel=None) -> StepLosses:
    """Forward `model` on the packed window [B, T+1] and combine the losses the stage asks for
    (context_parallel: as `task_losses`)."""
    return task_losses(model, window_BT1[:, :-1], window_BT1[:, 1:], stage, context_parallel=context_parallel)


def task_losses(model, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor, stage: Stage, *,
                context_parallel=None) -> StepLosses:
    """The stage's losses on inputs [B, T] with already-shifted labels [B, T] (int64; -100 =
    ignored, as the synthetic tasks of `glm5lab.evals` write them). The main head at t predicts
    labels[t]; MTP depth j at t predicts labels[t + j] (for a packed window exactly w[t + j + 1]).
    context_parallel: a `ContextParallel`; every rank of its group passes the whole sequences and gets its
    share of each loss (its tokens' cross-entropy summed, divided by the whole sequences' labelled tokens, times
    cp: `ContextParallel.group_mean`), so the group's mean of each loss, and of the gradients, is one process's.
    Raises ValueError if the shapes differ. A batch whose labels are all -100 gives a NaN loss."""
    if input_ids_BT.shape != labels_BT.shape:
        raise ValueError(f"input_ids {tuple(input_ids_BT.shape)} and labels {tuple(labels_BT.shape)} must have one shape")
    T = input_ids_BT.shape[1]
    out = model(input_ids_BT, mtp_depth=min(stage.mtp_depth, T - 1), use_dsa=stage.use_dsa,
                indexer_loss=stage.indexer_weight > 0, context_parallel=context_parallel,
                indexer_target=stage.indexer_target)
    total = input_ids_BT.new_zeros((), dtype=torch.float32)
    lm = _head_loss(out.logits, labels_BT, 0, context_parallel)
    if stage.lm_weight:
        total = total + stage.lm_weight * lm
    mtp = [_head_loss(logits, labels_BT, j, context_parallel) for j, logits in enumerate(out.mtp_logits, start=1)]
    for weight, loss in zip(stage.mtp_weights, mtp, strict=False):
        total = total + weight * loss
    if stage.indexer_weight and out.indexer_loss is not None:
        total = total + stage.indexer_weight * out.indexer_loss
    return StepLosses(total, lm, mtp, out.indexer_loss)


def _head_loss(logits_BLV: torch.Tensor, labels_BT: torch.Tensor, j: int, cp) -> torch.Tensor:
    """Cross-entropy of the head that predicts labels[t + j] at position t (j = 0: the main head); under CP
    the logits are this rank's first L of its tokens, and the result its share of the mean."""
    if cp is None:
        return cross_entropy(logits_BLV, labels_BT[:, j:])
    positions_L = cp.positions(labels_BT.shape[1], device=labels_BT.device)[:logits_BLV.shape[1]]
    mine_BL = labels_BT.index_select(1, positions_L + j)
    loss_sum = F.cross_entropy(logits_BLV.flatten(0, 1).float(), mine_BL.flatten(), reduction="sum")
    return cp.group_mean(loss_sum, int((labels_BT[:, j:] != -100).sum()))
