"""Figures the report derives from a run's own records (no plotting): the per-stage table, expert-load imbalance
by stage, training wall time, perplexity.
"""

from __future__ import annotations

import math
import statistics

from glm5lab.train.balance import max_mean
from glm5lab.train.plot import stage_spans

BALANCED = 2.0  # max / mean expert load under which the report calls a step balanced


def stage_rows(rec) -> tuple[list[str], list[list]]:
    """(header, rows) of the Quality section's stage table from summary.json's stages
    (`glm5lab.train.loop.stage_summary`): per stage steps, tokens, DSA, what trains, the quantity shown (the stage
    objective: LM loss, or the indexer KL of a stage without LM loss), its mean over the first / last k steps, and
    the validation-subset loss at the stage's last step (a k column when the stages' k differ)."""
    stages = rec.summary.get("stages", [])
    ks = {st["smooth_steps"] for st in stages} or {1}
    rows = []
    for st in stages:
        shown = "indexer KL (its objective)" if st["reported"] == "indexer_kl" else "LM loss"
        rows.append([st["stage"], st["steps"], f"{st['tokens']:,}", st["use_dsa"], st["trainable"], shown,
                     st["first"], st["last"], st["val_end"]] + ([st["smooth_steps"]] if len(ks) > 1 else []))
    each = "k" if len(ks) > 1 else str(ks.pop())
    header = (["stage", "steps", "tokens", "DSA", "trains", "loss shown", f"first {each} steps (mean)",
               f"last {each} steps (mean)", "validation subset at stage end"] + (["k"] if each == "k" else []))
    return header, rows


def load_stats(metrics: list[dict], share: float = 0.95) -> dict | None:
    """Expert-load imbalance of the worst MoE layer per step (max over layers of `balance.max_mean`):
    {"stages": [(stage, steps, median, fraction of steps under BALANCED, max)], "last_over": the
    last step at or above BALANCED (None: none is), "settled": the first step from which at
    least `share` of the steps are under BALANCED, "steps"}; None without expert_load records."""
    rows = [r for r in metrics if r.get("expert_load")]
    if not rows:
        return None
    worst = [(r["step"], max(max_mean(layer) for layer in r["expert_load"])) for r in rows]
    out = []
    for name, a, b in stage_spans(rows):
        w = [v for step, v in worst if a <= step <= b]
        out.append((name, len(w), statistics.median(w), sum(v < BALANCED for v in w) / len(w), max(w)))
    over = [step for step, v in worst if v >= BALANCED]
    under_from = [0] * (len(worst) + 1)  # steps under BALANCED from index i to the end
    for i in range(len(worst) - 1, -1, -1):
        under_from[i] = under_from[i + 1] + (worst[i][1] < BALANCED)
    settled = next((worst[i][0] for i in range(len(worst)) if under_from[i] >= share * (len(worst) - i)), None)
    return {"stages": out, "last_over": over[-1] if over else None, "settled": settled, "share": share,
            "steps": len(rows)}


def wall_time_s(metrics: list[dict]) -> float | None:
    """Training time: the sum of metrics.jsonl's step_time_s (excludes validation and
    checkpoints); None when no row has it."""
    times = [r["step_time_s"] for r in metrics if r.get("step_time_s") is not None]
    return sum(times) if times else None


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (a diverged run's loss)."""
    return math.exp(loss) if loss < 709 else math.inf


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
