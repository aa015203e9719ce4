"""The report's PNGs, each from the run's own numbers (matplotlib, headless). Every function
takes the data and the PNG path and returns the path, or None when there is nothing to plot."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import MaxNLocator, NullLocator


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_by_stage(metrics: list[dict], path: Path) -> Path:
    """One panel per stage: LM loss (or the indexer KL for a stage without LM loss), MTP depth
    losses dashed, validation loss as dots, against the global step."""
    plt = _plt()
    stages = list(dict.fromkeys(r["stage"] for r in metrics))
    fig, axes = plt.subplots(1, len(stages), figsize=(4.5 * len(stages), 3.8), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows = [r for r in metrics if r["stage"] == stage]
        steps = [r["step"] for r in rows]
        if any(r.get("lm_loss") is not None for r in rows) and stage != "indexer_warmup":
            ax.plot(steps, [r["lm_loss"] for r in rows], label="LM loss")
            for j in range(max(len(r.get("mtp_losses") or []) for r in rows)):
                ax.plot(steps, [(r["mtp_losses"] or [math.nan] * (j + 1))[j] for r in rows], "--", linewidth=0.8,
                        label=f"MTP depth {j + 1}")
        val = [r for r in rows if r.get("val_loss") is not None]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "ko", markersize=4, label="validation LM loss")
        ax.set(title=stage, xlabel="step", ylabel="cross-entropy (nats/token)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if any(r.get("indexer_kl") is not None for r in rows):  # its own axis: KL is far below the CE
            kl_ax = ax.twinx()
            kl_ax.plot(steps, [r.get("indexer_kl") for r in rows], color="tab:red", label="indexer KL (right axis)")
            kl_ax.set_ylabel("indexer KL (nats)", color="tab:red")
            h2, l2 = kl_ax.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, fontsize=7)
    return _save(fig, plt, path)


def expert_load(metrics: list[dict], path: Path, names: list[str] | None = None) -> Path | None:
    """Load imbalance over time: per MoE layer, max expert load / mean expert load each step
    (1.0 = perfectly balanced; the aux-loss-free bias pushes it down)."""
    rows = [r for r in metrics if r.get("expert_load")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for layer in range(len(rows[0]["expert_load"])):
        ratio = [max(r["expert_load"][layer]) / max(sum(r["expert_load"][layer]) / len(r["expert_load"][layer]), 1e-9)
                 for r in rows]
        name = names[layer] if names and layer < len(names) else f"MoE layer {layer}"
        ax.plot([r["step"] for r in rows], ratio, linewidth=0.9, label=name)
    ax.axhline(1.0, color="k", linewidth=0.6)
    ax.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load imbalance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, plt, path)


def val_perplexity(metrics: list[dict], path: Path) -> Path | None:
    """exp(validation loss) against the step, log scale (None without validation records)."""
    val = [r for r in metrics if r.get("val_loss") is not None]
    if not val:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot([r["step"] for r in val], [math.exp(r["val_loss"]) for r in val], "o-")
    ax.set(xlabel="step", ylabel="perplexity", yscale="log", title="validation perplexity")
    ax.grid(alpha=0.3, which="both")
    return _save(fig, plt, path)


def retrieval(rows: list[dict], path: Path) -> Path | None:
    """NIAH exact match (%) against context length (None when every length was skipped)."""
    done = [r for r in rows if "accuracy" in r]
    if not done:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    lengths = [r["context_length"] for r in done]
    ax.plot(lengths, [100 * r["accuracy"] for r in done], "o-")
    ax.set(xlabel="context length (tokens)", ylabel="NIAH exact match (%)", xscale="log", ylim=(-2, 102),
           title="retrieval accuracy by context length")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def acceptance(result: dict | None, path: Path) -> Path | None:
    """Accepted fraction per draft position (None without an MTP measurement)."""
    if not result or "acceptance_rate" not in result:
        return None
    plt = _plt()
    rates = result["acceptance_rate"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.bar(range(1, len(rates) + 1), rates)
    ax.set(xlabel="draft position", ylabel="accepted fraction (with all earlier drafts)", ylim=(0, 1),
           title=f"MTP acceptance: mean length {result['acceptance_length']:.2f}")
    ax.set_xticks(range(1, len(rates) + 1))
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, plt, path)
