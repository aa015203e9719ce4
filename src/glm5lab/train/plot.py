"""The loss-curve PNG of a run (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_losses(metrics_path: Path, png_path: Path) -> Path:
    """Training loss per step coloured by stage, MTP depth losses dashed, validation loss as
    dots, from `metrics.jsonl`. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(9, 5))
    for stage in dict.fromkeys(r["stage"] for r in rows):
        part = [r for r in rows if r["stage"] == stage]
        ax.plot([r["step"] for r in part], [r["lm_loss"] for r in part], label=f"{stage}: LM loss")
        depths = max((len(r["mtp_losses"]) for r in part), default=0)
        for j in range(depths):
            ax.plot([r["step"] for r in part], [r["mtp_losses"][j] for r in part], "--", linewidth=0.8,
                    label=f"{stage}: MTP depth {j + 1}")
    val = [r for r in rows if r.get("val_loss") is not None]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "ko", markersize=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)
