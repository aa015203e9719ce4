"""`glm5lab ablate dsa`: dense vs indexer warm-up only vs full sparse adaptation, retrieval by
context length (the report's DSA adaptation ablation on GLM-4.7-Flash, `report_figures.DSA`).

Recipe (the report's DSA section, `glm5lab.train.recipe.default_stages` at study scale): one dense base is
pre-trained on mixed text + MQAR rows of length T (study_config with a "full" indexer on every layer, DSA off,
no MTP layer). Three arms then get the same number of further steps (W + A, the same batches):
  dense:            W + A more dense steps (everything trains, LM loss), evaluated dense;
  warm-up only:     W + A steps of indexer warm-up (only the indexers train, on the KL to the
                    head-summed dense attention; LM weight 0), evaluated with DSA on;
  full adaptation:  W steps of the same warm-up, then A steps of sparse adaptation (DSA on,
                    everything trains, LM loss + indexer KL on the selected keys), evaluated
                    with DSA on.
Score: MQAR per-query accuracy (`measure.mqar_accuracy`, teacher forced, in %) on fresh seeded rows with the
training number of key-value pairs at lengths T, 2T, 4T, 8T (above the training length included), the same
rows for every arm. `index_topk` is fixed, so the sparse arms attend to a shrinking fraction (index_topk /
length) of the keys. The base model, evaluated dense, is printed as a reference row.

Verdicts: "warm-up only falls behind dense" is a difference claim (the rule of
`glm5lab.ablate.stats.compare`); "full adaptation recovers dense" is an equivalence claim, judged
by two one-sided tests at +-RECOVERY_MARGIN points (`compare_equivalent`).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics

from glm5lab.ablate.fit import dsa_stages, fit
from glm5lab.ablate.measure import mqar_accuracy
from glm5lab.ablate.models import seeded_model, study_config
from glm5lab.ablate.report_figures import CONTEXTS, DSA, DSA_128K
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.stats import compare, compare_equivalent, compare_text, interval
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.workbench import Workbench
from glm5lab.train.stages import Stage

RECOVERY_MARGIN = 2.0
"""Points of MQAR accuracy within which full adaptation counts as recovering dense (the report's
-0.35 at 128K is recovery, -7.86 for warm-up only is not: the margin is a quarter of the latter)."""
ARMS = ("dense", "warm-up only", "full adaptation")
EVAL_DSA = {"base (before)": False, "dense": False, "warm-up only": True, "full adaptation": True}
SIZES = {  # T: training length; topk: index_topk; W, A: warm-up and adaptation steps; seeds: unless --seeds
    "quick": dict(layers=2, hidden=64, T=32, topk=8, pairs=2, batch=8, task_rows=6, base_steps=30, W=6, A=10,
                  lr=3e-3, adapt_lr=1e-3, eval_rows=16, scales=(1, 2, 4), seeds=1),
    "cpu": dict(layers=2, hidden=128, T=64, topk=16, pairs=4, batch=16, task_rows=12, base_steps=1200, W=100,
                A=300, lr=3e-3, adapt_lr=1e-3, eval_rows=128, scales=(1, 2, 4, 8), seeds=3),
    "gpu": dict(layers=12, hidden=768, T=2048, topk=256, pairs=32, batch=16, task_rows=8, base_steps=3000, W=200,
                A=800, lr=2e-3, adapt_lr=5e-4, eval_rows=128, scales=(1, 2, 4), seeds=3),
    "gpu-quick": dict(layers=4, hidden=768, T=2048, topk=256, pairs=32, batch=1, task_rows=1, base_steps=1, W=1,
                      A=1, lr=2e-3, adapt_lr=5e-4, eval_rows=1, scales=(1, 2), seeds=1),
}
"""gpu: a ~60M-parameter base at 2K tokens (top-256, 1/8 of the keys), MQAR up to 8K (1/32): an
estimated 2-3 GPU-hours per seed on one H100-class GPU, not measured; gpu-quick: the gpu widths and
lengths with 4 layers, one step per stage."""


def config(s: dict):
    """study_config at size `s`: a "full" indexer on every layer, DSA off in the config (the stages and the
    evaluation switch it per call), no MTP layer, positions up to the longest evaluated length."""
    return study_config(num_hidden_layers=s["layers"], hidden_size=s["hidden"], index_topk=s["topk"],
                        num_nextn_predict_layers=0, use_dsa=False, max_position_embeddings=s["T"] * max(s["scales"]))


def stages(s: dict) -> dict[str, list[Stage]]:
    """The base's stage and each arm's further stages (see the module doc), from `fit.dsa_stages`; sparse
    adaptation and the dense continuation share one constant lr."""
    dense, warm, sparse = dsa_stages(s)
    return {"base": [dense], "dense": [Stage("dense_continued", s["W"] + s["A"], s["adapt_lr"], s["T"], s["batch"],
                                             mtp_weights=())],
            "warm-up only": [dataclasses.replace(warm, steps=s["W"] + s["A"])], "full adaptation": [warm, sparse]}


def train_arms(bench: Workbench, s: dict, seed: int, say, device="cpu") -> tuple[dict, dict]:
    """Train the base (built on the CPU, trained on `device`) and the three arms for one seed. Returns ({row: model} with the base as
    "base (before)", {row: last step's losses})."""
    plan = stages(s)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=seed)
    base = seeded_model(config(s), seed, device)
    logs = {"base (before)": _last(fit(base, plan["base"], batches, seed=seed))}
    say(f"seed {seed}: base trained, {s['base_steps']} dense steps, last {logs['base (before)']}")
    further = lambda si, stage, i: batches(1 + si, stage, i)  # noqa: E731  (batches the base never saw)
    models = {"base (before)": base}
    for arm in ARMS:
        models[arm] = copy.deepcopy(base)
        logs[arm] = _last(fit(models[arm], plan[arm], further, seed=seed))
        say(f"seed {seed}: {arm} trained, last {logs[arm]}")
    return models, logs


def _last(records: list[dict]) -> dict:
    r = records[-1]
    return {"stage": r["stage"], "lm_loss": round(r["lm_loss"], 4),
            "indexer_kl": None if r["indexer_kl"] is None else round(r["indexer_kl"], 4)}


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Train the base and the three arms per seed, score MQAR by length (module docstring); the StudyResult."""
    s, seeds = args.size_and_seeds(SIZES)
    lengths = [s["T"] * k for k in s["scales"]]
    raw = {row: {str(n): [] for n in lengths} for row in EVAL_DSA}
    losses = {}
    for seed in seeds:
        models, losses[str(seed)] = train_arms(bench, s, seed, args.say, args.device)
        for row, model in models.items():
            for n in lengths:
                acc = mqar_accuracy(model, bench, s["eval_rows"], n, s["pairs"], seed=10_000 + n, use_dsa=EVAL_DSA[row])
                raw[row][str(n)].append(100 * acc)
    plan = stages(s)
    settings = {"scale": args.size_key, "device": str(args.device), "recovery_margin": RECOVERY_MARGIN,
                "size": s, "lengths": lengths, "index_topk": s["topk"],
                "topk_fraction": {str(n): s["topk"] / n for n in lengths},
                "tokens_per_step": s["T"] * s["batch"], "base_tokens": s["base_steps"] * s["T"] * s["batch"],
                "further_tokens_per_arm": (s["W"] + s["A"]) * s["T"] * s["batch"],
                "stages": {k: [st.to_dict() for st in v] for k, v in plan.items()},
                "eval": {"task": "MQAR per-query accuracy %", "rows": s["eval_rows"], "num_kv_pairs": s["pairs"],
                         "use_dsa": EVAL_DSA, "row_seed": "10000 + length"},
                "model": config(s).to_hf()}
    return result({"mqar_accuracy_pct": raw, "last_losses": losses}, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them):
    raw["mqar_accuracy_pct"][arm][length] lists one accuracy per seed, in `seeds` order."""
    acc, lengths, s = raw["mqar_accuracy_pct"], settings["lengths"], settings["size"]
    return StudyResult("dsa", tables(acc, lengths), raw, settings, seeds, lambda path: plot(acc, lengths, path),
                       notes(acc, lengths, s))


def comparison(raw: dict, row: str, lengths: list[int]) -> dict:
    """`row` against the dense arm at the longest length, paired by seed (the arms share the base model and data
    of each seed): "full adaptation" as the report's equivalence claim (`compare_equivalent` at +-RECOVERY_MARGIN
    points), the others against the sign of the report's 128K difference (`glm5lab.ablate.stats.compare`)."""
    n = str(lengths[-1])
    a, b = dict(enumerate(raw[row][n])), dict(enumerate(raw["dense"][n]))
    if row == "full adaptation":
        return compare_equivalent(a, b, RECOVERY_MARGIN)
    d_rep = DSA[row][-1] - DSA["dense"][-1]
    return compare(a, b, 1 if d_rep > 0 else -1)


def tables(raw: dict, lengths: list[int]) -> str:
    """Ours (rows: arms, columns: lengths, mean ± sd [95% t-interval] over seeds) beside the report's
    4K..128K, the difference vs dense at the longest length with its paired interval and verdict
    (`glm5lab.ablate.stats`), and the report's 128K MLA vs DSA."""
    head = ["arm", "eval"] + [f"T={n}" for n in lengths] + [f"paper {c}" for c in CONTEXTS] + \
        ["paper 128K vs dense", f"ours vs dense at {lengths[-1]}, paired [95% t]: verdict"]
    rows = []
    for row in EVAL_DSA:
        ours = [interval(raw[row][str(n)]).text(1) for n in lengths]
        rep = list(DSA.get(row, (None,) * len(CONTEXTS)))
        if row in DSA and row != "dense":
            cmp = [f"{DSA[row][-1] - DSA['dense'][-1]:+.2f}", compare_text(comparison(raw, row, lengths), 1)]
        else:
            cmp = ["reference", "-"]
        rows.append([row, "DSA" if EVAL_DSA[row] else "dense", *ours, *rep, *cmp])
    b = DSA_128K["benchmarks"]
    last = {arm: statistics.fmean(raw[arm][str(lengths[-1])]) for arm in ("dense", "full adaptation")}
    rows128 = [["MLA (dense)", *DSA_128K["MLA"], f"dense arm: {last['dense']:.1f}"],
               ["DSA", *DSA_128K["DSA"], f"full adaptation: {last['full adaptation']:.1f}"]]
    return ("MQAR accuracy (%) by context length; report: long-context retrieval score (GLM-4.7-Flash)\n\n"
            + markdown_table(head, rows)
            + f"\nReport at 128K, MLA vs DSA (ours: MQAR at {lengths[-1]})\n\n"
            + markdown_table(["model", *b, "ours"], rows128))


def notes(raw: dict, lengths: list[int], s: dict) -> list[str]:
    """Direction notes: does full adaptation recover dense; does warm-up only fall behind at the
    longest length (the report: yes, -0.35 and -7.86 points at 128K)."""
    full, warm = (comparison(raw, arm, lengths) for arm in ("full adaptation", "warm-up only"))
    rep_full, rep_warm = DSA["full adaptation"][-1] - DSA["dense"][-1], DSA["warm-up only"][-1] - DSA["dense"][-1]
    out = [f"Training length T = {s['T']}, index_topk = {s['topk']}: at {lengths[-1]} tokens the sparse arms keep "
           f"{100 * s['topk'] / lengths[-1]:.1f}% of the keys; lengths above T use positions never trained on "
           "(RoPE without scaling), for every arm.",
           f"Full adaptation vs dense at {lengths[-1]} (points): {compare_text(full, 1)} (report at 128K: "
           f"{rep_full:+.2f}: it recovers dense; judged as equivalence within +-{RECOVERY_MARGIN:g} points, "
           "two one-sided tests on the paired 90% interval).",
           f"Warm-up only vs dense at {lengths[-1]} (points): {compare_text(warm, 1)} (report at 128K: "
           f"{rep_warm:+.2f}, it falls behind).",
           "Warm-up only trains only the indexers: its attention and FFN weights are the base model's, so it also "
           "misses the W + A further LM steps the other arms get (as in the report, where warm-up leaves the model "
           "frozen).",
           "The report's figures are a long-context benchmark average of a 30B-class model at 4K..128K; ours is "
           "MQAR on a CPU-sized model at T..8T: compare shapes, not values."]
    return out


def plot(raw: dict, lengths: list[int], path) -> None:
    """Left: our accuracy vs length per arm (error bars: sd over seeds). Right: the report's."""
    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colour = {"base (before)": "grey", "dense": "tab:blue", "warm-up only": "tab:orange", "full adaptation": "tab:green"}
    for row in EVAL_DSA:
        vals = [raw[row][str(n)] for n in lengths]
        a.errorbar(lengths, [sum(v) / len(v) for v in vals], yerr=[interval(v).sd for v in vals], marker="o",
                   capsize=3, color=colour.get(row), label=f"{row} ({'DSA' if EVAL_DSA[row] else 'dense'})",
                   linestyle="--" if row == "base (before)" else "-")
    a.axvline(lengths[0], color="grey", lw=0.8)
    a.set_xscale("log", base=2)
    a.minorticks_off()
    a.set(xlabel="context length (tokens; grey: training length)", ylabel="MQAR accuracy (%)",
          title="ours", xticks=lengths, xticklabels=[str(n) for n in lengths])
    for row, vals in DSA.items():
        b.plot(range(len(CONTEXTS)), vals, marker="o", label=row, color=colour.get(row))
    b.set(xticks=range(len(CONTEXTS)), xticklabels=CONTEXTS, xlabel="context length", ylabel="retrieval score",
          title="paper (GLM-4.7-Flash)")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    save_png(fig, path)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: MQAR at the longest
    length per arm and the two verdicts (recovery as equivalence within +-RECOVERY_MARGIN)."""
    raw, lengths = info["raw"]["mqar_accuracy_pct"], info["settings"]["lengths"]
    n = lengths[-1]
    means = {arm: statistics.fmean(raw[arm][str(n)]) for arm in ARMS}
    return {"paper": "128K: " + ", ".join(f"{arm} {DSA[arm][-1]:.1f}" for arm in ARMS),
            "ours": f"MQAR % at {n} tokens ({n // lengths[0]}x the training length): "
                    + ", ".join(f"{arm} {means[arm]:.1f}" for arm in ARMS),
            "verdict": f"full adaptation recovers dense: {compare_text(comparison(raw, 'full adaptation', lengths), 1)}; "
                       f"warm-up only falls behind: {compare_text(comparison(raw, 'warm-up only', lengths), 1)}"}
