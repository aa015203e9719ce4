"""`glm5lab train --tensorboard`: the scalars of `metrics.jsonl` as a TensorBoard log in the run folder's `tb/`.

One tag per quantity. Each metrics record becomes scalars at its global step, tagged by its `metrics.jsonl` key:
numbers as they are (lm_loss, indexer_kl, lr, tokens, tokens_per_s, step_time_s, ep_imbalance, a2a_bytes,
val_loss, val_tokens); the stage's objective, `loss`, whose meaning changes with the stage (LM + MTP in a dense
stage, the indexer KL alone in the warm-up: 1e1 against 1e-5), and the gradient norm, `grad_norm`, of what the
stage trains (the whole model, the indexer alone in the warm-up: ~2 against ~3e-4), one tag per stage each,
`loss/<stage>` and `grad_norm/<stage>` (`PER_STAGE`); lists element by
element (`mtp_losses/1` is MTP depth 1, `ep_tokens/0` EP index 0); the expert loads (tokens per expert, per MoE
layer) as each layer's busiest expert over the mean (`expert_load/max_over_mean/layer{i}`, 1.0 = balanced) and the
worst layer's (`expert_load/max_over_mean`). `val_loss` is the periodic validation, a subset of the held-out split;
the final evaluation of the whole split (summary.json's val_loss, val_perplexity, val_bits_per_byte) is logged at
the last step as `final/val_loss`, `final/val_perplexity`, `final/val_bits_per_byte`.
Written by the main rank only, as `metrics.jsonl`. A resumed run continues the same log: events past the
resumed step (written before the stop, trained again now) are dropped (`SummaryWriter(purge_step=)`), as
`metrics.jsonl` drops its lines past that step.
Source: torch.utils.tensorboard.SummaryWriter (`add_scalar`, `purge_step`).
"""

from __future__ import annotations

from pathlib import Path


def check_available() -> None:
    """Raise ValueError (one line, naming the install command) when the `tensorboard` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard "
                         "(or bash scripts/setup.sh again)") from None


PER_STAGE = ("loss", "grad_norm")
"""The keys whose quantity changes with the stage, logged as `<key>/<stage>`."""

FINAL = ("val_loss", "val_perplexity", "val_bits_per_byte")
"""The whole-split figures of summary.json logged at the last step, as `final/<key>`."""


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of one metrics record (module docstring); None values, the step, and strings
    (the stage name) are left out."""
    out = {}
    for key, value in record.items():
        if key in ("step", "stage_step") or value is None or isinstance(value, (str, bool)):
            continue
        if key in PER_STAGE:  # another quantity in each stage
            out[f"{key}/{record['stage']}"] = float(value)
        elif key == "expert_load":
            out.update(_expert_load(value))
        elif isinstance(value, list):
            first = 1 if key == "mtp_losses" else 0  # depths count from 1
            out.update({f"{key}/{i + first}": float(v) for i, v in enumerate(value) if v is not None})
        else:
            out[key] = float(value)
    return out


def _expert_load(loads: list[list[int]]) -> dict[str, float]:
    ratios = [max(layer) / (sum(layer) / len(layer)) for layer in loads if layer and sum(layer)]
    out = {f"expert_load/max_over_mean/layer{i}": r for i, r in enumerate(ratios)}
    if ratios:
        out["expert_load/max_over_mean"] = max(ratios)
    return out


class TensorBoardLog:
    """`SummaryWriter` on `folder` (created); `resume_step`: the step a resumed run continues after
    (its later events are purged), None for a new run."""

    def __init__(self, folder: Path, resume_step: int | None = None):
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def write_final(self, summary: dict) -> None:
        """The final evaluation of the whole held-out split (summary.json's `FINAL` figures), at the last step."""
        for key in FINAL:
            if summary.get(key) is not None:
                self.writer.add_scalar(f"final/{key}", float(summary[key]), summary["steps"])

    def close(self) -> None:
        self.writer.close()
