"""A run in memory: train a model through a list of `Stage`s on a batch function.

The same step as `glm5lab train` (`glm5lab.train.loop`): the stage's losses (`task_losses`: CE,
MTP depths, indexer KL), backward, non-finite check and clipping, Muon/AdamW step, aux-loss-free
router bias update, but no run folder, checkpoints or corpus handling: studies train many small
variants and keep only their numbers.
"""

from __future__ import annotations

import time

import torch

from glm5lab.ablate.workbench import BatchFn
from glm5lab.optim import build_optimizer
from glm5lab.train.loop import optimizer_step, set_trainable
from glm5lab.train.losses import task_losses
from glm5lab.train.stages import Stage


def fit(model, stages: list[Stage], batches: BatchFn, *, optimizer: str = "muon-split", seed: int = 0,
        weight_decay: float = 0.1, grad_clip: float = 1.0, bias_update_rate: float = 1e-3) -> list[dict]:
    """Train `model` in place through `stages`; returns one record per step (stage, step, the
    losses of `StepLosses.to_log`, lr, seconds). Seeds torch with `seed` first (dropout-free
    models: the batches fix everything else). Raises TrainingDiverged (glm5lab.train.loop) on a
    non-finite loss or gradient, ValueError for an unknown optimizer. Batches are moved to the
    model's device."""
    torch.manual_seed(seed)
    model.train()
    opt = build_optimizer(model, optimizer, lr=stages[0].lr, weight_decay=weight_decay)
    records, step = [], 0
    device = next(model.parameters()).device
    for si, stage in enumerate(stages):
        set_trainable(model, stage)
        for i in range(stage.steps):
            t0 = time.perf_counter()
            lr = stage.lr_at(i)
            for group in opt.param_groups:
                group["lr"] = lr
            ids_BT, labels_BT = (t.to(device) for t in batches(si, stage, i))
            losses = task_losses(model, ids_BT, labels_BT, stage)
            step += 1
            optimizer_step(model, opt, losses, stage, step, grad_clip, bias_update_rate)
            records.append({"stage": stage.name, "step": step, **losses.to_log(), "lr": lr,
                            "seconds": time.perf_counter() - t0})
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return records
