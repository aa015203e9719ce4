"""`glm5lab ablate indexcache`: IndexCache at 1/2 and 1/4 of the indexers, training-free and training-aware, against
full DSA: quality, retrieval and time.

Model: study_config with L layers, DSA on, no MTP layer, mixed text + MQAR rows of length T. Per seed one dense
base (the report's first stage, `glm5lab.ablate.fit.dsa_stages`), then five branches of it, each trained through
the same indexer warm-up (W steps) and sparse adaptation (A steps) on the same batches, with a fresh optimizer:
  full DSA          every layer keeps its indexer (the reference, retention 1);
  warm-up           the uniform pattern (`uniform_pattern`: evenly spaced kept layers, the rest "shared") set before
                    the warm-up, each kept indexer trained on its own layer's attention (indexer_target "own": what
                    public trainers do), at retention 1/2 and 1/4;
  distillation      the same pattern, each kept indexer trained on the mean attention of the layers it serves
                    (indexer_target "served": the IndexCache paper's multi-layer distillation,
                    `glm5lab.model.index_distill`), at 1/2 and 1/4.
Training-free, on the full DSA model (`glm5lab.evals.search_indexcache`): "searched", the greedy search by the
calibration loss (held-out rows [calib_rows, T + 1], their last T - index_topk targets, where DSA acts), and
"uniform", the uniform pattern with no training, at 1/2 and 1/4.

Scores per row (held-out rows the search never saw; DSA on):
  held-out loss / bpb   NLL (nats/token) and bits per byte of the last T - index_topk targets of eval_rows text rows;
  MQAR % @T, @4T        per-query accuracy on fresh rows at T (the longest trained length) and 4T (teacher forced);
  NIAH % @T             single-needle exact match at T prompt tokens (`ablate.measure.niah_accuracy`);
  attn ms @8T           MLA modules' wall time (indexer, top-k, attention) in one forward of `time_rows` rows of
                        long x T tokens (`attention_time` hooks), median of `repeats` rounds, round-robin, 1 thread;
  prefill ms, decode ms `glm5lab.generate` on one prompt of long x T - decode - 1 tokens: the prefill's seconds and
                        the seconds per decoded token (greedy, `decode` tokens), same rounds;
  speedup               attn ms of full DSA / this row's.
Verdicts (paired by seed, `glm5lab.ablate.stats`), on the held-out loss at each retention: distillation below
warm-up (the paper: 51.6 vs 49.8 long-context average at 1/2, i.e. the cross-layer loss helps); distillation
equivalent to full DSA within +-EQUIV_MARGIN nats/token (the paper: 51.6 / 74.5 vs 51.0 / 74.2); and, as before,
DSA's attention faster than dense attention at long x T (the report: 1.5-2x less compute).
"""

from __future__ import annotations

import copy
import statistics

import torch

from glm5lab.ablate.fit import dsa_stages, fit
from glm5lab.ablate.measure import labelled_nll, mqar_accuracy, niah_accuracy
from glm5lab.ablate.models import seeded_model, study_config
from glm5lab.ablate.report_figures import DSA_ATTENTION_SPEEDUP, INDEXCACHE
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.stats import compare, compare_equivalent, compare_text, interval, paired_difference
from glm5lab.ablate.workbench import Workbench
from glm5lab.evals.bpb import bits_per_byte, target_bytes, token_byte_lengths
from glm5lab.evals.mqar import IGNORE_INDEX
from glm5lab.evals.search_indexcache import attention_time, search_indexcache, uniform_pattern, with_indexer_pattern
from glm5lab.evals.variants import model_variant

RETENTIONS = (0.5, 0.25)
"""The shared-index levels studied; full DSA (retention 1) is the reference row."""
METHODS = ("searched", "uniform", "warm-up", "distillation")
"""Per retention: training-free (searched, uniform) and training-aware (warm-up, distillation) rows."""
TRAINED = {"warm-up": "own", "distillation": "served"}
"""The training-aware methods and their `Stage.indexer_target`."""
EQUIV_MARGIN = 0.01
"""nats/token: distillation counts as recovering full DSA when the 90% paired interval of the held-out loss
difference lies within +-this (about 0.3% of the loss; declared before the runs)."""
SIZES = {  # T: training length; topk: index_topk; long: timing length (T * long); seeds: unless --seeds
    "quick": dict(layers=4, hidden=64, T=32, topk=8, pairs=2, batch=8, task_rows=6, base_steps=16, W=4, A=8,
                  lr=3e-3, adapt_lr=1e-3, calib_rows=4, eval_rows=16, long=4, time_rows=2, repeats=2, decode=4,
                  seeds=1),
    "cpu": dict(layers=8, hidden=128, T=64, topk=16, pairs=4, batch=16, task_rows=12, base_steps=800, W=60,
                A=200, lr=3e-3, adapt_lr=1e-3, calib_rows=16, eval_rows=128, long=8, time_rows=4, repeats=5,
                decode=16, seeds=3),
    "gpu": dict(layers=12, hidden=768, T=2048, topk=256, pairs=32, batch=16, task_rows=8, base_steps=3000, W=200,
                A=800, lr=2e-3, adapt_lr=5e-4, calib_rows=8, eval_rows=64, long=4, time_rows=2, repeats=5,
                decode=32, seeds=3),
    "gpu-quick": dict(layers=4, hidden=768, T=2048, topk=256, pairs=32, batch=1, task_rows=1, base_steps=1, W=1,
                      A=1, lr=2e-3, adapt_lr=5e-4, calib_rows=1, eval_rows=1, long=2, time_rows=1, repeats=1,
                      decode=2, seeds=1),
}
"""cpu: 8 layers, so 1/4 keeps two indexers; gpu: a ~60M-parameter 12-layer DSA model at 2K tokens (top-256),
timed at 8K: an estimated 5-7 GPU-hours per seed on one H100-class GPU (the base and five branches), not
measured; gpu-quick: the gpu widths and lengths with 4 layers, one step per stage (a CPU smoke run)."""


def config(s: dict):
    """study_config at size `s`: DSA on, a "full" indexer on every layer, no MTP layer, positions up to the timing
    length and the 4T MQAR rows."""
    return study_config(num_hidden_layers=s["layers"], hidden_size=s["hidden"], index_topk=s["topk"],
                        num_nextn_predict_layers=0, use_dsa=True,
                        max_position_embeddings=s["T"] * max(s["long"], 4))


def train_arms(bench: Workbench, s: dict, seed: int, device="cpu") -> tuple[dict, dict]:
    """The dense base of one seed, then its branches (module docstring): ({"full": model, (method, retention):
    model for the trained methods}, {arm: its last step's losses})."""
    base = seeded_model(config(s), seed, device)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=seed)
    fit(base, dsa_stages(s)[:1], batches, seed=seed)
    after_base = {"step": s["base_steps"], "stage": 1, "in_stage": 0}
    arms, losses = {}, {}
    branches = [("full", list(base.config.indexer_types), "own")]
    branches += [((m, r), uniform_pattern(base.config, r), t) for r in RETENTIONS for m, t in TRAINED.items()]
    for key, pattern, target in branches:
        model = copy.deepcopy(with_indexer_pattern(base, pattern))
        last = fit(model, dsa_stages(s, target), batches, seed=seed, start=after_base)[-1]
        arms[key] = model
        losses[_name(key)] = {"lm_loss": round(last["lm_loss"], 4), "indexer_kl": round(last["indexer_kl"], 6)}
    return arms, losses


def _name(key) -> str:
    return key if isinstance(key, str) else f"{key[0]} {key[1]:g}"


def measure_seed(arms: dict, bench: Workbench, s: dict) -> dict:
    """Search the full DSA model, then score every row (module docstring); returns {"rows": [...],
    "dense_attn_ms_long", "dsa_attn_ms_long"}."""
    T, w = s["T"], bench.text_windows("val", s["T"])
    calib, held = w[:s["calib_rows"]], w[s["calib_rows"]:s["calib_rows"] + s["eval_rows"]]
    full, window = arms["full"], T - s["topk"]
    byte_lengths = token_byte_lengths(bench.tokenizer, full.config.vocab_size)
    models, rows = [full], [_row("full", 1.0, full)]
    for r in search_indexcache(full, calib, retentions=RETENTIONS, window=window, time_repeats=0):
        models.append(with_indexer_pattern(full, r.pattern))
        rows.append({**_row(r.method, r.retention, models[-1]), "calib_loss": r.loss, "switched": r.switched})
        if r.method == "uniform":
            for m in TRAINED:
                models.append(arms[(m, r.retention)])
                rows.append(_row(m, r.retention, models[-1]))
    for x, model in zip(rows, models, strict=True):
        x.update(heldout_score(model, held, window, byte_lengths))
        x["mqar_T"] = 100 * mqar_accuracy(model, bench, s["eval_rows"], T, s["pairs"], seed=20_000)
        x["mqar_4T"] = 100 * mqar_accuracy(model, bench, s["eval_rows"], 4 * T, s["pairs"], seed=20_001)
        x["niah_T"] = 100 * niah_accuracy(model, bench, s["eval_rows"], T, seed=20_002)
    long_ids = bench.text_windows("val", T * s["long"])[:s["time_rows"], :-1]
    timed = time_models([*models, model_variant(full, use_dsa=False)], long_ids, s["decode"], s["repeats"])
    for x, t in zip(rows, timed, strict=False):
        x.update(t)
        x["speedup_long"] = timed[0]["attn_ms_long"] / t["attn_ms_long"]
    return {"rows": rows, "dense_attn_ms_long": timed[-1]["attn_ms_long"], "dsa_attn_ms_long": timed[0]["attn_ms_long"]}


def _row(method: str, retention: float, model) -> dict:
    pattern = model.config.indexer_types
    return {"method": method, "retention": retention, "full_layers": sum(t == "full" for t in pattern),
            "pattern": "".join("F" if t == "full" else "s" for t in pattern)}


def heldout_score(model, rows_BT1: torch.Tensor, last: int, byte_lengths: torch.Tensor) -> dict:
    """NLL (nats/token) and bits per byte (`glm5lab.evals.bpb`) of the last `last` targets of each held-out row
    [N, T + 1] (`ablate.measure.labelled_nll`, the earlier targets ignored), DSA as the model's config has it."""
    labels = rows_BT1[:, 1:].clone()
    labels[:, :-last] = IGNORE_INDEX
    nll, tokens = labelled_nll(model, rows_BT1[:, :-1], labels)
    return {"heldout_loss": nll / tokens, "heldout_bpb": bits_per_byte(nll, target_bytes(byte_lengths, labels))}


def time_models(models: list, ids_BT: torch.Tensor, decode: int, repeats: int) -> list[dict]:
    """Per model: attention ms of one forward over ids_BT (`attention_time`), prefill ms and decode ms per token of
    `glm5lab.generate` on ids_BT's first row cut to leave `decode` new tokens of room; medians over `repeats`
    rounds, one forward of each model per round (round-robin, so load from other processes hits every model
    alike), one CPU thread."""
    from glm5lab import generate

    prompt = ids_BT[:1, :ids_BT.shape[1] - decode - 1].tolist()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = [{"attn_ms_long": [], "prefill_ms_long": [], "decode_ms_long": []} for _ in models]
    try:
        for _ in range(repeats):
            for t, m in zip(times, models, strict=True):
                t["attn_ms_long"].append(attention_time(m, ids_BT, 1)[0])
                stats = generate(m, prompt, decode).stats
                t["prefill_ms_long"].append(1e3 * stats.prefill_seconds)
                t["decode_ms_long"].append(1e3 / stats.decode_tokens_per_second)
    finally:
        torch.set_num_threads(threads)
    return [{k: statistics.median(v) for k, v in t.items()} for t in times]


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Train the base and branches per seed, search, score and time (module docstring); the StudyResult."""
    s, seeds = args.size_and_seeds(SIZES)
    per_seed, losses = {}, {}
    for seed in seeds:
        arms, losses[str(seed)] = train_arms(bench, s, seed, args.device)
        args.say(f"seed {seed}: base and {len(arms)} branches trained ({_steps(s)} steps), last {losses[str(seed)]}")
        per_seed[str(seed)] = measure_seed(arms, bench, s)
        args.say(f"seed {seed}: searched patterns " + ", ".join(
            x["pattern"] for x in per_seed[str(seed)]["rows"] if x["method"] == "searched"))
    settings = {"scale": args.size_key, "device": str(args.device), "size": s, "steps": _steps(s),
                "tokens": _steps(s) * s["T"] * s["batch"], "retentions": RETENTIONS, "equivalence_margin": EQUIV_MARGIN,
                "stages": {t: [st.to_dict() for st in dsa_stages(s, t)] for t in ("own", "served")},
                "branching": "one dense base per seed; each arm continues it at the warm-up with a fresh optimizer "
                             "on the batches the whole run would see",
                "calibration": {"data": "held-out text windows", "rows": s["calib_rows"], "length": s["T"] + 1,
                                "window": s["T"] - s["topk"]},
                "heldout": {"rows": s["eval_rows"], "length": s["T"] + 1, "targets": s["T"] - s["topk"]},
                "mqar": {"rows": s["eval_rows"], "num_kv_pairs": s["pairs"], "lengths": [s["T"], 4 * s["T"]]},
                "niah": {"rows": s["eval_rows"], "length": s["T"]},
                "timing": {"device": str(args.device), "threads": 1, "rounds": s["repeats"],
                           "long_length": s["T"] * s["long"], "long_rows": s["time_rows"], "decode_tokens": s["decode"]},
                "model": config(s).to_hf()}
    return result({"per_seed": per_seed, "last_losses": losses}, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of raw {"per_seed", "last_losses"} and settings alone (`run`, or merged seeds)."""
    per_seed, s = raw["per_seed"], settings["size"]
    return StudyResult("indexcache", table(per_seed, s), raw, settings, seeds, lambda path: plot(per_seed, s, path),
                       notes(per_seed, s))


def _steps(s: dict) -> int:
    return s["base_steps"] + (1 + len(TRAINED) * len(RETENTIONS)) * (s["W"] + s["A"])


def _collect(raw: dict, retention: float, method: str, key: str) -> list:
    return [x[key] for per in raw.values() for x in per["rows"] if x["retention"] == retention and x["method"] == method]


def _by_seed(raw: dict, retention: float, method: str, key: str = "heldout_loss") -> dict:
    return {seed: x[key] for seed, per in raw.items() for x in per["rows"]
            if x["retention"] == retention and x["method"] == method}


def verdicts(raw: dict) -> dict:
    """{(retention, claim): compare result} on the held-out loss (module docstring)."""
    out = {}
    for r in RETENTIONS:
        out[(r, "distillation below warm-up")] = compare(_by_seed(raw, r, "distillation"), _by_seed(raw, r, "warm-up"),
                                                          -1)
        out[(r, "distillation recovers full DSA")] = compare_equivalent(_by_seed(raw, r, "distillation"),
                                                                         _by_seed(raw, 1.0, "full"), EQUIV_MARGIN)
    return out


PAPER = {(1.0, "full"): "full DSA", (0.5, "distillation"): "training-aware", (0.5, "warm-up"): "no cross-layer loss"}


def _paper(r: float, m: str) -> str:
    fig = INDEXCACHE.get(PAPER.get((r, m)))
    return "-" if fig is None else " / ".join("-" if v is None else f"{v:.1f}" for v in fig)


KEYS = (("heldout_loss", 3), ("heldout_bpb", 3), ("mqar_T", 1), ("mqar_4T", 1), ("niah_T", 1), ("attn_ms_long", 1),
        ("prefill_ms_long", 1), ("decode_ms_long", 2), ("speedup_long", 2))


def table(raw: dict, s: dict) -> str:
    """Rows: full DSA, then retention x method; mean ± sd [95% t] over seeds; the paper's figures beside."""
    long = s["long"]
    head = ["retention", "method", "patterns", "held-out loss", "bpb", "MQAR % @T", "MQAR % @4T", "NIAH % @T",
            f"attn ms @{long}T", f"prefill ms @{long}T", f"decode ms/token @{long}T", f"attn speedup @{long}T",
            "paper (long / general avg)"]
    rows = []
    for r, m in [(1.0, "full"), *((r, m) for r in RETENTIONS for m in METHODS)]:
        pats = sorted(set(_collect(raw, r, m, "pattern")))
        rows.append([f"{r:g}", m, " ".join(f"`{p}`" for p in pats),
                     *[interval(_collect(raw, r, m, k)).text(d) for k, d in KEYS], _paper(r, m)])
    checks = [[f"{r:g}", claim, compare_text(c, 4)] for (r, claim), c in verdicts(raw).items()]
    dense = [per["dense_attn_ms_long"] for per in raw.values()]
    dsa = [per["dsa_attn_ms_long"] for per in raw.values()]
    lo, hi = DSA_ATTENTION_SPEEDUP
    ref = [["dense attention (use_dsa off)", interval(dense).text(1), "1.00", "-"],
           ["DSA, every indexer", interval(dsa).text(1), interval([d / x for d, x in zip(dense, dsa, strict=True)]).text(2),
            f"{lo:g}-{hi:g}x"]]
    return ("IndexCache: held-out quality, retrieval and time by retention and method, mean ± sd [95% t] over seeds; "
            f"the paper: {INDEXCACHE['source']}\n\n" + markdown_table(head, rows)
            + "\nVerdicts on the held-out loss, paired by seed (the paper's figures are for 1/2; 1/4 is judged by "
              "the same rule):\n\n" + markdown_table(["retention", "claim", "difference [95%]: verdict"], checks)
            + f"\nDSA vs dense attention time at {long}T (report: DSA cuts long-sequence attention compute "
              f"{lo:g}-{hi:g}x; ours, speedup - 1 over seeds: {compare_text(speedup(raw), 2)})\n\n"
            + markdown_table(["attention", f"attn ms @{long}T", "speedup vs dense (ours)", "paper"], ref))


def speedup(raw: dict) -> dict:
    """Dense / DSA attention time at the long length minus 1, per seed, against 0 (the report: DSA is faster, a
    positive sign), by `glm5lab.ablate.stats.compare`."""
    per_seed = {seed: per["dense_attn_ms_long"] / per["dsa_attn_ms_long"] - 1 for seed, per in raw.items()}
    return compare(per_seed, dict.fromkeys(per_seed, 0.0), +1)


def notes(raw: dict, s: dict) -> list[str]:
    """What the table can and cannot say."""
    diffs = [f"retention {r:g}: {m} minus searched {paired_difference(_collect(raw, r, m, 'heldout_loss'), _collect(raw, r, 'searched', 'heldout_loss')).text(4)}"
             for r in RETENTIONS for m in ("warm-up", "distillation")]
    return [f"The paper's figures ({INDEXCACHE['source']}) are benchmark averages of a 30B model, ours held-out "
            "losses of a miniature: compare directions, not values. The training-free rows have no paper figure "
            "in this table.",
            "Training-aware minus the training-free searched pattern, held-out loss paired by seed [95% t]: "
            + "; ".join(diffs) + ".",
            "Every trained arm (full DSA, warm-up, distillation) continues the same dense base with its own fresh "
            "optimizer on the same batches; the training-free rows are patterns of the full DSA arm, no training. "
            "Warm-up and distillation differ only in the indexers' target, so their difference is the cross-layer "
            "loss's effect.",
            "Times are CPU wall times (1 thread, round-robin over the rows, medians) on a shared machine: read the "
            "speedup column, not the milliseconds; the rows of one pattern (uniform, warm-up, distillation) should "
            "time alike, so their spread is the noise.",
            f"Lengths above the training length T = {s['T']} (4T MQAR, {s['long']}T timing) use untrained positions."]


def plot(raw: dict, s: dict, path) -> None:
    """Left: held-out loss vs retention per method (full DSA at 1); right: attention speedup at long x T."""
    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    full = {k: _collect(raw, 1.0, "full", k) for k in ("heldout_loss", "speedup_long")}
    for m, style in zip(METHODS, ("o-", "s--", "^-", "D-"), strict=True):
        for ax, key in ((a, "heldout_loss"), (b, "speedup_long")):
            vals = [full[key]] + [_collect(raw, r, m, key) for r in RETENTIONS]
            ax.errorbar((1.0, *RETENTIONS), [statistics.fmean(v) for v in vals], yerr=[interval(v).sd for v in vals],
                        fmt=style, capsize=3, label=m)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks((1.0, *RETENTIONS), ["1", "1/2", "1/4"])
        ax.set_xlabel("indexers kept (retention)")
        ax.legend()
    a.set(ylabel="held-out loss (nats/token), DSA on", title="quality (lower is better)")
    b.set(ylabel=f"attention speedup at {s['long']}T (x)", title="attention time vs full DSA")
    save_png(fig, path)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: held-out loss by method at 1/2 and
    the verdicts at 1/2, and DSA's speed against dense."""
    raw, s = info["raw"]["per_seed"], info["settings"]["size"]
    mean = {m: statistics.fmean(_collect(raw, 0.5, m, "heldout_loss")) for m in METHODS}
    v = verdicts(raw)
    paper = INDEXCACHE
    return {"paper": f"1/2 uniform: training-aware {_paper(0.5, 'distillation')} vs full DSA "
                     f"{_paper(1.0, 'full')}; without the cross-layer loss {paper['no cross-layer loss'][0]:.1f} "
                     "(long / general avg)",
            "ours": f"held-out loss at 1/2: full DSA {statistics.fmean(_collect(raw, 1.0, 'full', 'heldout_loss')):.3f}, "
                    + ", ".join(f"{m} {mean[m]:.3f}" for m in METHODS)
                    + f"; attention {statistics.fmean(_collect(raw, 0.5, 'uniform', 'speedup_long')):.2f}x faster at "
                      f"{s['T'] * s['long']} tokens",
            "verdict": "; ".join(f"{claim} (1/2): {compare_text(v[(0.5, claim)], 4)}"
                                 for claim in ("distillation below warm-up", "distillation recovers full DSA"))
                       + f"; DSA faster than dense (speedup - 1): {compare_text(speedup(raw), 2)}"}
