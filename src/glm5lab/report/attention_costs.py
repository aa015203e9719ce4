"""The recorded mixer comparison (`benchmarks/long_context.py --costs`, issue 28): its figure and report table.

The benchmark writes one JSON record (`benchmarks/results/attention_costs.json` in the source tree)
and a PNG drawn by `plot` (`docs/figures/attention_costs.png`); `glm5lab report` reads the record
with `load_record` and shows `render_section` beside the long-context curve, redrawing the PNG from
the record into the report folder. Every figure is per layer (a multi-layer model's total divided by
its layers: DSA + IndexCache 4, the SWA 1:1 interleave 2); state bytes are per sequence of T tokens.
"""

from __future__ import annotations

from pathlib import Path

from glm5lab.ablate.results import figure, markdown_table, save_png
from glm5lab.report.long_context import fmt, goal_line, read_benchmark_json, recorded_by

RESULT = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "attention_costs.json"
"""Where the benchmark records the comparison in a source checkout (absent in an installed package)."""
PNG_NAME = "attention_costs.png"
STYLES = {"dense": "o-", "dsa": "s-", "dsa_indexcache": "v--", "swa": "^-", "swa_interleave": "^--", "gdn": "D-",
          "simple_gdn": "d--"}


def load_record(path: Path | None = None) -> dict | None:
    """The recorded comparison (`RESULT` by default), or None when the file is absent, unreadable
    or not an attention_costs record."""
    record = read_benchmark_json(path or RESULT, "attention_costs")
    if record is not None and isinstance(record.get("points"), list) and record["points"] \
            and isinstance(record.get("mixers"), dict):
        return record
    return None


def longest_rows(record: dict) -> list[list[str]]:
    """One row per mixer at the longest recorded T: prefill s and decode ms (wall / CPU), state MiB
    (measured / ledger), prefill peak MiB, all per layer ('-' where not run); the uncached dense
    reference last when it ran there."""
    p = max(record["points"], key=lambda e: e["T"])
    rows = []
    for key, spec in record["mixers"].items():
        pre, dec, st = p["prefill"].get(key), p["decode"][key], p["state"][key]
        rows.append([spec["label"], _pair(pre, "per_layer_s", "cpu_per_layer_s", 1, ".3f"),
                     _pair(dec, "per_layer_s", "cpu_per_layer_s", 1e3, ".2f"),
                     f"{st['measured_per_layer'] / 2**20:.2f} / {st['ledger_per_layer'] / 2**20:.2f}",
                     fmt(pre and pre.get("peak_bytes") and pre["peak_bytes"] / 2**20, ".0f")])
    ref = p.get("dense_reference")
    if ref:
        rows.append(["dense MLA, uncached SDPA forward", _pair(ref, "s", "cpu_s", 1, ".3f"), "-", "-",
                     fmt(ref.get("peak_bytes") and ref["peak_bytes"] / 2**20, ".0f")])
    return rows


def _pair(res: dict | None, wall: str, cpu: str, scale: float, spec: str) -> str:
    if not res:
        return "-"
    return f"{res[wall] * scale:{spec}} / {res[cpu] * scale:{spec}}"


def render_section(record: dict | None, png: str | None = None) -> str:
    """Markdown for the report: the mixers at the longest recorded T with how it was recorded
    (command, date, commit, threads, load), the SWA goals, and the figure `png` when given; one
    line saying it is not recorded when `record` is None."""
    if record is None:
        return ("\n### Attention costs on one stack\n\nNot recorded (no benchmarks/results/attention_costs.json "
                "beside this package; run `benchmarks/long_context.py --costs` in a source checkout).\n")
    T = max(e["T"] for e in record["points"])
    head = (f"\n### Attention costs on one stack (per layer, at {T // 1024}K tokens)\n\n{recorded_by(record)} "
            "Bench-preset widths for every mixer, random init; prefill = chunked cached `prefill` (256), decode = one "
            "`decode_step` at T cached tokens; wall-clock and CPU time (the process's: what a loaded machine distorts "
            f"least); SWA window {record.get('window')}; dense K/V chunked prefill capped at "
            f"{record.get('dense_cap') or 'no cap'} tokens ('-').\n\n")
    table = markdown_table(["mixer", "prefill s (wall / CPU)", "decode ms (wall / CPU)",
                            "state MiB (measured / ledger)", "prefill peak MiB"], longest_rows(record))
    lines = [f"- {goal_line(g)}" for g in record.get("goals", {}).values()]
    img = f"\n![attention costs]({png})\n" if png else ""
    return head + table + "\n\n" + "\n".join(lines) + "\n" + img


def _series(record: dict, key: str, panel: str) -> tuple[list, list]:
    """(T values, per-layer values) of mixer `key` on one panel ("prefill" s, "decode" ms, "state" MiB)."""
    pts = []
    for e in record["points"]:
        if panel == "state":
            pts.append((e["T"], e["state"][key]["measured_per_layer"] / 2**20))
        elif panel == "decode":
            pts.append((e["T"], e["decode"][key]["cpu_per_layer_s"] * 1e3))
        elif e["prefill"].get(key):
            pts.append((e["T"], e["prefill"][key]["cpu_per_layer_s"]))
    return [t for t, _ in pts], [v for _, v in pts]


def plot(record: dict, path: Path) -> Path:
    """Three log-log panels against context T: prefill seconds, decode milliseconds per token and
    state bytes per sequence, per layer, one line per mixer (the uncached dense forward dotted on
    the prefill panel). Returns `path`."""
    from matplotlib.ticker import FuncFormatter

    from glm5lab.report.plots import context_axis, two_five_labels

    plt = figure()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.4))
    panels = (("prefill", "prefill of T tokens: CPU seconds per layer"),
              ("decode", "one decode step at T cached tokens: CPU ms per layer"),
              ("state", "state per sequence: MiB per layer (measured)"))
    for ax, (panel, title) in zip(axes, panels, strict=True):
        for key, spec in record["mixers"].items():
            xs, ys = _series(record, key, panel)
            zeros = [e["T"] for e in record["points"] if e["decode"][key].get("cache") == "zeros"]
            label = spec["label"] + (f" (from {zeros[0] // 1024}K: zero-filled cache)" if panel == "decode" and zeros
                                     else "")
            if xs:
                ax.plot(xs, ys, STYLES.get(key, "o-"), label=label, ms=5)
        if panel == "prefill":
            ref = [(e["T"], e["dense_reference"]["cpu_s"]) for e in record["points"] if e.get("dense_reference")]
            ax.plot([t for t, _ in ref], [s for _, s in ref], "o:", color="gray",
                    label="dense MLA, uncached SDPA forward")
        ax.set(yscale="log", title=title)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(two_five_labels))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        context_axis(ax)
        ax.legend(fontsize=7)
    env = record.get("env", {})
    fig.suptitle(f"Token mixers on one stack (bench-preset widths), {env.get('device')} {record.get('dtype')}, "
                 f"{env.get('torch_threads')} thread(s), times in CPU seconds; SWA window {record.get('window')}",
                 fontsize=10)
    return save_png(fig, Path(path), tight=True)
