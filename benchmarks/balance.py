"""Aux-loss-free balancing in finished training runs: expert-load imbalance and validation loss
per run, to choose `--bias-update-rate` (issue 11).

Imbalance is what `glm5lab report` plots: per MoE layer and step, max tokens per expert / mean
tokens per expert over the step's batch (`expert_load` in metrics.jsonl; the MTP layer's MoE
counts its three depths). Read over the steps after the first 10% of the run (the bias starts at
0, so early steps are imbalanced by construction): the worst and the median ratio over all
(step, layer) pairs, the share of pairs under 2, the worst layer's median, and the last step's
worst layer; over the whole run, the step from which every layer stays under 2 to the end
("under 2 from step"; "never" when the last step is not). Validation loss: the run's summary.json
(the whole held-out split). Run folders are read with `glm5lab.report.collect.load_run`, as
`glm5lab report` reads them.

    .venv/bin/python benchmarks/balance.py runs/sweep/bias-*            # one row per run folder

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, print_json_line

from glm5lab.report.collect import NotARunError, load_run

THRESHOLD = 2.0
SKIP_FRACTION = 0.1


def ratios(load: list[int]) -> float:
    mean = sum(load) / len(load)
    return max(load) / mean if mean else 0.0


def _under_from(over: list[int], n_steps: int) -> int | None:
    """The first step (1-based) from which no step exceeds the threshold; None if the last does."""
    if not over:
        return 1
    return None if over[-1] == n_steps - 1 else over[-1] + 2


def run_summary(run: Path) -> dict:
    """Imbalance and loss figures of one finished run folder. Raises SystemExit if it is not one."""
    try:
        rec = load_run(run)
    except NotARunError as e:
        raise SystemExit(str(e)) from None
    rows = [r for r in rec.metrics if r.get("expert_load")]
    args = rec.run["args"]
    skip = int(len(rows) * SKIP_FRACTION)
    later = rows[skip:]
    n_layers = len(rows[0]["expert_load"])
    per_layer = [[ratios(r["expert_load"][i]) for r in later] for i in range(n_layers)]
    pairs = [x for layer in per_layer for x in layer]
    worst_per_step = [max(ratios(load) for load in r["expert_load"]) for r in rows]
    over = [i for i, x in enumerate(worst_per_step) if x >= THRESHOLD]
    return {"run": str(run), "bias_update_rate": args.get("bias_update_rate"), "steps": len(rows),
            "skipped_steps": skip, "val_loss": rec.summary["val_loss"], "worst": max(pairs),
            "median": statistics.median(pairs), "share_under_2": sum(x < THRESHOLD for x in pairs) / len(pairs),
            "worst_layer_median": max(statistics.median(layer) for layer in per_layer),
            "last_step_worst": worst_per_step[-1],
            "under_2_from_step": _under_from(over, len(rows)),
            "per_layer_median": [round(statistics.median(layer), 3) for layer in per_layer]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="finished run folders")
    args = p.parse_args(argv)
    results = sorted((run_summary(Path(r)) for r in args.runs), key=lambda r: r["bias_update_rate"])
    table = [[r["run"], r["bias_update_rate"], f"{r['val_loss']:.4f}", f"{r['median']:.2f}", f"{r['worst_layer_median']:.2f}",
              f"{r['worst']:.2f}", f"{r['share_under_2']:.1%}", f"{r['last_step_worst']:.2f}",
              r["under_2_from_step"] or "never"] for r in results]
    print(markdown_table(["run", "bias rate", "val loss", "median max/mean", "worst layer's median", "worst",
                          "pairs under 2", "last step worst", "under 2 from step"], table))
    record = {"benchmark": "balance", "skip_fraction": SKIP_FRACTION, "threshold": THRESHOLD, "results": results}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
