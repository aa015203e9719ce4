"""Training phases as data: one `Stage` record per phase, no `if step > ...` branches.

GLM-5 (report, DSA section) adapts a dense model late in mid-training in two stages:
(1) indexer warm-up: 1000 steps, 14 x 202752 tokens, lr 5e-3 -> 2e-4; everything but the
    indexer frozen, dense attention, loss = KL(head-summed attention || indexer softmax);
(2) sparse adaptation: 20B tokens at a constant lr 1e-5; top-k on, the whole model trains, the
    indexer keeps its KL on the selected keys with its input detached.
The default run (recipes/small.toml, `glm5lab.train.recipe.default_stages`) prepends a dense pre-training stage
and scales all three to a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from glm5lab.config import INDEXER_TARGETS
from glm5lab.validate import finite, int_at_least, one_of, refuse

TRAINABLE = ("all", "indexer")
MTP_WEIGHT = 0.3
"""Each MTP depth's loss weight when a stage (or a recipe's stage) does not set it."""
SCHEDULES = ("linear", "cosine", "wsd")
"""How a stage's lr goes from `lr` to `lr_end` after its warm-up (`Stage.lr_at`)."""


@dataclass(frozen=True)
class Stage:
    """One training phase. lr: peak; lr_end: value reached at the last step by `schedule` (None = constant after
    warm-up, linear schedule only); warmup_steps: linear ramp from 0. Loss = lm_weight * CE +
    sum_j mtp_weights[j-1] * CE_depth_j + indexer_weight * indexer KL (mean over indexer layers).
    Raises ValueError (one line naming the stage, the field, the value and what is allowed)."""

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
    mtp_weights: tuple[float, ...] = (MTP_WEIGHT,) * 3
    indexer_weight: float = 0.0
    grad_accum: int = 1
    """Micro-batches of `batch_size` sequences per optimizer step and process (gradient accumulation)."""
    decay_steps: int | None = None
    """The step count H by whose end lr reaches lr_end (from the stage's start, warm-up included); later steps hold
    lr_end. More than warmup_steps (`check_values`). None: the stage's `steps`. A run extended past its plan
    (`--resume` with more steps) sets it to the stage's former length, so the steps already trained keep their lr
    (whatever the schedule)."""
    schedule: str = "linear"
    """One of SCHEDULES (`lr_at` has the formulas): "linear" from lr to lr_end; "cosine", half a cosine period
    from lr to lr_end (torchtitan's decay_type "cosine", HF's get_cosine_schedule_with_warmup with a floor);
    "wsd", warmup-stable-decay: lr held, then linear to lr_end over the last `decay_ratio` of the H steps.
    "cosine" and "wsd" need lr_end."""
    indexer_target: str = "own"
    """With indexer_weight > 0, what each kept ("own") indexer learns: "own", its layer's attention (DeepSeek-V3.2's
    loss, what public trainers do); "served", the mean attention of the layers it serves, itself and the "shared"
    layers after it (IndexCache's training-aware multi-layer distillation: `glm5lab.model.index_distill`). The
    same loss when every DSA layer keeps its indexer."""
    decay_ratio: float | None = None
    """"wsd" only (and required there): the fraction of the H steps that decay (torchtitan's
    lr_scheduler.decay_ratio): the last D = max(1, round(decay_ratio x H)) steps, which must fit after the
    warm-up (D <= H - warmup_steps)."""

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "grad_accum"):
            int_at_least(f"stage {self.name!r}: `{name}`", getattr(self, name), 1)
        one_of(f"stage {self.name!r}: `trainable`", self.trainable, TRAINABLE)
        if self.decay_steps is not None:
            int_at_least(f"stage {self.name!r}: `decay_steps`", self.decay_steps, 1)
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"stage {self.name!r}: `warmup_steps` = {self.warmup_steps} is not allowed: 0..steps-1")
        check_stage(lambda name: f"stage {self.name!r}: `{name}`", self.to_dict())
        if self.schedule == "wsd":
            h, d = self.decay_steps or self.steps, self.wsd_decay_steps
            if d > h - self.warmup_steps:
                refuse(f"stage {self.name!r}: `decay_ratio`", self.decay_ratio,
                       f"at most {(h - self.warmup_steps) / h:.3g} here: its decay of max(1, round("
                       f"{self.decay_ratio:g} x {h})) = {d} steps must fit after the warm-up of {self.warmup_steps} "
                       f"steps (of {h})")

    @property
    def mtp_depth(self) -> int:
        return len(self.mtp_weights)

    @property
    def distills(self) -> bool:
        """Whether the stage trains indexers by multi-layer distillation: indexer_target "served" with an indexer
        loss (a "served" stage without one trains no indexer)."""
        return self.indexer_target == "served" and self.indexer_weight > 0

    @property
    def wsd_decay_steps(self) -> int | None:
        """D, the steps of a "wsd" stage's decay: max(1, round(decay_ratio x H)), H = decay_steps or steps; None
        for the other schedules."""
        if self.schedule != "wsd":
            return None
        return max(1, round(self.decay_ratio * (self.decay_steps or self.steps)))

    def lr_at(self, i: int) -> float:
        """Learning rate at step i (0-based) of this stage. W = warmup_steps, H = decay_steps or steps (H > W):
        i < W: the warm-up, lr * (i + 1) / W (its last step at lr). Then, lr_end None: lr. Else, whatever the
        schedule, lr_end is reached at step H - 1 (1-based: step H) and held after; with S = H - 1 - W and
        k = min(i - W, S):
          linear  lr + (lr_end - lr) * k / S
          cosine  lr_end + (lr - lr_end) * (1 + cos(pi * k / S)) / 2
          wsd     lr until step H - D - 1, then lr + (lr_end - lr) * k' / D with k' = min(i - (H - D - 1), D):
                  each of the last D steps below lr, the last at lr_end (D: `wsd_decay_steps`).
        Linear and cosine take lr at step W and lr_end at step H - 1; when H = W + 1 (S = 0) those are one step,
        which takes lr_end, as a WSD decay of one step does (so a 1-step stage with lr_end trains at lr_end)."""
        if i < self.warmup_steps:
            return self.lr * (i + 1) / self.warmup_steps
        if self.lr_end is None:
            return self.lr
        horizon = self.decay_steps or self.steps
        if self.schedule == "wsd":
            d = self.wsd_decay_steps
            return self.lr + (self.lr_end - self.lr) * min(max(i - (horizon - d - 1), 0), d) / d
        span = horizon - 1 - self.warmup_steps
        if span == 0:  # H = W + 1: no step between lr and lr_end
            return self.lr_end
        k = min(i - self.warmup_steps, span)
        if self.schedule == "cosine":
            return self.lr_end + (self.lr - self.lr_end) * (1 + math.cos(math.pi * k / span)) / 2
        return self.lr + (self.lr_end - self.lr) * k / span

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        d = dict(d)
        d["mtp_weights"] = tuple(d.get("mtp_weights", ()))
        return cls(**d)


STAGE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Stage) if f.default is not dataclasses.MISSING}
"""`Stage`'s defaults: the value of a stage field left out (of a recipe's stage too)."""


def check_stage(key, fields: dict) -> None:
    """The rules of a stage's values, one for a `Stage` and a recipe's stage table: `check_values`,
    `check_schedule` and `check_objective` of `fields` (a stage's fields by name, missing ones at `Stage`'s
    defaults; a recipe's `mtp_weight`, every depth's, stands for mtp_weights, an MTP weight left unset counts as
    `MTP_WEIGHT`: whether the model has an MTP layer is `check_run`'s check). key(name) names a field as in
    `check_schedule`. Raises ValueError."""
    values = {**STAGE_DEFAULTS, **fields}
    check_values(key, fields)
    check_schedule(key, values["schedule"], values["lr_end"], values["decay_ratio"])
    mtp = fields.get("mtp_weights", [fields.get("mtp_weight", MTP_WEIGHT)])
    check_objective(key, values["trainable"], values["lm_weight"], mtp, values["indexer_weight"])


LOSS_WEIGHTS = ("lm_weight", "mtp_weight", "indexer_weight")
"""A stage's loss weights besides `mtp_weights` (a recipe's `mtp_weight` is every MTP depth's)."""


def check_values(key, fields: dict) -> None:
    """Refuse stage values no run can mean, by one rule for a `Stage` and a recipe's tables (`fields`: a stage's
    fields by name, missing ones at `Stage`'s defaults; key(name) names a field as in `check_schedule`): lr not a
    finite number > 0 (inf trains NaN weights); indexer_target not one of INDEXER_TARGETS (None included); lr_end
    neither None nor a finite number >= 0; a loss weight (`LOSS_WEIGHTS`, each of `mtp_weights`; None included)
    not a finite number >= 0 (a negative weight maximises its loss);
    decay_steps not above warmup_steps (the warm-up ends at lr, and the decay reaches lr_end at step decay_steps:
    `Stage.lr_at`). Raises ValueError (`glm5lab.validate.refuse`'s form)."""
    finite(key("lr"), fields.get("lr"), positive=True)
    if "indexer_target" in fields:  # None too: it reached the forward as an unknown target
        one_of(key("indexer_target"), fields["indexer_target"], INDEXER_TARGETS)
    if fields.get("lr_end") is not None:
        finite(key("lr_end"), fields["lr_end"])
    for name in LOSS_WEIGHTS:
        if name in fields:  # None too: the loss compares it with 0
            finite(key(name), fields[name])
    weights = fields.get("mtp_weights")
    if weights is not None and not all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in weights):
        refuse(key("mtp_weights"), list(weights), "finite numbers >= 0 (one per MTP depth)")
    warmup, decay = fields.get("warmup_steps") or 0, fields.get("decay_steps")
    if decay is not None and decay <= warmup:
        refuse(key("decay_steps"), decay, f"more than warmup_steps ({warmup}): the lr reaches lr_end at step "
               "decay_steps, after the warm-up has brought it to lr")


def check_objective(key, trainable: str, lm_weight: float, mtp_weights, indexer_weight: float, *,
                    has_mtp: bool = True, runs_indexer: bool = True) -> None:
    """Refuse a stage whose loss reaches none of the parameters it trains (its first backward would fail:
    "element 0 of tensors does not require grad"). trainable = "indexer" trains the DSA indexer only, and only
    the indexer KL reaches it: dense attention does not use the indexer, sparse attention only its top-k indices,
    which carry no gradient; so it needs indexer_weight > 0. trainable = "all" needs a weight > 0: lm_weight, an
    MTP depth's (`mtp_weights`), or indexer_weight. With the model known (`glm5lab.train.plan.check_run`):
    has_mtp, whether it has an MTP layer; runs_indexer, whether it runs an indexer in this stage (without a model,
    a `Stage` or a recipe: True). key(name) names a field as in `check_schedule`. Raises ValueError."""
    if trainable == "indexer" and not indexer_weight:
        refuse(key("indexer_weight"), indexer_weight, "a number > 0 with trainable = 'indexer': only the indexer "
               "trains, and only its KL to the attention reaches it (the LM and MTP losses do not: dense attention "
               "does not use the indexer, and its top-k selection carries no gradient); as it is the stage trains "
               "nothing")
    if not (lm_weight or any(mtp_weights) or indexer_weight):
        refuse(key("lm_weight"), lm_weight, f"0 with mtp_weights {list(mtp_weights)} and indexer_weight "
               f"{indexer_weight}: the stage's loss is 0 and trains nothing; give lm_weight, an MTP depth or "
               "indexer_weight a weight > 0")
    if trainable == "indexer" and not runs_indexer:
        refuse(key("trainable"), trainable, "this model runs no DSA indexer, so the stage would train nothing; leave "
               "it out (--stages), or mark it only_with_indexer = true in its recipe")
    if trainable == "all" and not (lm_weight or (has_mtp and any(mtp_weights)) or (runs_indexer and indexer_weight)):
        missing = [what for what, on, there in (("an MTP layer", any(mtp_weights), has_mtp),
                                                ("a DSA indexer", indexer_weight, runs_indexer)) if on and not there]
        refuse(key("lm_weight"), lm_weight, f"0 when the stage's other losses need {' and '.join(missing)}, which "
               "this model does not have: the stage would train nothing; give lm_weight a weight > 0, or leave the "
               "stage out (--stages)")


def check_schedule(key, schedule, lr_end, decay_ratio) -> None:
    """Refuse schedule keys no run can mean: a schedule not in SCHEDULES, "cosine" or "wsd" without lr_end,
    "wsd" without decay_ratio, a decay_ratio beside another schedule or outside (0, 1]. key(name): how the
    caller names a field in the message (a Stage: "stage 'x': `name`"; a recipe: "recipe F: stages[0].name"), so
    a Stage and a recipe file refuse by one rule. Raises ValueError (`glm5lab.validate.refuse`'s form)."""
    one_of(key("schedule"), schedule, SCHEDULES)
    if schedule != "linear" and lr_end is None:
        refuse(key("lr_end"), lr_end, f"a number >= 0 with schedule = {schedule!r}: the lr it decays to (only the "
               "linear schedule may omit lr_end, for a constant lr after the warm-up)")
    if schedule == "wsd" and decay_ratio is None:
        refuse(key("decay_ratio"), decay_ratio, "a number in (0, 1] with schedule = 'wsd': the fraction of the "
               "stage's steps that decay (e.g. 0.2: the last fifth)")
    if schedule != "wsd" and decay_ratio is not None:
        refuse(key("decay_ratio"), decay_ratio, f"only with schedule = 'wsd' (this stage's is {schedule!r})")
    if decay_ratio is not None and (isinstance(decay_ratio, bool) or not isinstance(decay_ratio, (int, float))
                                    or not 0 < decay_ratio <= 1):
        refuse(key("decay_ratio"), decay_ratio, "a number in (0, 1]: the fraction of the stage's steps that decay")


def objective_name(stage: Stage) -> str:
    """The stage's training objective in words: LM, + MTP (weighted depths), + indexer KL."""
    parts = (["LM"] if stage.lm_weight else []) + (["MTP"] if any(stage.mtp_weights) else []) \
        + (["KL"] if stage.indexer_weight else [])
    return "+".join(parts) or "none"
