"""`glm5lab ablate indexcache`: IndexCache retention 1, 1/2, 1/4, searched and uniform: quality
and attention time.

Model: study_config with L layers, DSA on and a "full" indexer on every layer, no MTP layer, trained through the
report's three stages (`glm5lab.train.recipe.default_stages` at study scale: dense pre-training, indexer warm-up,
sparse adaptation) on mixed text + MQAR rows of length T, so the indexers decide what every layer attends to.

Then, training-free (`glm5lab.evals.search_indexcache`): the greedy search switches "full" indexers to
"shared" (reuse the previous full layer's top-k) by their effect on the calibration loss (held-out text,
[rows, T + 1], the last T - index_topk targets of each row: earlier queries see <= index_topk keys, where DSA
changes nothing), and `uniform_pattern` keeps evenly spaced layers. Per retention level and method:
  calib loss:    the search's calibration NLL (nats/token);
  held-out loss: the same NLL on other held-out text rows (the search never saw them);
  MQAR:          per-query accuracy (%) on fresh rows at T and 4T (teacher forced);
  attention ms:  summed wall time of the MLA modules (indexer included) in one forward, median
                 of `repeats` rounds (the search's hooks, `attention_time`; 1 CPU thread, the
                 patterns timed round-robin), on the calibration rows (T)
                 and on `time_rows` rows of 8T tokens (default size; 4T at --quick), where the indexer's T^2 scoring dominates;
  speedup:       attention ms at 8T of retention 1 / this row's.
The report gives no IndexCache figures (`report_figures.INDEXCACHE` is None); its only nearby
figure is DSA's 1.5-2x cut of long-sequence attention compute vs dense attention
(`DSA_ATTENTION_SPEEDUP`), printed beside our DSA-vs-dense attention time at 8T.
"""

from __future__ import annotations

import statistics

import torch

from glm5lab.ablate.fit import dsa_stages, fit
from glm5lab.ablate.measure import mqar_accuracy
from glm5lab.ablate.models import seeded_model, study_config
from glm5lab.ablate.report_figures import DSA_ATTENTION_SPEEDUP, INDEXCACHE
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.stats import compare, compare_text, interval, paired_difference
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.workbench import Workbench
from glm5lab.evals.search_indexcache import attention_time, search_indexcache, with_indexer_pattern
from glm5lab.evals.variants import mean_nll, model_variant

RETENTIONS = (1.0, 0.5, 0.25)
METHODS = ("searched", "uniform")
SIZES = {  # T: training length; topk: index_topk; long: timing length (T * long); seeds: unless --seeds
    "quick": dict(layers=4, hidden=64, T=32, topk=8, pairs=2, batch=8, task_rows=6, base_steps=16, W=4, A=8,
                  lr=3e-3, adapt_lr=1e-3, calib_rows=4, eval_rows=16, long=4, time_rows=2, repeats=2, seeds=1),
    "cpu": dict(layers=6, hidden=128, T=64, topk=16, pairs=4, batch=16, task_rows=12, base_steps=800, W=60,
                A=200, lr=3e-3, adapt_lr=1e-3, calib_rows=16, eval_rows=128, long=8, time_rows=4, repeats=5,
                seeds=3),
    "gpu": dict(layers=12, hidden=768, T=2048, topk=256, pairs=32, batch=16, task_rows=8, base_steps=3000, W=200,
                A=800, lr=2e-3, adapt_lr=5e-4, calib_rows=8, eval_rows=64, long=4, time_rows=2, repeats=5,
                seeds=3),
    "gpu-quick": dict(layers=4, hidden=768, T=2048, topk=256, pairs=32, batch=1, task_rows=1, base_steps=1, W=1,
                      A=1, lr=2e-3, adapt_lr=5e-4, calib_rows=1, eval_rows=1, long=2, time_rows=1, repeats=1, seeds=1),
}
"""gpu: a ~60M-parameter 12-layer DSA model at 2K tokens (top-256), timed at 8K: an estimated 2-3
GPU-hours per seed on one H100-class GPU, not measured; gpu-quick: the gpu widths and lengths
with 4 layers, one step per stage (a CPU smoke run)."""


def config(s: dict):
    """study_config at size `s`: DSA on, a "full" indexer on every layer, no MTP layer,
    positions up to the timing length and the 4T MQAR rows."""
    return study_config(num_hidden_layers=s["layers"], hidden_size=s["hidden"], index_topk=s["topk"],
                        num_nextn_predict_layers=0, use_dsa=True,
                        max_position_embeddings=s["T"] * max(s["long"], 4))


def train(bench: Workbench, s: dict, seed: int, device="cpu"):
    """The DSA model of one seed (built on the CPU, trained on `device`) and its last step's losses."""
    model = seeded_model(config(s), seed, device)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=seed)
    last = fit(model, dsa_stages(s), batches, seed=seed)[-1]
    return model, {"lm_loss": round(last["lm_loss"], 4), "indexer_kl": round(last["indexer_kl"], 6)}


def measure_seed(model, bench: Workbench, s: dict) -> dict:
    """Search, then score every (retention, method) row; returns {"rows": [...], "dense_attn_ms_long",
    "dsa_attn_ms_long"} (see the module doc for each number)."""
    T, w = s["T"], bench.text_windows("val", s["T"])
    calib, held = w[:s["calib_rows"]], w[s["calib_rows"]:2 * s["calib_rows"]]
    window = T - s["topk"]
    long_ids = bench.text_windows("val", s["T"] * s["long"])[:s["time_rows"], :-1]
    rows, twins = [], []
    for r in search_indexcache(model, calib, retentions=RETENTIONS, window=window, time_repeats=0):
        twin = with_indexer_pattern(model, r.pattern)
        twins.append(twin)
        rows.append({
            "method": r.method, "retention": r.retention, "full_layers": r.full_layers,
            "pattern": "".join("F" if t == "full" else "s" for t in r.pattern), "switched": r.switched,
            "calib_loss": r.loss, "heldout_loss": mean_nll(twin, held, window),
            "mqar_T": 100 * mqar_accuracy(twin, bench, s["eval_rows"], T, s["pairs"], seed=20_000),
            "mqar_4T": 100 * mqar_accuracy(twin, bench, s["eval_rows"], 4 * T, s["pairs"], seed=20_001)})
    dense = model_variant(model, use_dsa=False)
    ms_T = attention_ms([*twins, dense], calib[:, :-1], s["repeats"])
    ms_long = attention_ms([*twins, dense], long_ids, s["repeats"])
    for x, a, b in zip(rows, ms_T, ms_long, strict=False):
        x["attn_ms_T"], x["attn_ms_long"] = a, b
    base = rows[0]["attn_ms_long"]  # retention 1, searched: the model's own pattern
    for x in rows:
        x["speedup_long"] = base / x["attn_ms_long"]
    return {"rows": rows, "dense_attn_ms_long": ms_long[-1], "dsa_attn_ms_long": base}


def attention_ms(models: list, ids_BT: torch.Tensor, repeats: int) -> list[float]:
    """Median attention ms (`search_indexcache.attention_time`: hooks on the MLA modules) of each
    model on ids_BT, measured round-robin (one forward of each model per round, `repeats` rounds)
    on one CPU thread, so load from other processes hits every model alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = [[] for _ in models]
        for _ in range(repeats):
            for t, m in zip(times, models, strict=True):
                t.append(attention_time(m, ids_BT, 1)[0])
    finally:
        torch.set_num_threads(threads)
    return [statistics.median(t) for t in times]


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Train the DSA model per seed, search and time the patterns (module docstring); the StudyResult."""
    s, seeds = args.size_and_seeds(SIZES)
    raw, losses = {}, {}
    for seed in seeds:
        model, losses[str(seed)] = train(bench, s, seed, args.device)
        args.say(f"seed {seed}: DSA model trained ({_steps(s)} steps), last {losses[str(seed)]}; searching")
        raw[str(seed)] = measure_seed(model, bench, s)
        args.say(f"seed {seed}: searched patterns "
                 + ", ".join(x["pattern"] for x in raw[str(seed)]["rows"] if x["method"] == "searched"))
    settings = {"scale": args.size_key, "device": str(args.device), "size": s, "steps": _steps(s), "tokens": _steps(s) * s["T"] * s["batch"],
                "stages": [st.to_dict() for st in dsa_stages(s)], "retentions": RETENTIONS,
                "calibration": {"data": "held-out text windows", "rows": s["calib_rows"], "length": s["T"] + 1,
                                "window": s["T"] - s["topk"], "heldout_rows": s["calib_rows"]},
                "mqar": {"rows": s["eval_rows"], "num_kv_pairs": s["pairs"], "lengths": [s["T"], 4 * s["T"]]},
                "timing": {"device": str(args.device), "threads": 1, "rounds": s["repeats"], "calib_length": s["T"],
                           "long_length": s["T"] * s["long"], "long_rows": s["time_rows"]},
                "model": config(s).to_hf()}
    return StudyResult("indexcache", table(raw, s["long"]), {"per_seed": raw, "last_losses": losses}, settings, seeds,
                       lambda path: plot(raw, s["long"], path), notes(raw, s))


def _steps(s: dict) -> int:
    return s["base_steps"] + s["W"] + s["A"]


def _collect(raw: dict, retention: float, method: str, key: str) -> list[float]:
    return [x[key] for per in raw.values() for x in per["rows"] if x["retention"] == retention and x["method"] == method]


def table(raw: dict, long: int) -> str:
    """Rows: retention x method; mean ± sd [95% t] over seeds; the report has no IndexCache figures."""
    keys = ("calib_loss", "heldout_loss", "mqar_T", "mqar_4T", "attn_ms_T", "attn_ms_long", "speedup_long")
    head = ["retention", "method", "full layers", "patterns", "calib loss", "held-out loss", "MQAR % @T",
            "MQAR % @4T", "attn ms @T", f"attn ms @{long}T", f"speedup @{long}T", "paper"]
    rows = []
    for r in RETENTIONS:
        for m in METHODS:
            pats = sorted(set(_collect(raw, r, m, "pattern")))
            rows.append([f"{r:g}", m, _collect(raw, r, m, "full_layers")[0], " ".join(f"`{p}`" for p in pats),
                         *[interval(_collect(raw, r, m, k)).text(3 if "loss" in k else 1) for k in keys],
                         "none (INDEXCACHE is None)"])
    dense = [per["dense_attn_ms_long"] for per in raw.values()]
    dsa = [per["dsa_attn_ms_long"] for per in raw.values()]
    ratio = [d / x for d, x in zip(dense, dsa, strict=True)]
    lo, hi = DSA_ATTENTION_SPEEDUP
    ref = [["dense attention (use_dsa off)", interval(dense).text(1), "1.00", "-"],
           ["DSA, retention 1", interval(dsa).text(1), interval(ratio).text(2), f"{lo:g}-{hi:g}x"]]
    return ("IndexCache: quality and attention time by retention, mean ± sd [95% t] over seeds (report: no "
            "IndexCache figures, report_figures.INDEXCACHE is None)\n\n" + markdown_table(head, rows)
            + f"\nThe only reference figure: DSA vs dense attention time at {long}T (report: DSA cuts long-sequence "
            f"attention compute {lo:g}-{hi:g}x; ours, speedup - 1 over seeds: {compare_text(speedup(raw), 2)})\n\n"
            + markdown_table(["attention", f"attn ms @{long}T", "speedup vs dense (ours)", "paper"], ref))


def speedup(raw: dict) -> dict:
    """Dense / DSA attention time at the long length minus 1, per seed, against 0 (the report:
    DSA is faster, a positive sign), by `glm5lab.ablate.stats.compare`."""
    per_seed = {seed: per["dense_attn_ms_long"] / per["dsa_attn_ms_long"] - 1 for seed, per in raw.items()}
    return compare(per_seed, dict.fromkeys(per_seed, 0.0), +1)


def notes(raw: dict, s: dict) -> list[str]:
    """What the table can and cannot say."""
    lo, hi = DSA_ATTENTION_SPEEDUP
    ratio = statistics.fmean(per["dense_attn_ms_long"] / per["dsa_attn_ms_long"] for per in raw.values())
    verdict = speedup(raw)["verdict"]
    methods = [f"retention {r:g}, {key}: {paired_difference(_collect(raw, r, 'searched', key), _collect(raw, r, 'uniform', key)).text(d)}"
               for r in RETENTIONS[1:] for key, d in (("heldout_loss", 4), ("mqar_T", 1))]
    return [f"The report gives no IndexCache figures (report_figures.INDEXCACHE = {INDEXCACHE}): the rows have no "
            f"report column to compare with; the only reference is DSA's {lo:g}-{hi:g}x cut of long-sequence "
            f"attention compute vs dense, ours {ratio:.2f}x at {s['T'] * s['long']} tokens with index_topk "
            f"{s['topk']} ({verdict}" + (", DSA is not faster here" if verdict == "opposite" else "") + ").",
            "Searched minus uniform, paired by seed [95% t] (no report figure, so no verdict; the search minimises "
            "the calibration loss, which is a different set of rows): " + "; ".join(methods) + ".",
            "Attention time is CPU wall time (1 thread, round-robin over the patterns, median) of the MLA modules "
            "(indexer, top-k selection and attention); the machine is shared with other processes: read the "
            "speedup column, not the milliseconds; at T the attention is small and overheads dominate. Retention 1 "
            "searched and uniform are the same pattern: their difference is the timing noise.",
            f"Lengths above the training length T = {s['T']} (4T MQAR, {s['long']}T timing) use untrained positions."]


def plot(raw: dict, long: int, path) -> None:
    """Left: held-out loss vs retention; right: attention speedup at `long` x T vs retention; per method."""
    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for m, style in zip(METHODS, ("o-", "s--"), strict=True):
        for ax, key in ((a, "heldout_loss"), (b, "speedup_long")):
            vals = [_collect(raw, r, m, key) for r in RETENTIONS]
            ax.errorbar(RETENTIONS, [statistics.fmean(v) for v in vals], yerr=[interval(v).sd for v in vals],
                        fmt=style, capsize=3, label=m)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    a.set(xticks=RETENTIONS, xticklabels=["1", "1/2", "1/4"], xlabel="indexer retention",
          ylabel="held-out loss (nats/token)", title="quality")
    b.set(xticks=RETENTIONS, xticklabels=["1", "1/2", "1/4"], xlabel="indexer retention",
          ylabel=f"attention speedup at {long}T (x)", title="attention time (report: no figures)")
    a.legend()
    b.legend()
    save_png(fig, path)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: speedup and held-out
    loss change by retention, and the one verdict the report allows (DSA faster than dense)."""
    raw, long = info["raw"]["per_seed"], info["settings"]["size"]["long"]
    n = info["settings"]["size"]["T"] * long
    parts = []
    for r in RETENTIONS[1:]:
        d = paired_difference(_collect(raw, r, "searched", "heldout_loss"), _collect(raw, 1.0, "searched", "heldout_loss"))
        parts.append(f"retention {r:g} (searched): {statistics.fmean(_collect(raw, r, 'searched', 'speedup_long')):.2f}x "
                     f"less attention time at {n} tokens, held-out loss change {d.text(3)}")
    lo, hi = DSA_ATTENTION_SPEEDUP
    return {"paper": f"no IndexCache figures (DSA cuts long-sequence attention {lo:g}-{hi:g}x)",
            "ours": "; ".join(parts),
            "verdict": f"DSA faster than dense at {n} tokens (speedup - 1): {compare_text(speedup(raw), 2)}"}
