"""A run in memory: `glm5lab train`'s step (`glm5lab.train.step.run_stages`) through a list of
`Stage`s on a batch function, with no run folder, checkpoints or corpus handling: studies train
many small variants and keep only their numbers.
"""

from __future__ import annotations

import dataclasses

import torch

from glm5lab.ablate.workbench import BatchFn
from glm5lab.train.losses import task_losses
from glm5lab.train.recipe import TrainHyper, default_stages
from glm5lab.train.stages import Stage
from glm5lab.train.step import StepDone, run_stages

STUDY_HYPER = TrainHyper.default(bias_update_rate=1e-3)
"""The studies' step settings: `glm5lab train`'s (`TrainHyper`) but a router bias rate of 1e-3,
the rate the studies' published numbers were trained with. It acts on MoE layers only, and the
study models (`models.study_config`) have a dense FFN in every layer (their MTP layer too); the
studies that train the small preset's MoE (`baseline`, `optimizer`) use `glm5lab train`'s own (`TRAIN_HYPER`)."""
TRAIN_HYPER = TrainHyper.default()
"""`glm5lab train`'s step settings: those of every arm of `baseline` and `optimizer`, each with its optimizer."""


def fit(model, stages: list[Stage], batches: BatchFn, *, hyper: TrainHyper = STUDY_HYPER,
        seed: int = 0, optimizer=None, start: dict | None = None) -> list[dict]:
    """Train `model` in place through `stages` with the step settings `hyper` (optimizer, weight
    decay, clipping, router bias rate); returns one record per step (stage, step, the losses of
    `StepLosses.to_log`, lr, seconds). Seeds torch with `seed` first (dropout-free models: the
    batches fix everything else); batches (ids [B, T], labels [B, T]) are moved to the model's
    device. optimizer: default `hyper.build_optimizer` at the first stage's lr (pass one to hook or inspect
    it). start: begin there (`run_stages`'s {"step", "stage", "in_stage"}), e.g. a branch of a model trained through
    the first stages continues at the next one on the batches the whole run would have seen. Leaves every parameter trainable and the model in eval mode. Raises TrainingDiverged
    (glm5lab.train.step) on a non-finite loss or gradient, ValueError for an unknown optimizer."""
    torch.manual_seed(seed)
    model.train()
    device = next(model.parameters()).device
    records = []

    def record(done: StepDone) -> None:
        records.append({"stage": done.stage.name, "step": done.step, **done.losses.to_log(), "lr": done.lr,
                        "seconds": done.seconds})

    run_stages(model, stages, lambda *at: tuple(t.to(device) for t in batches(*at)), hyper, record,
               losses=lambda batch, stage: task_losses(model, *batch, stage), optimizer=optimizer, start=start)
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return records


def scaled(stages: list[Stage], scale: float) -> list[Stage]:
    """`stages` with every stage's steps times `scale`, rounded (at least 1), and its warm-up likewise (below
    its steps)."""
    out = []
    for st in stages:
        n = max(1, round(st.steps * scale))
        out.append(dataclasses.replace(st, steps=n, warmup_steps=min(round(st.warmup_steps * scale), n - 1)))
    return out


def glm5_stages(s: dict) -> list[Stage]:
    """`default_stages` at the size's length and batch, `scaled` so the three total about s["steps"]."""
    base = default_stages(seq_len=s["T"], batch_size=s["batch"])
    return scaled(base, s["steps"] / sum(st.steps for st in base))


def decay_stage(name: str, steps: int, lr: float, seq_len: int, batch_size: int, warmup_steps: int,
                mtp_weights: tuple[float, ...] = ()) -> Stage:
    """One stage of linear warm-up over `warmup_steps`, then a linear decay of the lr to lr / 10; LM loss (plus
    `mtp_weights`, none by default)."""
    return Stage(name, steps, lr, seq_len, batch_size, lr_end=lr / 10, warmup_steps=warmup_steps,
                 mtp_weights=mtp_weights)


def dsa_stages(s: dict, indexer_target: str = "own") -> list[Stage]:
    """The report's DSA recipe at study size `s` (T, batch, base_steps, lr, W, A, adapt_lr): dense pre-training
    (`decay_stage`, 5% warm-up), indexer warm-up (W steps, lr 5e-3 -> 2e-4 as the report, only the indexers
    train on their KL, LM weight 0, dense), sparse adaptation (A steps at constant adapt_lr, DSA on, everything
    trains, LM loss + indexer KL on the selected keys); no MTP loss. indexer_target: `Stage.indexer_target` of the
    two DSA stages ("served": IndexCache's multi-layer distillation)."""
    T, B = s["T"], s["batch"]
    return [decay_stage("dense", s["base_steps"], s["lr"], T, B, s["base_steps"] // 20),
            Stage("indexer_warmup", s["W"], 5e-3, T, B, lr_end=2e-4, trainable="indexer", lm_weight=0.0,
                  mtp_weights=(), indexer_weight=1.0, indexer_target=indexer_target),
            Stage("sparse_adaptation", s["A"], s["adapt_lr"], T, B, use_dsa=True, mtp_weights=(), indexer_weight=1.0,
                  indexer_target=indexer_target)]
