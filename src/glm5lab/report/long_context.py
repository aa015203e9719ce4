"""The recorded long-context cost curve (`benchmarks/long_context.py`): its figure and its report table.

The benchmark writes one JSON record (`benchmarks/results/long_context.json` in the source
tree) and a PNG drawn by `plot`; `glm5lab report` reads the record with `load_record` and shows
`render_section` in its throughput section, redrawing the PNG from the record into the report
folder. Times are seconds per layer (the IndexCache models' totals divided by their 4 layers);
"x cheaper" is dense time / DSA time (or all-full / retention time for IndexCache).

Published points drawn beside ours (`PUBLISHED`): the GLM-5 report's estimate of DSA's saving in
long-sequence attention compute (1.5-2x, the seed and SPEC.md); DeepSeek-V3.2's cost-per-token
curves (H800, their kernels) read as 3.5x cheaper prefill and 8.7x cheaper decode at 128K, with
break-even near 10K (prefill) and 5K (decode) tokens (figures as the project's issue cites them;
they are not in the seed text); IndexCache (Bai et al. 2026, arXiv 2603.12201, a 30B DSA model):
retention 1/4 up to 1.82x faster prefill and 1.48x faster decode than every layer indexing
(its abstract; at 200K context as the issue cites it).
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.ticker import FuncFormatter

from glm5lab.ablate.results import figure, markdown_table, save_png
from glm5lab.report.plots import context_axis, two_five_labels

RESULT = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "long_context.json"
"""Where the benchmark records the curve in a source checkout (absent in an installed package)."""
PNG_NAME = "long_context.png"
PUBLISHED = {
    "glm5_attention_compute_saving": {"x": [1.5, 2.0], "note": "GLM-5 report: DSA cuts long-sequence attention "
                                                           "compute about 1.5-2x (authors' measurement)"},
    "deepseek_v32": {"T": 131072, "prefill_x": 3.5, "decode_x": 8.7, "prefill_break_even_T": 10_000,
                     "decode_break_even_T": 5_000,
                     "note": "DeepSeek-V3.2 cost per token vs position (H800), as the project cites it"},
    "indexcache_1_4": {"T": 200_000, "prefill_x": 1.82, "decode_x": 1.48,
                       "note": "IndexCache retention 1/4 vs all-full DSA (30B DSA model), up to"},
}


def load_record(path: Path | None = None) -> dict | None:
    """The recorded curve (`RESULT` by default), or None when the file is absent, unreadable or
    not a long_context record."""
    record = read_benchmark_json(path or RESULT, "long_context")
    return record if record is not None and isinstance(record.get("curve"), list) else None


def read_benchmark_json(path: Path, benchmark: str) -> dict | None:
    """The JSON object at `path` when it is a record of `benchmark` (its "benchmark" key), else None
    (absent, unreadable, not JSON, another benchmark's)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("benchmark") == benchmark else None


def _ratio(a, b):
    return None if not a or not b else a / b


def fmt(x, spec: str) -> str:
    """x formatted by `spec`, or '-' for None (a table cell)."""
    return "-" if x is None else format(x, spec)


def curve_rows(record: dict) -> list[list[str]]:
    """One row per recorded context: T, prefill dense s / DSA s / x cheaper, decode dense ms /
    DSA ms / x cheaper, IndexCache 1/4 x (prefill / decode; '-' where not measured)."""
    ic = {e["T"]: e["speedup"] for e in record.get("indexcache") or []}
    rows = []
    for e in record["curve"]:
        p, d = e["prefill"], e["decode"]
        pd, ps, dd, ds = p["dense"]["s"], p["dsa"]["s"], d["dense"]["s"], d["dsa"]["s"]
        sp = ic.get(e["T"])
        rows.append([str(e["T"]), fmt(pd, ".3f"), fmt(ps, ".3f"), fmt(_ratio(pd, ps), ".2f") + "x",
                     fmt(dd and dd * 1e3, ".2f"), fmt(ds and ds * 1e3, ".2f"), fmt(_ratio(dd, ds), ".2f") + "x",
                     "-" if sp is None else f"{sp['prefill']['retain_1_4']:.2f}x / {sp['decode']['retain_1_4']:.2f}x"])
    return rows


def render_section(record: dict | None, png: str | None = None) -> str:
    """Markdown for the report: the curve's table with how it was recorded (command, date,
    commit, threads), its crossovers and goals, and the figure `png` when given; one line
    saying it is not recorded when `record` is None."""
    if record is None:
        return ("\n### Long-context cost curve\n\nNot recorded (no benchmarks/results/long_context.json beside "
                "this package; run `benchmarks/long_context.py` in a source checkout).\n")
    head = (f"\n### Long-context cost curve (one layer)\n\n{recorded_by(record)} Bench-preset attention shapes, "
            "random init; prefill: dense = uncached causal SDPA forward, DSA = chunked cached prefill (256); decode: "
            "one step at T cached tokens. x = dense / DSA time.\n\n")
    table = markdown_table(["context T", "prefill dense s", "prefill DSA s", "prefill x", "decode dense ms",
                            "decode DSA ms", "decode x", "IndexCache 1/4 x, whole 4-layer forward (prefill / decode)"],
                           curve_rows(record))
    cross = record.get("crossover", {})
    goals = record.get("goals", {})
    prefill, decode = (cross.get(k, {}).get("text", "n/a") for k in ("prefill", "decode"))
    lines = [f"\nCrossover (DSA faster, whole forward / step): prefill {prefill}, decode {decode} tokens. The goals "
             "below are judged on the time inside the attention modules."]
    lines += [f"- {goal_line(g)}" for g in goals.values()]
    img = f"\n![long-context cost curve]({png})\n" if png else ""
    return head + table + "\n" + "\n".join(lines) + "\n" + img


def recorded_by(record: dict) -> str:
    """How a benchmark record was taken, in one sentence: 'Recorded by `command` on date UTC, git commit, device
    dtype, N torch threads (load a -> b).'"""
    env = record.get("env", {})
    return (f"Recorded by `{record.get('command')}` on {env.get('date_utc')} UTC, git "
            f"{str(env.get('git_commit'))[:12]}, {env.get('device')} {record.get('dtype')}, {env.get('torch_threads')} "
            f"torch threads (load {env.get('load_average_start')} -> {env.get('load_average_end')}).")


def goal_line(g: dict) -> str:
    """'text: value -> met | MISSED', or the value and 'not decided by these lengths', or 'not measured'."""
    if g.get("met") is None:
        shown = g.get("shown") or "not measured"
        return f"{g['text']}: {shown}" + ("" if shown == "not measured" else " -> not decided by these lengths")
    return f"{g['text']}: {g.get('shown')} -> {'met' if g['met'] else 'MISSED'}"


def _series(record: dict, phase: str) -> dict[str, tuple[list, list]]:
    """{label: (T values, seconds per layer)} of one phase ("prefill" | "decode"): the 1-layer model's dense
    and DSA, and the 4-layer IndexCache models' total / 4 (their per-token work outside the layers, the output
    head above all, is shared by 4 layers: compare IndexCache with the 4-layer all-full model)."""
    out = {"dense MLA": ([], []), "DSA": ([], [])}
    for e in record["curve"]:
        for name, key in (("dense MLA", "dense"), ("DSA", "dsa")):
            if e[phase][key]["s"]:
                out[name][0].append(e["T"])
                out[name][1].append(e[phase][key]["s"])
    for label, key in (("DSA, 4-layer all-full", "full"), ("DSA, IndexCache 1/2", "retain_1_2"),
                       ("DSA, IndexCache 1/4", "retain_1_4")):
        pts = [(e["T"], e[phase][key]["per_layer_s"]) for e in record.get("indexcache") or []]
        out[label] = ([t for t, _ in pts], [s for _, s in pts])
    return out


def plot(record: dict, path: Path) -> Path:
    """Three panels: prefill and decode seconds per layer vs context (log-log), and how many
    times cheaper DSA is than dense (and IndexCache 1/4 than all-full DSA) vs context, with the
    published points of `PUBLISHED`. Returns `path`."""
    plt = figure()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2), gridspec_kw={"width_ratios": [1, 1, 1.15]})
    styles = {"dense MLA": "o-", "DSA": "s-", "DSA, 4-layer all-full": "s:", "DSA, IndexCache 1/2": "^--",
              "DSA, IndexCache 1/4": "v--"}
    for ax, phase, title in ((axes[0], "prefill", "prefill of T tokens"),
                             (axes[1], "decode", "one decode step at T cached tokens")):
        for label, (xs, ys) in _series(record, phase).items():
            if xs:
                ax.plot(xs, ys, styles[label], label=label)
        ax.set(yscale="log", ylabel="seconds per layer", title=title)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        lo, hi = ax.get_ylim()
        ax.yaxis.set_minor_formatter(FuncFormatter(two_five_labels if hi / lo > 10 else lambda y, _: f"{y:g}"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        context_axis(ax)
        ax.legend(fontsize=8)
    _ratio_panel(axes[2], record)
    fig.suptitle(f"Long-context attention cost, one bench-preset layer, {record.get('env', {}).get('device')} "
                 f"{record.get('dtype')}, {record.get('env', {}).get('torch_threads')} thread(s)", fontsize=10)
    return save_png(fig, Path(path), tight=True)


def _ratio_panel(ax, record: dict) -> None:
    """Measured x-cheaper curves (solid: dense/DSA; dashed: all-full/IndexCache 1/4) and the
    published points (hollow markers, same colours)."""
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    for phase, color in colors.items():
        pts = [(e["T"], _ratio(e[phase]["dense"]["s"], e[phase]["dsa"]["s"])) for e in record["curve"]]
        pts = [(t, r) for t, r in pts if r]
        ax.plot([t for t, _ in pts], [r for _, r in pts], "o-", color=color, label=f"{phase}: dense / DSA (ours)")
        att = [(e["T"], e[f"{phase}_attention"]["dense_over_dsa"]) for e in record["curve"]]
        ax.plot([t for t, _ in att], [r for _, r in att], ".:", color=color,
                label=f"{phase}: dense / DSA, attention parts only (ours)")
        ic = [(e["T"], e["speedup"][phase]["retain_1_4"]) for e in record.get("indexcache") or []]
        if ic:
            ax.plot([t for t, _ in ic], [r for _, r in ic], "v--", color=color,
                    label=f"{phase}: all-full / IndexCache 1/4 (ours)")
    ds, icp = PUBLISHED["deepseek_v32"], PUBLISHED["indexcache_1_4"]
    for phase, color in colors.items():
        ax.plot([ds["T"]], [ds[f"{phase}_x"]], "o", mfc="none", mec=color, ms=10, mew=2,
                label=f"{phase}: DeepSeek-V3.2, {ds[f'{phase}_x']}x at 128K")
        ax.plot([ds[f"{phase}_break_even_T"]], [1.0], "D", mfc="none", mec=color, ms=8, mew=2,
                label=f"{phase}: DeepSeek-V3.2 break-even ~{ds[f'{phase}_break_even_T'] // 1000}K")
        ax.plot([icp["T"]], [icp[f"{phase}_x"]], "v", mfc="none", mec=color, ms=10, mew=2,
                label=f"{phase}: IndexCache paper 1/4, {icp[f'{phase}_x']}x at 200K")
    lo, hi = PUBLISHED["glm5_attention_compute_saving"]["x"]
    ax.vlines(131072, lo, hi, color="tab:green", lw=4, alpha=0.6, label="GLM-5 report: attention compute 1.5-2x")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log", base=2)
    ax.set(ylabel="x cheaper (time ratio; > 1: cheaper)", title="how many times cheaper")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    context_axis(ax, right=262144)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
