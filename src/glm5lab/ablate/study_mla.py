"""`glm5lab ablate mla`: GQA-8 vs MLA vs MLA + Muon Split vs MLA-256 + Muon Split at matched tokens
(the report's proxy ablation of attention shape and optimizer, `report_figures.MLA`).

Recipe: one `study_config` base (MTP off: the comparison is about attention), turned into the
report's proxy shapes by `models.variant_config` (dense attention, DSA off). Every variant and
seed trains the same number of steps on the same batches (seed s: init seed s, data seed s):
rows of Shakespeare text (next-token loss) mixed with fresh MQAR rows (answers only), one stage with a linear
warm-up and a linear decay to lr/10. Optimizers: "muon" (Muon on whole matrices) for GQA-8 and MLA, "muon-split"
(MLA's `q_b_proj` / `kv_b_proj` orthogonalised per attention head, as the report) for the two "+ Muon Split" rows.

GQA-8 is trained with "muon": `optim.groups.RULES` declares a per-head split only for MLA's up-
projections (q_b_proj, kv_b_proj, rows head-major); GQA's q/k/v/o_proj match the whole-matrix
Muon rule in either mode, so "muon-split" on GQA-8 is the same optimizer as "muon" (checked by
`same_groups_for_gqa`), and the report lists GQA-8 without Muon Split.

Scores (per variant and seed): validation text loss (`measure.labelled_loss` on the first `val_rows` windows
of the validation split, nats/token) and MQAR per-query accuracy (`measure.mqar_accuracy`, teacher forced) on
fresh seeded rows with the training length and number of key-value pairs. The mean and its 95% t-interval over
seeds are printed beside the report's seven benchmark accuracies and their mean; each variant's difference
from MLA is paired by seed and judged by `glm5lab.ablate.stats` (reproduced / opposite / inconclusive).
"""

from __future__ import annotations

import dataclasses
import statistics

from glm5lab.ablate.fit import STUDY_HYPER, decay_stage, fit
from glm5lab.ablate.measure import labelled_loss, mqar_accuracy
from glm5lab.ablate.models import meta_model, seeded_model, study_config, variant_config
from glm5lab.ablate.report_figures import MLA, MLA_BENCHMARKS, mean
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.stats import compare, compare_text, interval, per_seed, seed_mean, seed_values
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.workbench import Workbench
from glm5lab.train.stages import Stage

VARIANTS = {  # report row -> (variant_config shape, optimizer)
    "GQA-8": ("gqa-8", "muon"),
    "MLA": ("mla", "muon"),
    "MLA + Muon Split": ("mla", "muon-split"),
    "MLA-256 + Muon Split": ("mla-256", "muon-split"),
}
SIZES = {
    "quick": dict(layers=1, hidden=64, T=32, batch=8, task_rows=4, pairs=2, steps=5, lr=3e-3, val_rows=8,
                  eval_rows=16, seeds=1),
    "cpu": dict(layers=2, hidden=128, T=64, batch=16, task_rows=8, pairs=4, steps=600, lr=3e-3, val_rows=64,
                eval_rows=256, seeds=3),
    "gpu": dict(layers=12, hidden=768, T=2048, batch=16, task_rows=8, pairs=32, steps=3000, lr=2e-3, val_rows=64,
                eval_rows=256, seeds=3),
    "gpu-quick": dict(layers=4, hidden=768, T=2048, batch=2, task_rows=1, pairs=32, steps=1, lr=2e-3, val_rows=1,
                      eval_rows=1, seeds=1),
}
"""gpu: four ~60M-parameter 12-layer variants per seed, 3000 steps of 16 x 2048 tokens each (about
98M tokens; an estimated 4-6 GPU-hours for 3 seeds on one H100-class GPU, not measured);
gpu-quick: the gpu widths and lengths with 4 layers, one step (a CPU smoke run)."""
EVAL_SEED = 424_242
"""MQAR evaluation rows' seed: the same rows for every variant and seed, never a training row's seed."""


def configs(s: dict) -> dict:
    """Report row -> ModelConfig: `variant_config` of one base, study_config at size `s` without the MTP layer."""
    base = study_config(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_nextn_predict_layers=0,
                        max_position_embeddings=max(s["T"], 128))
    return {row: variant_config(base, shape) for row, (shape, _) in VARIANTS.items()}


def cache_values(cfg) -> int:
    """Values cached per token per layer: MLA latent + RoPE key, or GQA's K and V of every KV head."""
    return cfg.gqa_cache_width if cfg.attention_types and cfg.attention_types[0] == "gqa" else cfg.mla_cache_width


def same_groups_for_gqa(cfg) -> bool:
    """True when "muon-split" and "muon" give `cfg` the same parameter-group table (no split matrix)."""
    from glm5lab.optim.groups import param_group_table

    model = meta_model(cfg)
    return param_group_table(model, "muon-split") == param_group_table(model, "muon")


def stage(s: dict) -> Stage:
    """The one training stage: linear warm-up (5%), then lr -> lr/10; LM loss only."""
    return decay_stage("train", s["steps"], s["lr"], s["T"], s["batch"], s["steps"] // 20)


def train_and_score(bench: Workbench, cfg, optimizer: str, s: dict, seed: int, device="cpu") -> dict:
    """Train one variant for one seed (built on the CPU, trained on `device`) and score it;
    returns its raw numbers."""
    model = seeded_model(cfg, seed, device)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=seed)
    records = fit(model, [stage(s)], batches, hyper=dataclasses.replace(STUDY_HYPER, optimizer=optimizer), seed=seed)
    val_ids, val_labels = bench.val_text(s["T"], s["val_rows"])
    return {"val_loss": labelled_loss(model, val_ids, val_labels),
            "mqar_accuracy": mqar_accuracy(model, bench, s["eval_rows"], s["T"], s["pairs"], seed=EVAL_SEED),
            "last_train_loss": records[-1]["lm_loss"],
            "train_seconds": sum(r["seconds"] for r in records)}


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Train every variant for every seed at matched tokens, score them (module docstring); the StudyResult."""
    s, seeds = args.size_and_seeds(SIZES)
    cfgs = configs(s)
    raw = {row: {} for row in VARIANTS}
    for seed in seeds:
        for row, (_, optimizer) in VARIANTS.items():
            r = train_and_score(bench, cfgs[row], optimizer, s, seed, args.device)
            raw[row][str(seed)] = r
            args.say(f"seed {seed}: {row} val loss {r['val_loss']:.3f}, MQAR {r['mqar_accuracy']:.3f} "
                     f"({r['train_seconds']:.0f} s)")
    params = {row: sum(p.numel() for p in meta_model(cfg).parameters()) for row, cfg in cfgs.items()}
    tokens = s["steps"] * s["batch"] * s["T"]
    settings = {"scale": args.size_key, "device": str(args.device), "size": s, "steps": s["steps"], "tokens_per_variant": tokens,
                "text_tokens_per_variant": s["steps"] * (s["batch"] - s["task_rows"]) * s["T"],
                "stage": stage(s).to_dict(), "optimizers": {row: opt for row, (_, opt) in VARIANTS.items()},
                "gqa_muon_split_equals_muon": same_groups_for_gqa(cfgs["GQA-8"]),
                "params": params, "cache_values_per_token_per_layer": {r: cache_values(c) for r, c in cfgs.items()},
                "eval": {"val_text_rows": s["val_rows"], "mqar_rows": s["eval_rows"], "mqar_pairs": s["pairs"],
                         "mqar_seed": EVAL_SEED},
                "models": {row: cfg.to_hf() for row, cfg in cfgs.items()}}
    return result(raw, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them)."""
    return StudyResult("mla", table(raw, settings["params"], settings["cache_values_per_token_per_layer"]), raw,
                       settings, seeds, lambda path: plot(raw, path), notes(raw, settings))


def comparisons(raw: dict) -> dict:
    """{variant: {"report": its mean - MLA's, "loss": compare(...), "mqar": compare(...)}} for every variant but
    MLA: paired by seed against MLA (`glm5lab.ablate.stats.compare`), judged against the report's side (a better
    benchmark mean means a lower loss and a higher MQAR accuracy); None where the report's means are equal."""
    out = {}
    for row in VARIANTS:
        if row == "MLA":
            continue
        d_rep = mean(MLA[row]) - mean(MLA["MLA"])
        sign = 0 if d_rep == 0 else (1 if d_rep > 0 else -1)
        out[row] = {"report": d_rep,
                    **{name: compare(per_seed(raw[row], key), per_seed(raw["MLA"], key), side) if sign else None
                       for name, key, side in (("loss", "val_loss", -sign), ("mqar", "mqar_accuracy", sign))}}
    return out


def table(raw: dict, params: dict, cache: dict) -> str:
    """One row per variant: ours (mean, 95% t-interval over seeds), size, cache, the report's
    benchmarks and mean, and each difference vs MLA (params, cache: {variant: parameter count, cache values per
    token per layer} as settings hold them) with its paired interval and the verdict of
    `glm5lab.ablate.stats` (reproduced / opposite / inconclusive at n seeds)."""
    head = ["variant", "optimizer", "val loss (nats) [95% t]", "MQAR acc [95% t]", "params",
            "cache values/token/layer", *MLA_BENCHMARKS, "paper mean", "paper vs MLA",
            "ours vs MLA: val loss, paired [95% t]: verdict", "ours vs MLA: MQAR, paired [95% t]: verdict"]
    rows, cmps = [], comparisons(raw)
    for row, (_, opt) in VARIANTS.items():
        rep = MLA[row]
        if row == "MLA":
            cmp = ["reference", "-", "-"]
        else:
            c = cmps[row]
            cmp = [f"{c['report']:+.2f}", *["-" if c[k] is None else compare_text(c[k]) for k in ("loss", "mqar")]]
        rows.append([row, opt, interval(seed_values(raw[row], "val_loss")).text(),
                     interval(seed_values(raw[row], "mqar_accuracy")).text(), params[row], cache[row],
                     *[f"{v:.1f}" for v in rep], f"{mean(rep):.2f}", *cmp])
    return ("Validation text loss and MQAR per-query accuracy (mean ± sd [95% t-interval] over seeds) beside the "
            "report's proxy ablation (accuracy %). Verdicts: reproduced / opposite when the paired 95% interval of "
            "the difference excludes zero on the report's / the other side, else inconclusive (with the seeds "
            "the observed spread would need).\n\n" + markdown_table(head, rows))


def ranking(values: dict, *, higher_is_better: bool) -> list[str]:
    """Rows sorted best first."""
    return sorted(values, key=values.get, reverse=higher_is_better)


def notes(raw: dict, settings: dict) -> list[str]:
    """The orderings of the means beside the report's (described, not judged), Muon Split's verdict,
    the GQA optimizer choice, the scale caveat."""
    rep = ranking({row: mean(MLA[row]) for row in VARIANTS}, higher_is_better=True)
    by_loss = ranking({row: seed_mean(raw[row], "val_loss") for row in VARIANTS}, higher_is_better=False)
    by_acc = ranking({row: seed_mean(raw[row], "mqar_accuracy") for row in VARIANTS}, higher_is_better=True)
    out = [f"Report ordering by mean benchmark accuracy: {' > '.join(rep)}."]
    for name, order in (("validation loss", by_loss), ("MQAR accuracy", by_acc)):
        out.append(f"Our ordering of the means by {name}: {' > '.join(order)} (Spearman rho {spearman(order, rep):+.2f} "
                   "against the report's; a description, not a verdict: the pairwise verdicts are in the table).")
    ms = comparisons(raw)["MLA + Muon Split"]["loss"]
    out.append(f"Muon Split on MLA, validation loss (nats) vs MLA: {compare_text(ms)} (report: mean "
               f"{mean(MLA['MLA + Muon Split']) - mean(MLA['MLA']):+.2f} points, an improvement).")
    out.append("GQA-8 trains with whole-matrix Muon: Muon Split's per-head rule covers only MLA's q_b_proj / "
               "kv_b_proj, so on GQA-8 'muon-split' equals 'muon' (parameter-group tables equal: "
               f"{settings['gqa_muon_split_equals_muon']}).")
    out.append(f"Matched tokens: every variant and seed trains {settings['steps']} steps of "
               f"{settings['size']['batch']} x {settings['size']['T']} tokens ({settings['tokens_per_variant']} "
               f"tokens, {settings['text_tokens_per_variant']} of them text); a difference smaller than the sd "
               "across seeds is not an ordering.")
    out.append("The report's figures are benchmark accuracies of billion-parameter proxies; ours are the loss and "
               "retrieval of CPU-sized models trained for minutes: compare orderings, not values.")
    return out


def spearman(order: list[str], reference: list[str]) -> float:
    """Spearman rank correlation of two orderings of the same names (no ties)."""
    n = len(order)
    if n < 2:
        return 1.0
    d2 = sum((order.index(x) - reference.index(x)) ** 2 for x in order)
    return 1 - 6 * d2 / (n * (n * n - 1))


def plot(raw: dict, path) -> None:
    """Three panels per variant: our validation loss and MQAR accuracy (error bars: sd over
    seeds, dots: seeds), and the report's mean benchmark accuracy."""
    plt = figure()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    rows, x = list(VARIANTS), range(len(VARIANTS))
    for ax, key, label in ((axes[0], "val_loss", "validation loss (nats/token)"),
                           (axes[1], "mqar_accuracy", "MQAR per-query accuracy")):
        vals = [seed_values(raw[row], key) for row in rows]
        ax.bar(x, [statistics.fmean(v) for v in vals], yerr=[interval(v).sd for v in vals], capsize=4,
               color="tab:blue", alpha=0.6, label="ours, mean ± sd")
        for i, v in enumerate(vals):
            ax.plot([i] * len(v), v, "k.", label="seeds" if i == 0 else None)
        lo = min(min(v) for v in vals)
        if key == "val_loss":
            ax.set_ylim(lo - 0.1, max(max(v) for v in vals) + 0.1)
        ax.set(ylabel=label, title=f"ours: {label.split(' (')[0]}")
    axes[2].bar(x, [mean(MLA[row]) for row in rows], color="tab:orange", label="report: mean of 7 benchmarks")
    axes[2].set_ylim(55, 61)
    axes[2].set(ylabel="accuracy (%)", title="paper: proxy ablation")
    for ax in axes:
        ax.set_xticks(list(x), [r.replace(" + ", "\n+ ") for r in rows], fontsize=8)
        ax.set_xlabel("variant")
        ax.legend(fontsize=8)
    save_png(fig, path)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: the report's means,
    our validation loss and MQAR means, every variant's verdict vs MLA on validation loss."""
    raw = info["raw"]
    rep = ranking({row: mean(MLA[row]) for row in VARIANTS}, higher_is_better=True)
    loss = ranking({row: seed_mean(raw[row], "val_loss") for row in VARIANTS}, higher_is_better=False)
    cmps = comparisons(raw)
    return {"paper": "mean of 7 benchmarks: " + ", ".join(f"{r} {mean(MLA[r]):.1f}" for r in rep),
            "ours": "validation loss (nats): " + ", ".join(f"{r} {seed_mean(raw[r], 'val_loss'):.3f}" for r in loss)
                    + "; MQAR accuracy: " + ", ".join(f"{r} {seed_mean(raw[r], 'mqar_accuracy'):.2f}" for r in VARIANTS),
            "verdict": "; ".join(f"{r} vs MLA (loss): {compare_text(c['loss'])}" for r, c in cmps.items()
                                 if c["loss"] is not None)}
