"""Expert-kernel efficiency (issue 39 item 5, `glm5lab.expert_sweep`): the figure of a sweep and the report's
section.

`plot` draws any sweep record (the benchmark's `benchmarks/expert_kernels.py`, docs/figures/expert_kernels.png,
or the report's own); `measure_for_report` runs the report's short sweep: the run's own expert shape, uniform
routing, forward only, one torch thread, at most about REPORT_BUDGET_S seconds; `render_section` writes its
markdown for the report's "Expert load" section.
"""

from __future__ import annotations

from pathlib import Path

from glm5lab.ablate.results import figure, markdown_table, save_png
from glm5lab.expert_sweep import DIRECTIONS, HALF, KERNEL_LABELS, KERNELS, ExpertShape, SweepPlan, half_peak_text, sweep

PNG_NAME = "expert_kernels.png"
COLORS = {"loop": "tab:gray", "grouped": "tab:blue", "grouped_mm": "tab:green", "gathered": "tab:orange"}
STYLES = {"forward": "o-", "backward": "s--"}
REPORT_TOKENS = (1, 4, 16, 64, 256, 1024)
REPORT_BUDGET_S = 8.0
"""The report's sweep stops after the first tokens-per-expert point that ends past this (seconds)."""


def measure_for_report(cfg, *, quick: bool = False) -> dict:
    """The report's sweep at `cfg`'s expert shape (CPU fp32, one torch thread, restored after): uniform
    routing, forward only, every kernel that runs (while its `kernel_bytes` fit 1 GiB), REPORT_TOKENS
    tokens per expert until REPORT_BUDGET_S (quick: 1 and 16, for tests). Returns
    `glm5lab.expert_sweep.sweep`'s record plus shape, threads, device and dtype."""
    import torch

    shape = ExpertShape.of_config(cfg, "this run")
    plan = SweepPlan(shapes=[shape], skews=["uniform"], tokens=[1, 16] if quick else list(REPORT_TOKENS),
                     kernels=list(KERNELS), directions=["forward"], device=torch.device("cpu"), dtype=torch.float32,
                     rounds=1, target_s=0.005 if quick else 0.02, max_reps=10, max_bytes=2**30,
                     budget_s=REPORT_BUDGET_S,
                     peak_n=256 if quick else 1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        record = sweep(plan)
    finally:
        torch.set_num_threads(threads)
    return {**record, "shape": shape.__dict__, "threads": 1, "device": "cpu", "dtype": "fp32"}


def _lines(record: dict):
    """{(shape, skew): {(kernel, direction): ([tokens per expert], [share])}} in the record's order."""
    panels: dict = {}
    for p in sorted(record["points"], key=lambda p: p["tokens_per_expert"]):
        xs, ys = panels.setdefault((p["shape"], p["skew"]), {}).setdefault((p["kernel"], p["direction"]), ([], []))
        xs.append(p["tokens_per_expert"])
        ys.append(p["share"])
    return panels


def plot(record: dict, path: Path, *, marker: float | None = None, title: str = "") -> Path:
    """Share of the matmul peak against tokens per expert (log 2 axis): one panel per (shape, skew), a line
    per kernel (colour) and direction (solid forward, dashed backward), the half-peak line dotted; `marker`:
    a vertical line at that many tokens per expert (the run's own). Returns `path`."""
    from matplotlib.ticker import FuncFormatter

    plt = figure()
    panels = _lines(record)
    skews = list(dict.fromkeys(s for _, s in panels))
    shapes = list(dict.fromkeys(sh for sh, _ in panels))
    fig, axes = plt.subplots(len(shapes), len(skews), figsize=(4.6 * len(skews) + 1, 3.8 * len(shapes)),
                             squeeze=False, sharex=True, sharey=True)
    top = max([1.0] + [max(ys) for lines in panels.values() for _, ys in lines.values()])
    for (shape, skew), lines in panels.items():
        ax = axes[shapes.index(shape)][skews.index(skew)]
        for (kernel, direction), (xs, ys) in lines.items():
            ax.plot(xs, ys, STYLES[direction], color=COLORS[kernel], ms=4, label=f"{kernel} {direction}")
        ax.axhline(HALF, color="black", linestyle=":", linewidth=0.8)
        if marker:
            ax.axvline(marker, color="tab:red", linewidth=0.8, label="this run's tokens per expert per step")
        ax.set(ylim=(0, top * 1.05), title=f"{shape}, {skew}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("tokens per expert (mean)")
    for row in axes:
        row[0].set_ylabel("share of the matmul peak (useful FLOPs)")
    axes[0][0].legend(fontsize=7)
    env = record.get("env", {})
    fig.suptitle(title or (f"Expert kernels: useful FLOP/s / the same run's matmul peak "
                           f"({record['peak']['flops_per_s'] / 1e9:.0f} GFLOP/s, {record['time_basis']} time), "
                           f"{env.get('device')} {record.get('dtype')}, {env.get('torch_threads')} thread(s), "
                           f"git {str(env.get('git_commit'))[:7]}; skews and shapes: glm5lab.expert_sweep"),
                 fontsize=10)
    return save_png(fig, Path(path), tight=True)


def report_title(record: dict) -> str:
    """The report figure's title: the shape, how it was timed and the peak."""
    sh = record["shape"]
    return (f"Expert kernels at this run's shape ({sh['experts']} experts of {sh['hidden']} x {sh['intermediate']}), "
            f"CPU fp32, 1 thread, uniform routing, forward: useful FLOP/s / a matmul's "
            f"({record['peak']['flops_per_s'] / 1e9:.1f} GFLOP/s, CPU time)")


def run_tokens_per_expert(metrics: list[dict]) -> float | None:
    """Mean assignments per expert at the run's last step in its first MoE layer (tokens x top-K / E, the
    step's micro-batches together), from metrics.jsonl's expert_load; None without it."""
    rows = [r for r in metrics if r.get("expert_load")]
    if not rows:
        return None
    load = rows[-1]["expert_load"][0]
    return sum(load) / len(load)


def render_section(record: dict | None, png: str | None, tokens_per_expert: float | None) -> str:
    """The report's "Expert kernels" subsection: how it was measured, a table of the share of peak per kernel
    and tokens per expert, at which tokens per expert each kernel reaches half the peak, the figure; one line
    when the report did not measure (`--no-measure`)."""
    head = "\n### Expert kernels: share of the matmul peak\n\n"
    if record is None:
        return head + "Not measured (the report ran without measurements).\n"
    shape = record["shape"]
    kernels = list(dict.fromkeys(p["kernel"] for p in record["points"]))
    tokens = sorted({p["tokens_per_expert"] for p in record["points"]})
    share = {(p["kernel"], p["tokens_per_expert"]): p["share"] for p in record["points"]}
    rows = [[KERNEL_LABELS[k], *[f"{100 * share[(k, m)]:.0f}%" if (k, m) in share else "-" for m in tokens]]
            for k in kernels]
    half = "; ".join(f"{k}: {half_peak_text(record['points'], 'this run', 'uniform', k, DIRECTIONS[0])}"
                     for k in kernels)
    stopped = (f" The sweep stopped after {record['stopped_at']:,} tokens per expert (its time bound)."
               if record.get("stopped_at") else "")
    here = (f" This run's last step gave its first MoE layer {tokens_per_expert:,.0f} assignments per expert "
            "(the red line)." if tokens_per_expert else "")
    first_skip: dict = {}
    for s in sorted(record["skipped"], key=lambda s: s["tokens_per_expert"]):
        first_skip.setdefault(s["kernel"], s)
    skipped = [f"{k} from {s['tokens_per_expert']:,} tokens per expert ({s['reason']})" for k, s in first_skip.items()]
    return (head + f"Measured now, at this run's expert shape ({shape['experts']} experts of {shape['hidden']} x "
            f"{shape['intermediate']}), CPU fp32, one torch thread, uniform routing, forward only (with autograd "
            "recording, as in training): useful FLOP/s (6 x rows x hidden x width) over the CPU time of a call, as "
            f"a share of a {record['peak']['n']}-square matmul timed beside it "
            f"({record['peak']['flops_per_s'] / 1e9:.1f} GFLOP/s).{stopped}{here} Skewed routing and the backward: "
            "BENCHMARKS.md, \"Expert kernels\" (`benchmarks/expert_kernels.py`).\n\n"
            + "Share of the peak at each mean number of tokens per expert:\n\n"
            + markdown_table(["kernel", *[f"{m:,}" for m in tokens]], rows)
            + f"\n\nHalf of the peak reached (tokens per expert): {half}."
            + (f" Not run: {', '.join(skipped)}." if skipped else "") + "\n"
            + (f"\n![expert kernels]({png})\n" if png else ""))
