"""The report's PNGs, each from the run's own numbers (matplotlib, headless). Every function takes the data
and the PNG path and returns the path, or None when there is nothing to plot. Every time plot marks the stage
boundaries (`glm5lab.train.plot.mark_stages`) and uses one colour per quantity (`glm5lab.train.plot`: LM blue,
MTP orange, indexer KL red, validation subset black dots, whole-split final figure a green diamond)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, NullLocator

from glm5lab.ablate.results import figure, save_png
from glm5lab.report.series import BALANCED, perplexity
from glm5lab.train.balance import DEAD_WINDOW, balance_metrics, max_mean
from glm5lab.train.plot import (LM, VAL, WHOLE, beside, draw_kl, draw_lm, draw_losses, mark_stages, mtp_mean,
                                smoothed, smoothing_steps, stage_mean, stage_spans, subset_label, whole_label)


def loss_by_stage(metrics: list[dict], path: Path, summary: dict | None = None) -> Path:
    """Top: the whole run (`draw_losses`, as loss.png). Below: one panel per stage on its own scale, its
    objective on the left axis: LM loss (faint per step, solid trailing mean), MTP mean, validation subset
    dots (the whole-split final figure in the last panel), the indexer KL on the right; for a stage without LM
    objective (summary.json's `reported` is indexer_kl, the indexer warm-up) the KL on the left and the LM
    loss it still logs on the right. One legend below all panels."""
    plt = figure()
    summary = summary or {}
    reported = {st["stage"]: st.get("reported") for st in summary.get("stages", [])}
    spans = stage_spans(metrics)
    fig = plt.figure(figsize=(max(9.0, 4.6 * len(spans)), 8.2))
    grid = fig.add_gridspec(2, len(spans), height_ratios=[1.15, 1])
    top = fig.add_subplot(grid[0, :])
    handles, labels = draw_losses(top, metrics, summary, title="the whole run (dotted lines: stage boundaries)")
    k = smoothing_steps(len(metrics))
    for i, (stage, a, b) in enumerate(spans):
        rows = [r for r in metrics if a <= r["step"] <= b]
        kl_objective = reported.get(stage) == "indexer_kl" or all(r.get("lm_loss") is None for r in rows)
        _stage_panel(fig.add_subplot(grid[1, i]), rows, k, summary if i == len(spans) - 1 else {}, kl_objective)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    return save_png(fig, path, layout=False, tight=True)


def _stage_panel(ax, rows: list[dict], k: int, summary: dict, kl_objective: bool) -> None:
    lm_ax = ax.twinx() if kl_objective else ax
    draw_lm(lm_ax, rows, summary, k, mtp=not kl_objective)
    ax.set(xlabel="step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    ax.grid(alpha=0.3)
    if kl_objective:
        draw_kl(ax, rows, "indexer KL (nats): the stage objective", width=1.2)
        lm_ax.set_ylabel("LM cross-entropy (nats/token): logged, not trained", color=LM)
        ax.set_title(f"{rows[0]['stage']}: objective indexer KL", fontsize=10)
        return
    has_kl = any(r.get("indexer_kl") is not None for r in rows)
    ax.set_ylabel("cross-entropy (nats/token)", color=LM)
    plus_mtp = " + MTP" if mtp_mean(rows)[1] else ""
    ax.set_title(f"{rows[0]['stage']}: objective LM loss{plus_mtp}" + (" + indexer KL" if has_kl else ""), fontsize=10)
    if has_kl:
        draw_kl(ax.twinx(), rows)


def expert_load(metrics: list[dict], path: Path, names: list[str] | None = None) -> Path | None:
    """Load balance over time, per MoE layer, three panels sharing the step axis (`glm5lab.train.balance`): max
    expert load / mean (1.0 = perfectly balanced; the line at `series.BALANCED` the report's caption counts
    against), the coefficient of variation of the experts' loads, and the dead experts (no token in the last
    `DEAD_WINDOW` steps); stage boundaries marked."""
    rows = [r for r in metrics if r.get("expert_load")]
    if not rows:
        return None
    plt = figure()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.4), sharex=True)
    colors = plt.get_cmap("viridis")
    n, steps = len(rows[0]["expert_load"]), [r["step"] for r in rows]
    history = [r["expert_load"] for r in rows]
    per_step = [balance_metrics(history[:k + 1]) for k in range(len(history))]
    panels = (("load_max_mean", "max / mean tokens per expert"), ("load_cv", "CV of tokens per expert"),
              ("dead_experts", f"dead experts (no token in {DEAD_WINDOW} steps)"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for layer in range(n):
            name = names[layer] if names and layer < len(names) else f"MoE layer {layer}"
            ax.plot(steps, [m[key][layer] for m in per_step], linewidth=0.8, color=colors(layer / max(n - 1, 1)),
                    label=name)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="k", linewidth=0.6)
    axes[0].axhline(BALANCED, color="tab:red", linewidth=0.8, linestyle="--", label=f"{BALANCED:g}x (caption's threshold)")
    axes[0].set_ylim(bottom=0.9)
    top = max((max(m["dead_experts"]) for m in per_step), default=0)
    axes[2].set_ylim(-0.2, max(top, 1) + 0.5)
    axes[2].yaxis.get_major_locator().set_params(integer=True)
    axes[2].set_xlabel("step")
    mark_stages(axes[0], stage_spans(rows), title="expert load balance per MoE layer")
    axes[2].legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    return save_png(fig, path, tight=True)


def expert_parallel(metrics: list[dict], path: Path) -> Path | None:
    """An expert-parallel run's (`glm5lab train --ep N`) all-to-all bill beside its expert load, per step:
    left, the EP imbalance (rows the busiest EP rank received / the mean) with the worst MoE layer's expert
    imbalance; right, the bytes the all-to-alls moved per training token. None for a run without EP records."""
    rows = [r for r in metrics if r.get("ep_tokens")]
    if not rows:
        return None
    plt = figure()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    left.plot(steps, [r["ep_imbalance"] for r in rows], linewidth=0.9, label=f"EP ranks ({len(rows[0]['ep_tokens'])})")
    left.plot(steps, [max(max_mean(layer) for layer in r["expert_load"]) for r in rows], linewidth=0.8,
              color="tab:gray", label="experts (worst MoE layer)")
    left.axhline(1.0, color="k", linewidth=0.6)
    left.set(xlabel="step", ylabel="max / mean rows received")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    mark_stages(left, stage_spans(rows), title="expert-parallel load")
    right.plot(steps, [r["a2a_bytes"] / max(r.get("tokens") or 1, 1) for r in rows], linewidth=0.9, color="tab:purple")
    right.set(xlabel="step", ylabel="all-to-all bytes per training token")
    right.grid(alpha=0.3)
    mark_stages(right, stage_spans(rows), title="all-to-all bytes (dispatch + combine, forward + backward)")
    return save_png(fig, path, tight=True)


def val_perplexity(metrics: list[dict], path: Path, summary: dict | None = None) -> Path | None:
    """exp(validation-subset loss) against the step, the whole-split final perplexity beside it
    (a diamond), stage boundaries; a log axis with plain tick labels only when the values span
    more than 4x (None without validation records)."""
    val = [r for r in metrics if r.get("val_loss") is not None]
    if not val:
        return None
    plt = figure()
    summary = summary or {}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ppl = [perplexity(r["val_loss"]) for r in val]
    ax.plot([r["step"] for r in val], ppl, "o-", color=VAL, markersize=4, label=subset_label(metrics))
    values = list(ppl)
    if summary.get("val_perplexity") is not None and math.isfinite(summary["val_perplexity"]):
        ax.plot([metrics[-1]["step"]], [summary["val_perplexity"]], "D", color=WHOLE, markeredgecolor="k",
                markersize=6, transform=beside(ax), label=whole_label(summary), zorder=5)
        values.append(summary["val_perplexity"])
    finite = [v for v in values if math.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) > 4:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator(plain_log_ticks(min(finite), max(finite))))
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="step", ylabel="perplexity (exp of nats/token)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    mark_stages(ax, stage_spans(metrics), title="validation perplexity")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    return save_png(fig, path, tight=True)


def plain_log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis over [lo, hi]: 1-2-5 per decade, or 1-1.5-2-3-5-7 when that
    gives fewer than 4 ticks in range (plus one either side, so the data lie inside)."""
    for subs in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                 for m in subs]
        inside = [t for t in ticks if lo <= t <= hi]
        if len(inside) >= 4:
            break
    below = [t for t in ticks if t < lo][-1:]
    above = [t for t in ticks if t > hi][:1]
    return below + inside + above


def compare(runs: list[tuple[str, list[dict], dict]], path: Path) -> Path:
    """Runs overlaid on one axes, one colour per run (the first is the report's run): train LM
    loss as a trailing mean, validation-subset dots, the whole-split final figure as a diamond;
    the stage boundaries, named, of the longest run (and, in its colour, of any run whose stages
    end at other steps). runs: (label, metrics rows, summary) each."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(9.5, 5))
    colors = plt.get_cmap("tab10")
    spans = [stage_spans(rows) for _, rows, _ in runs]
    ref = max(range(len(runs)), key=lambda i: len(runs[i][1]))
    for i, (label, rows, summary) in enumerate(runs):
        color = colors(i % 10)
        steps = [r["step"] for r in rows]
        k = smoothing_steps(len(rows))
        ax.plot(steps, stage_mean(rows, [r.get("lm_loss") for r in rows], k), color=color, linewidth=1.3,
                label=f"{label}: train LM loss ({smoothed(k)})")
        val = [r for r in rows if r.get("val_loss") is not None]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", color=color, markersize=4,
                markeredgecolor="k", markeredgewidth=0.4)
        if summary.get("val_loss") is not None and rows:
            ax.plot([steps[-1]], [summary["val_loss"]], "D", color=color, markeredgecolor="k", markersize=7, zorder=5,
                    transform=beside(ax))
    for i, own in enumerate(spans):
        if i != ref and [s[1:] for s in own] != [s[1:] for s in spans[ref]]:
            mark_stages(ax, own, names=False, shade=False, color=colors(i % 10))
    mark_stages(ax, spans[ref], title="runs compared")
    ax.plot([], [], "o", color="0.5", markeredgecolor="k", markeredgewidth=0.4, label="dots: validation subset")
    ax.plot([], [], "D", color="0.5", markeredgecolor="k", label="diamond: whole held-out split, final")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    return save_png(fig, path, tight=True)


def retrieval(rows: list[dict], path: Path) -> Path | None:
    """NIAH exact match (%) against context length (None when every length was skipped)."""
    done = [r for r in rows if "accuracy" in r]
    if not done:
        return None
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    lengths = [r["context_length"] for r in done]
    ax.plot(lengths, [100 * r["accuracy"] for r in done], "o-")
    ax.set(xlabel="context length (tokens)", ylabel="NIAH exact match (%)", xscale="log", ylim=(-2, 102),
           title="retrieval accuracy by context length")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)
    return save_png(fig, path, tight=True)


def acceptance(result: dict | None, path: Path, by_context: list[dict] | None = None) -> Path | None:
    """Accepted fraction per draft position (None without an MTP measurement); with `by_context` (the probe's
    "acceptance_by_context" rows) a second panel: each position's accepted fraction against context length."""
    if not result or "acceptance_rate" not in result:
        return None
    plt = figure()
    rates = result["acceptance_rate"]
    done = [r for r in by_context or [] if "acceptance_rate" in r]
    fig, axes = plt.subplots(1, 2 if done else 1, figsize=(11 if done else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    ax.bar(range(1, len(rates) + 1), rates)
    ax.set(xlabel="draft position", ylabel="accepted fraction (with all earlier drafts)", ylim=(0, 1),
           title=f"MTP acceptance: mean length {result['acceptance_length']:.2f} ({result['prompt_length']}-token "
                 "prompts)")
    ax.set_xticks(range(1, len(rates) + 1))
    ax.grid(alpha=0.3, axis="y")
    if done:
        _acceptance_by_context(axes[0][1], done)
    return save_png(fig, path, tight=True)


def _acceptance_by_context(ax, rows: list[dict]) -> None:
    """One line per draft position: accepted fraction (with all earlier drafts) against prompt length."""
    lengths = [r["context_length"] for r in rows]
    for i in range(len(rows[0]["acceptance_rate"])):
        ax.plot(lengths, [r["acceptance_rate"][i] for r in rows], "o-", label=f"draft position {i + 1}")
    ax.set(xlabel="prompt length (tokens)", ylabel="accepted fraction (with all earlier drafts)", xscale="log",
           ylim=(0, 1), title="MTP acceptance against context")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)
    ax.legend()


def two_five_labels(y: float, _pos) -> str:
    """A minor-tick formatter for log axes: label 2 and 5 x a power of ten only."""
    lead = y / 10 ** math.floor(math.log10(y)) if y > 0 else 0
    return f"{y:g}" if round(lead, 6) in (2.0, 5.0) else ""


def context_axis(ax, right: int | None = None) -> None:
    """log2 context axis labelled 512, 1K, 2K, ... (K = 1024 tokens), up to `right` when given."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context T (tokens; K = 1024)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1024:g}K" if x >= 1024 else f"{x:g}"))
    if right:
        ax.set_xlim(right=right)
    ax.grid(alpha=0.3, which="both")
