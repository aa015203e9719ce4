"""Figures the report derives from a run's own records (no plotting): the two validation
figures, the per-stage table, expert-load imbalance by stage, training wall time.

Keeps run folders from before issue 16 working: their summary.json stages hold single steps as first/last (no
`smooth_steps`), they have no `val_subset_loss` / `val_end` and metrics.jsonl no `val_tokens`; what is missing
is computed from metrics.jsonl where it can be and otherwise said to be missing.
"""

from __future__ import annotations

import math
import statistics

from glm5lab.train.plot import stage_spans

BALANCED = 2.0  # max / mean expert load under which the report calls a step balanced


def validation(rec) -> dict:
    """{"whole": loss, "whole_tokens", "subset": loss or None, "subset_tokens", "subset_planned"
    (`_planned_subset`), "subset_step", "eval_batches", "subset_rule" (`_subset_rule`), "old": True when
    summary.json predates the subset keys}. The subset figure is summary.json's val_subset_loss, or (older runs)
    the last periodic val_loss when it was taken at the last step."""
    s, args = rec.summary, rec.run.get("args", {})
    val_rows = [r for r in rec.metrics if r.get("val_loss") is not None]
    last = val_rows[-1] if val_rows else None
    subset = s.get("val_subset_loss")
    old = subset is None and bool(val_rows)
    if old and last["step"] == s.get("steps", last["step"]):
        subset = last["val_loss"]
    return {"whole": s.get("val_loss"), "whole_tokens": s.get("val_tokens"), "subset": subset,
            "subset_tokens": s.get("val_subset_tokens") or (last or {}).get("val_tokens"),
            "subset_planned": _planned_subset(rec), "subset_step": last["step"] if last else None,
            "eval_batches": args.get("eval_batches"), "subset_rule": _subset_rule(args), "old": old}


def _subset_rule(args: dict) -> str:
    """How run.json's arguments define the periodic subset, in words: `eval_tokens N` (runs since issue 36), or
    `N batches of windows` (older runs' eval_batches, a count that depended on the batch layout)."""
    if args.get("eval_tokens"):
        return f"eval_tokens {args['eval_tokens']:,}"
    return f"{args['eval_batches']} batches of windows" if args.get("eval_batches") else "eval_batches batches"


def _planned_subset(rec) -> int | None:
    """Targets in the subset as run.json plans it, for runs that did not record it (the split may hold fewer):
    ceil(eval_tokens / seq_len) windows of the last stage's seq_len, or for older runs eval_batches x the last
    stage's batch size x world size x seq_len."""
    args, stages = rec.run.get("args", {}), rec.run.get("stages") or [{}]
    seq_len = stages[-1].get("seq_len")
    if args.get("eval_tokens") and seq_len:
        return -(-args["eval_tokens"] // seq_len) * seq_len
    parts = (args.get("eval_batches"), stages[-1].get("batch_size"), seq_len)
    return None if None in parts else parts[0] * parts[1] * parts[2] * rec.run.get("world_size", 1)


def stage_rows(rec) -> tuple[list[str], list[list], str]:
    """(header, rows, note) of the Quality section's stage table: per stage steps, tokens, DSA, what trains,
    the quantity shown (the stage objective: LM loss, or the indexer KL of a stage without LM loss), its mean
    over the first / last k steps, and the validation-subset loss at the stage's last step. A run whose
    summary.json records single steps gets its stages summarised again from metrics.jsonl by
    `glm5lab.train.loop.stage_summary` (the definition `glm5lab train` writes), said in the note."""
    stages = rec.summary.get("stages", [])
    recorded = all("smooth_steps" in st for st in stages)
    if not recorded:
        stages = _summarised_again(rec, stages)
    ks = {st["smooth_steps"] for st in stages} or {1}
    rows = []
    for st in stages:
        shown = "indexer KL (its objective)" if st["reported"] == "indexer_kl" else "LM loss"
        rows.append([st["stage"], st["steps"], f"{st['tokens']:,}", st["use_dsa"], st["trainable"], shown,
                     st["first"], st["last"], st["val_end"]] + ([st["smooth_steps"]] if len(ks) > 1 else []))
    each = "k" if len(ks) > 1 else str(ks.pop())
    header = (["stage", "steps", "tokens", "DSA", "trains", "loss shown", f"first {each} steps (mean)",
               f"last {each} steps (mean)", "validation subset at stage end"] + (["k"] if each == "k" else []))
    note = ("" if recorded else "This run's summary.json records single steps as first/last; the means here are "
            "recomputed from metrics.jsonl as `glm5lab train` now writes them. ")
    return header, rows, note


def _summarised_again(rec, stages: list[dict]) -> list[dict]:
    """summary.json's stages of an older run, each re-summarised from its metrics.jsonl rows with
    the run.json plan (a stage the plan does not name keeps its single steps, as k = 1)."""
    from glm5lab.train.loop import stage_summary
    from glm5lab.train.stages import Stage

    plans = {d["name"]: Stage.from_dict(d) for d in rec.run.get("stages", [])}
    world = rec.run.get("world_size", 1)
    return [stage_summary(plans[st["stage"]], [r for r in rec.metrics if r["stage"] == st["stage"]], world)
            if st["stage"] in plans else {"smooth_steps": 1, "val_end": None, **st} for st in stages]


def imbalance(layer: list[int]) -> float:
    """max / mean tokens per expert of one MoE layer at one step (1.0 = balanced)."""
    return max(layer) / max(sum(layer) / len(layer), 1e-9)


def load_stats(metrics: list[dict], share: float = 0.95) -> dict | None:
    """Expert-load imbalance of the worst MoE layer per step (max over layers of `imbalance`):
    {"stages": [(stage, steps, median, fraction of steps under BALANCED, max)], "last_over": the
    last step at or above BALANCED (None: none is), "settled": the first step from which at
    least `share` of the steps are under BALANCED, "steps"}; None without expert_load records."""
    rows = [r for r in metrics if r.get("expert_load")]
    if not rows:
        return None
    worst = [(r["step"], max(imbalance(layer) for layer in r["expert_load"])) for r in rows]
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


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
