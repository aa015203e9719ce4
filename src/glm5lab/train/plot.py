"""The loss-curve PNG of a run (matplotlib, headless), and what every time plot of a run shares
(`glm5lab.report.plots` draws with these too): the stages as spans of steps, a trailing mean, stage boundaries
drawn as dotted lines with the stage names, and the labels of the two validation figures.

Two validation figures exist (issue 16): the periodic `val_loss` of metrics.jsonl is the mean target CE over a
fixed SUBSET of the held-out split (the windows of its first `eval_tokens` targets; `val_tokens` targets);
summary.json's `val_loss` is the final model over the WHOLE split. They differ because they score different text,
so every plot labels the curve as the subset and draws the whole-split figure as its own marker at the last step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from glm5lab.io_utils import atomic_write

LM, MTP, KL, VAL, WHOLE = "tab:blue", "tab:orange", "tab:red", "black", "tab:green"  # one colour per quantity


def stage_spans(rows: list[dict]) -> list[tuple[str, int, int]]:
    """(stage, first step, last step) for each run of consecutive rows of one stage, in order."""
    spans: list[list] = []
    for r in rows:
        if spans and spans[-1][0] == r["stage"]:
            spans[-1][2] = r["step"]
        else:
            spans.append([r["stage"], r["step"], r["step"]])
    return [(name, a, b) for name, a, b in spans]


def trailing_mean(values: list, k: int) -> list[float]:
    """At each index the mean of the last k values (fewer at the start); None/NaN are skipped
    (NaN where all k are)."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - k + 1): i + 1] if v is not None and math.isfinite(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def stage_mean(rows: list[dict], values: list, k: int) -> list[float]:
    """`trailing_mean` restarted at every stage (a stage change, e.g. to sparse attention, is a
    step in the curve, not a ramp): one value per row, the rows grouped as `stage_spans` groups them."""
    out: list[float] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["stage"] != rows[start]["stage"]:
            out += trailing_mean(values[start:i], k)
            start = i
    return out


def smoothed(k: int) -> str:
    """How a curve smoothed over k steps is labelled."""
    return "per step" if k == 1 else f"mean of last {k} steps"


def beside(ax, points: float = 7.0):
    """A transform drawing data points `points` to the right of where they are: the whole-split
    final figure beside the subset's last point instead of on top of it."""
    from matplotlib.transforms import ScaledTranslation

    return ax.transData + ScaledTranslation(points / 72, 0, ax.figure.dpi_scale_trans)


def plain_ticks(axis) -> None:
    """Tick labels as plain numbers of 3 significant digits, no offset text (the indexer KL is
    ~1e-5 in short runs; an offset '1e-5' at the axis end collides with the stage names)."""
    axis.set_major_formatter(lambda v, _: f"{v:.3g}")


def smoothing_steps(n_steps: int) -> int:
    """The trailing-mean window of the train curves: about 1/40 of the run, 1 to 25 steps."""
    return max(1, min(25, n_steps // 40))


def mark_stages(ax, spans: list[tuple[str, int, int]], *, names: bool = True, shade: bool = True,
                color: str = "0.35", title: str | None = None) -> None:
    """Dotted vertical lines between stages (half a step after a stage's last step), every other
    stage lightly shaded, and each stage's name just above the axes over its span, on two
    alternating rows when one is wider than its span; widens the x range to the whole run. Call
    it after plotting. title: the axes' title, set above the names."""
    from matplotlib.transforms import blended_transform_factory

    tr = blended_transform_factory(ax.transData, ax.transAxes)
    if spans:  # the whole run in view, with room on the right for a marker drawn `beside` the last step
        x0, x1 = ax.get_xlim()
        ax.set_xlim(min(x0, spans[0][1] - 0.5), max(x1, spans[-1][2] + 0.5 + 0.03 * (spans[-1][2] - spans[0][1] + 1)))
    x0, x1 = ax.get_xlim()
    char_px = 8 * 0.6 * ax.figure.dpi / 72  # an 8-point character, about
    fits = all((b - a + 1) / (x1 - x0) * ax.get_window_extent().width > 1.1 * char_px * len(name)
               for name, a, b in spans)
    for i, (name, a, b) in enumerate(spans):
        lo, hi = a - 0.5, b + 0.5
        if i:
            ax.axvline(lo, color=color, linewidth=1.0, linestyle=":", zorder=1)
        if shade and i % 2:
            ax.axvspan(lo, hi, color="0.5", alpha=0.08, linewidth=0, zorder=0)
        if names:
            ax.annotate(name, xy=((lo + hi) / 2, 1.0), xycoords=tr, xytext=(0, 2 + 10 * (0 if fits else i % 2)),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8, color=color,
                        annotation_clip=False)
    if title is not None:
        ax.set_title(title, pad=(6 if not (names and spans) else 14 if fits else 24))


def subset_label(rows: list[dict]) -> str:
    """'validation subset (first N tokens)' from the rows' val_tokens ('validation subset' without them)."""
    tokens = next((r["val_tokens"] for r in reversed(rows) if r.get("val_tokens")), None)
    return f"validation subset (first {tokens:,} tokens)" if tokens else "validation subset"


def whole_label(summary: dict) -> str:
    """'whole held-out split, final (N tokens)' (the token count when summary.json has it)."""
    tokens = summary.get("val_tokens")
    return "whole held-out split, final" + (f" ({tokens:,} tokens)" if tokens else "")


def mtp_mean(rows: list[dict]) -> tuple[list[float], int]:
    """Per row the mean MTP loss over its depths, NaN for a row with fewer depths than the run's most (the indexer
    warm-up runs one depth only for its indexer; it trains none), and that number of depths (0: no MTP)."""
    depths = max((len(r.get("mtp_losses") or []) for r in rows), default=0)
    return [sum(r["mtp_losses"]) / depths if depths and len(r.get("mtp_losses") or []) == depths else math.nan
            for r in rows], depths


def draw_losses(ax, rows: list[dict], summary: dict, *, title: str | None = None):
    """The whole run on one axes: `draw_lm`, the indexer KL on a right axis (`draw_kl`), stage boundaries.
    Returns the (handles, labels) for one legend."""
    draw_lm(ax, rows, summary, smoothing_steps(len(rows)))
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    mark_stages(ax, stage_spans(rows), title=title)
    handles, labels = ax.get_legend_handles_labels()
    if any(math.isfinite(v) for v in as_floats(r.get("indexer_kl") for r in rows)):  # its own axis: another scale
        h2, l2 = draw_kl(ax.twinx(), rows, label="indexer KL (nats; its own axis, red)").get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    return handles, labels


def draw_lm(ax, rows: list[dict], summary: dict, k: int, *, mtp: bool = True) -> None:
    """On `ax`, each labelled for a legend: the LM loss (faint per step, solid: `stage_mean` over k steps), the MTP
    mean over its depths (when `mtp` and the run has MTP), the validation subset as dots, and summary.json's
    whole-split final figure as a diamond beside the last step (when `summary` has val_loss)."""
    steps = [r["step"] for r in rows]
    lm = as_floats(r.get("lm_loss") for r in rows)
    ax.plot(steps, lm, color=LM, alpha=0.25, linewidth=0.6)
    ax.plot(steps, stage_mean(rows, lm, k), color=LM, linewidth=1.5, label=f"LM loss (train, {smoothed(k)})")
    mtp_losses, depths = mtp_mean(rows)
    if mtp and depths:
        ax.plot(steps, stage_mean(rows, mtp_losses, k), color=MTP, linewidth=1.1,
                label=f"MTP loss (mean of {depths} depth{'s' * (depths > 1)}, {smoothed(k)})")
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", color=VAL, markersize=4,
                label=subset_label(rows), zorder=4)
    if summary.get("val_loss") is not None and rows:
        ax.plot([steps[-1]], [summary["val_loss"]], "D", color=WHOLE, markeredgecolor="k", markersize=6,
                label=whole_label(summary), zorder=5, transform=beside(ax))


def draw_kl(ax, rows: list[dict], ylabel: str = "indexer KL (nats)", *, label: str | None = None, width: float = 0.9):
    """The indexer KL per step on `ax` (red, `width` points wide, a gap where a row has none) with the y label
    `ylabel` and plain tick labels; returns `ax`."""
    ax.plot([r["step"] for r in rows], as_floats(r.get("indexer_kl") for r in rows), color=KL, linewidth=width,
            label=label)
    ax.set_ylabel(ylabel, color=KL)
    plain_ticks(ax.yaxis)
    return ax


def as_floats(values) -> list[float]:
    """None -> NaN (a gap in the line)."""
    return [math.nan if v is None else float(v) for v in values]


def plot_losses(metrics_path: Path, png_path: Path, summary: dict) -> Path:
    """loss.png from `metrics.jsonl` (`draw_losses`; `summary`, the run's summary.json dict, gives the whole-split
    final point), written atomically. Returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path = Path(metrics_path)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(9, 5))
    handles, labels = draw_losses(ax, rows, summary, title="training run (dotted lines: stage boundaries)")
    ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    atomic_write(png_path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return Path(png_path)


def plot_run(run_dir: Path, summary: dict, notice) -> Path | None:
    """The run's loss.png (`plot_losses` of its metrics.jsonl and `summary`, the dict summary.json receives next), or
    None after one `notice(line)` saying why it could not be drawn: a plot never turns a trained run into a failed one
    (its summary.json is written next either way)."""
    try:
        return plot_losses(Path(run_dir) / "metrics.jsonl", Path(run_dir) / "loss.png", summary)
    except Exception as e:  # noqa: BLE001 (any plotting error: the run itself is done)
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        notice(f"warning: loss.png not drawn ({why}); the run is complete, its summary.json follows")
        return None

