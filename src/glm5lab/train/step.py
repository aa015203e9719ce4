"""The training step that `glm5lab train` (`train.loop`: run folder, resume, metrics, progress,
summary) and `glm5lab ablate` (`ablate.fit`: one record per step) both run, and its settings.

`run_stages`: per stage, which parameters train (`set_trainable`); per step, the stage's lr (`Stage.lr_at`),
the batch, the losses, backward, the non-finite check and clipping, the optimizer step and the aux-loss-free
router bias update (`optimizer_step`); a stage's `grad_accum` micro-batches per step accumulate their gradients
first (`forward_backward`). Its settings are `glm5lab.train.recipe.TrainHyper`, the recipe's [optimizer].
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glm5lab.optim import indexer_parameter_names
from glm5lab.train.balance import update_router_bias
from glm5lab.train.losses import StepLosses
from glm5lab.train.recipe import TrainHyper
from glm5lab.train.stages import Stage


class TrainingDiverged(RuntimeError):
    """A loss or gradient became NaN/inf; the message names the step and the tensor."""


@dataclass
class StepDone:
    """A finished step, for `on_step`: stage `index`, `stage`, `i` (0-based in the stage), `step`
    (global, 1-based), lr, batch, losses, gradient norm before clipping, per-MoE-layer expert
    loads, wall seconds (from setting the lr to the router update)."""

    index: int
    stage: Stage
    i: int
    step: int
    lr: float
    batch: Any
    losses: StepLosses
    grad_norm: float
    expert_load: list[list[int]]
    seconds: float


def set_trainable(model, stage: Stage) -> None:
    """Every parameter trains (trainable="all"), or only the DSA indexer's, main layers and MTP
    layer (trainable="indexer"): the optimizer's rule table decides which those are."""
    indexer = indexer_parameter_names(model) if stage.trainable == "indexer" else set()
    for name, p in model.named_parameters():
        p.requires_grad_(stage.trainable == "all" or name in indexer)


def clip_and_check(model, losses: StepLosses, step: int, max_norm: float) -> float:
    """Clip the gradients to `max_norm` (0 = no clipping) and return their total norm before
    clipping (one pass over the gradients); raise TrainingDiverged naming the step and the first
    non-finite parameter or gradient when the loss or the norm is NaN/inf."""
    if not math.isfinite(float(losses.total.detach())):
        bad = next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)
        where = f"non-finite parameter `{bad}`" if bad else "every parameter is finite (activations overflowed)"
        raise TrainingDiverged(f"step {step}: loss is not finite ({losses.to_log()}); {where}")
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    norm = _clip_grad_norm([p for n, p in model.named_parameters() if p.grad is not None], max_norm or float("inf"))
    if not math.isfinite(norm):
        bad = next(n for n, g in grads if not torch.isfinite(g).all())
        raise TrainingDiverged(f"step {step}: non-finite gradient in `{bad}`")
    return norm


def _clip_grad_norm(params: list, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` (one process, FSDP2), or, when the gradients are DTensors on
    several meshes (expert parallelism: experts on the ("dp", "ep") mesh, the rest on the world's),
    the same clipping with the total norm combined from each mesh's norm. Returns the norm."""
    meshes = list(dict.fromkeys(getattr(p.grad, "device_mesh", None) for p in params))  # same order on every rank
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    per_mesh = [torch.nn.utils.get_total_norm([p.grad for p in params if getattr(p.grad, "device_mesh", None) == m])
                for m in meshes]  # == as dict.fromkeys above: equal meshes may be distinct objects
    total = torch.nn.utils.get_total_norm([n.full_tensor() if hasattr(n, "full_tensor") else n for n in per_mesh])
    coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))  # as clip_grads_with_norm_
    torch._foreach_mul_([p.grad for p in params], coef)
    return float(total)


def optimizer_step(model, optimizer, losses: StepLosses, stage: Stage, step: int,
                   hyper: TrainHyper, *, backward: bool = True) -> tuple[float, list[list[int]]]:
    """Backward of losses.total (unless `backward=False`: the gradients are already there, e.g. accumulated by
    `forward_backward`), the non-finite check and clipping to `hyper.grad_clip` (`clip_and_check`), the optimizer
    step, then the router bias update at `hyper.bias_update_rate` (not while only the indexer trains). Returns
    (gradient norm before clipping, expert loads)."""
    if backward:
        losses.total.backward()
    grad_norm = clip_and_check(model, losses, step, hyper.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    frozen_router = stage.trainable != "all"  # indexer warm-up: everything but the indexer stays put
    return grad_norm, update_router_bias(model, 0.0 if frozen_router else hyper.bias_update_rate)


def split_batch(batch, parts: int) -> list:
    """`batch` (a tensor [A*B, ...] or a tuple/list of such tensors, rows first) cut into `parts` micro-batches of
    B consecutive rows each (views, no copy). Raises ValueError when the rows do not divide into `parts`."""
    rows = (batch[0] if isinstance(batch, (tuple, list)) else batch).shape[0]
    if rows % parts:
        raise ValueError(f"a step batch of {rows} rows does not split into grad_accum = {parts} equal micro-batches")
    if isinstance(batch, (tuple, list)):
        return [type(batch)(chunk) for chunk in zip(*(t.chunk(parts) for t in batch), strict=True)]
    return list(batch.chunk(parts))


def mean_losses(parts: list[StepLosses]) -> StepLosses:
    """The element-wise mean of micro-batches' (detached) losses: with equal micro-batches, the losses of the whole
    step batch (each part is a mean over its tokens)."""
    mean = lambda ts: None if ts[0] is None else torch.stack([t.detach() for t in ts]).mean()  # noqa: E731
    depths = min(len(p.mtp) for p in parts)
    return StepLosses(mean([p.total for p in parts]), mean([p.lm for p in parts]),
                      [mean([p.mtp[j] for p in parts]) for j in range(depths)], mean([p.indexer for p in parts]))


def forward_backward(model, batch, stage: Stage, losses: Callable[[Any, Stage], StepLosses]) -> StepLosses:
    """Gradient accumulation: the step batch (rows [grad_accum * B, ...]) in `stage.grad_accum` micro-batches of B
    rows, each forward and backward with its loss scaled by 1 / grad_accum, so the gradients summed in `.grad` are
    those of the whole batch's mean loss. Under FSDP2 the gradient reduce-scatter runs only on the last
    micro-batch (`set_requires_gradient_sync`). MoE loads keep adding up until the router update pops them (their
    sum over micro-batches). Returns the mean of the micro-batches' losses, detached (with grad_accum = 1 exactly
    the one micro-batch's: its loss divided by 1, its mean over one)."""
    sync = getattr(model, "set_requires_gradient_sync", None)  # an FSDP2-sharded model
    parts = []
    micro = split_batch(batch, stage.grad_accum)
    for k, part in enumerate(micro):
        if sync is not None:
            sync(k == len(micro) - 1)
        step_losses = losses(part, stage)
        (step_losses.total / stage.grad_accum).backward()
        parts.append(step_losses)
    return mean_losses(parts)


def run_stages(model, stages: list[Stage], batches: Callable[[int, Stage, int], Any], hyper: TrainHyper,
               on_step: Callable[[StepDone], None], *, losses: Callable[[Any, Stage], StepLosses],
               optimizer=None, start: dict | None = None) -> None:
    """Train `model` in place through `stages`: batches(stage index, stage, i) gives step i's batch (rows
    [stage.grad_accum * B, ...]: `forward_backward` cuts it into grad_accum micro-batches of B rows), losses(batch,
    stage) a micro-batch's `StepLosses`, and on_step(StepDone) follows every step. optimizer: default
    `hyper.build_optimizer` at the first stage's lr. start: where to begin, as a checkpoint's position
    {"step": global steps done, "stage": stage index, "in_stage": steps done in it} (default the beginning; a
    stage index past the last trains nothing). Raises TrainingDiverged on a non-finite loss or gradient."""
    optimizer = hyper.build_optimizer(model, stages[0].lr) if optimizer is None else optimizer
    start = start or {"step": 0, "stage": 0, "in_stage": 0}
    step = start["step"]
    for index in range(start["stage"], len(stages)):
        stage = stages[index]
        set_trainable(model, stage)
        for i in range(start["in_stage"] if index == start["stage"] else 0, stage.steps):
            t0 = time.perf_counter()
            lr = stage.lr_at(i)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = batches(index, stage, i)
            step_losses = forward_backward(model, batch, stage, losses)
            step += 1
            grad_norm, loads = optimizer_step(model, optimizer, step_losses, stage, step, hyper, backward=False)
            on_step(StepDone(index, stage, i, step, lr, batch, step_losses, grad_norm, loads,
                             time.perf_counter() - t0))
