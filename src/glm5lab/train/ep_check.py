"""The expert-parallel check run (`tests/train/test_expert_parallel.py` holds N processes equal to one,
`benchmarks/expert_parallel.py` times it): a tiny seeded MoE model trained by `run_stages`, in one process or on
every rank of a process group, each rank on its contiguous slice of the same global batch. The step: DSA on,
indexer KL weight 1, MTP, Muon Split at lr 3e-3, router bias rate 1e-2 (`HYPER`, `LR`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.parallel.dist import DistContext, shard_model
from glm5lab.train.balance import moe_layers
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from glm5lab.train.recipe import TrainHyper
from glm5lab.train.step import StepDone, run_stages

HYPER = TrainHyper.default(optimizer="muon-split", bias_update_rate=1e-2)
LR = 3e-3


def ep_check_model(ctx: DistContext, ep: int, overrides: dict | None = None, skew: float = 0.0) -> GLM5ForCausalLM:
    """The `tiny` preset at vocab 320 with `overrides`, seed 0 (the same weights on every rank), in training mode and
    sharded (`shard_model(model, ctx, ep=ep)`). skew: the router bias of experts 0 and 1 (EP rank 0); 5 sends them
    every row. Raises ValueError for an `ep` that `check_ep` refuses."""
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", **{"vocab_size": 320, **(overrides or {})}))
    for name, buf in model.named_buffers():
        if skew and name.endswith("e_score_correction_bias"):
            buf[:2] = skew
    model.train()
    return shard_model(model, ctx, ep=ep)


def train_ep_check(model, ctx: DistContext, windows: list[torch.Tensor],
                   on_step: Callable[[StepDone, torch.Tensor], None], optimizer=None):
    """One `run_stages` step per global batch in `windows` (each int64 [B, T + 1], B a multiple of the world size;
    B may change from one to the next), this rank training rows [rank * b, (rank + 1) * b), b = B / world size.
    After each step on_step(done, load_E): this rank's rows per routed expert, int64 [E], summed over the step's
    MoE forwards. optimizer: `HYPER.build_optimizer(model, LR)` by default; pass it back to go on training.
    Returns the optimizer."""
    optimizer = HYPER.build_optimizer(model, LR) if optimizer is None else optimizer
    T, loads = windows[0].shape[1] - 1, []

    def rows(_index, _stage, i):
        b = windows[i].shape[0] // ctx.world_size
        return windows[i][ctx.rank * b:(ctx.rank + 1) * b]

    def losses(batch, stage):
        out = stage_losses(model, batch, stage)
        loads.append(sum(moe.load for _, moe in moe_layers(model)))  # this rank's, before the router update
        return out

    stage = Stage("ep", len(windows), LR, T, windows[0].shape[0] // ctx.world_size, use_dsa=True, indexer_weight=1.0)
    run_stages(model, [stage], rows, HYPER, lambda done: on_step(done, loads.pop()), losses=losses,
               optimizer=optimizer)
    return optimizer
