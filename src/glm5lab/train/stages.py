"""Training phases as data: one `Stage` record per phase, no `if step > ...` branches.

GLM-5 (report, DSA section) adapts a dense model late in mid-training in two stages:
(1) indexer warm-up: 1000 steps, 14 x 202752 tokens, lr 5e-3 -> 2e-4; everything but the
    indexer frozen, dense attention, loss = KL(head-summed attention || indexer softmax);
(2) sparse adaptation: 20B tokens at a constant lr 1e-5; top-k on, the whole model trains, the
    indexer keeps its KL on the selected keys with its input detached.
`default_stages` prepends a dense pre-training stage and scales all three to a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from glm5lab.validate import int_at_least, one_of

TRAINABLE = ("all", "indexer")


@dataclass(frozen=True)
class Stage:
    """One training phase. lr: peak; lr_end: value reached linearly at the last step (None =
    constant after warm-up); warmup_steps: linear ramp from 0. Loss = lm_weight * CE +
    sum_j mtp_weights[j-1] * CE_depth_j + indexer_weight * indexer KL (mean over indexer layers)."""

    name: str
    steps: int
    lr: float
    seq_len: int
    batch_size: int
    lr_end: float | None = None
    warmup_steps: int = 0
    use_dsa: bool = False
    trainable: str = "all"
    lm_weight: float = 1.0
    mtp_weights: tuple[float, ...] = (0.3, 0.3, 0.3)
    indexer_weight: float = 0.0
    grad_accum: int = 1
    """Micro-batches of `batch_size` sequences per optimizer step and process (gradient accumulation)."""
    decay_steps: int | None = None
    """Steps over which lr goes linearly to lr_end (from the stage's start, warm-up included); later steps hold
    lr_end. None: the stage's `steps`. A run extended past its plan (`--resume` with more steps) sets it to the
    stage's former length, so the steps already trained keep their lr."""

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "grad_accum"):
            int_at_least(f"stage {self.name!r}: `{name}`", getattr(self, name), 1)
        one_of(f"stage {self.name!r}: `trainable`", self.trainable, TRAINABLE)
        if not self.lr > 0 or (self.lr_end is not None and self.lr_end < 0):
            raise ValueError(f"stage {self.name!r}: lr = {self.lr!r}, lr_end = {self.lr_end!r}: lr > 0 and lr_end >= 0 required")
        if self.decay_steps is not None:
            int_at_least(f"stage {self.name!r}: `decay_steps`", self.decay_steps, 1)
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"stage {self.name!r}: `warmup_steps` = {self.warmup_steps} is not allowed: 0..steps-1")

    @property
    def mtp_depth(self) -> int:
        return len(self.mtp_weights)

    def lr_at(self, i: int) -> float:
        """Learning rate at step i (0-based) of this stage: linear warm-up from 0 to lr over warmup_steps, then
        constant (lr_end None) or linear to lr_end at step decay_steps - 1 (default steps - 1), lr_end after."""
        if i < self.warmup_steps:
            return self.lr * (i + 1) / self.warmup_steps
        if self.lr_end is None:
            return self.lr
        span = max((self.decay_steps or self.steps) - 1 - self.warmup_steps, 1)
        return self.lr + (self.lr_end - self.lr) * min(i - self.warmup_steps, span) / span

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        d = dict(d)
        d["mtp_weights"] = tuple(d.get("mtp_weights", ()))
        return cls(**d)


def default_stages(*, seq_len: int = 256, batch_size: int = 8, quick: bool = False, mtp_depth: int = 3,
                   mtp_weight: float = 0.3, use_indexer: bool = True) -> list[Stage]:
    """Dense pre-training, then (when the model has an indexer) indexer warm-up and sparse
    adaptation. The warm-up runs MTP depth 1 at weight 0 so the MTP layer's indexer is warmed up
    too. Sized so `glm5lab train` on the `small` preset takes about 12 minutes on 2 CPU
    cores (BENCHMARKS.md); `quick` is a 17-step smoke run of the same three stages (its time: `glm5lab train -h`)."""
    scale = 0.04 if quick else 1.0
    n = lambda steps: max(2, round(steps * scale))  # noqa: E731
    mtp = (mtp_weight,) * mtp_depth
    stages = [Stage("dense", n(300), 3e-3, seq_len, batch_size, lr_end=3e-4, warmup_steps=n(20) // 2, mtp_weights=mtp)]
    if use_indexer:
        stages += [
            Stage("indexer_warmup", n(40), 5e-3, seq_len, batch_size, lr_end=2e-4, trainable="indexer",
                  lm_weight=0.0, mtp_weights=(0.0,) if mtp_depth else (), indexer_weight=1.0),
            Stage("sparse_adaptation", n(80), 3e-4, seq_len, batch_size, use_dsa=True, mtp_weights=mtp,
                  indexer_weight=1.0),
        ]
    return stages
