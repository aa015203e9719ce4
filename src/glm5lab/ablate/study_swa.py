"""`glm5lab ablate swa`: full attention vs 1:1 SWA interleave vs searched SWA, no extra training.

Counterpart of the report's training-free SWA table (`report_figures.SWA`: retrieval score by
context length 4K..128K). Per seed we train one full-attention GQA base (study_config at CPU
scale, `variant_config(.., "gqa-8")`: DSA off, no MTP) on text + MQAR + NIAH rows of T tokens,
then, with no further training, score three layer patterns on the same weights:
  full          every layer full attention;
  1:1 SWA       `interleave_pattern(L)` (swa, full, swa, full, ...), window w;
  searched SWA  `search_swa` (beam 8, 2 layers per round, until half the layers are SWA),
                scored by MQAR + NIAH at length T > w on rows drawn apart from the evaluation's.
Retrieval at lengths w, 2w, T, 2T (2T is beyond training, as the report's longest contexts are
hard for full attention too): MQAR per-query accuracy and NIAH (single needle, noise haystack)
exact match, both teacher forced (`glm5lab.ablate.measure`); score = 100 x their mean.

The base, its sizes and its scoring are `glm5lab.ablate.gqa_base`'s, shared with `study_efficient`.
"""

from __future__ import annotations

import statistics

from glm5lab.ablate import report_figures as rf
from glm5lab.ablate.gqa_base import SIZES, base_config, base_stage, retrieval, search_pattern, train_base
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.stats import compare, compare_text, interval
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.workbench import Workbench
from glm5lab.evals.search_swa import interleave_pattern, with_mixers

VARIANTS = ("full", "1:1 SWA", "searched SWA")


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Train the base per seed, search, score full / 1:1 / searched (module docstring); the StudyResult."""
    sz, seeds = args.size_and_seeds(SIZES)
    raw: dict = {v: {} for v in VARIANTS}
    searches, curves = {}, {}
    for seed in seeds:
        args.say(f"seed {seed}: training the full-attention base ({sz['steps']} steps of {sz['batch']} x "
                 f"{sz['seq_len']})")
        model, records = train_base(bench, sz, seed=seed, device=args.device)
        curves[str(seed)] = [round(r["lm_loss"], 4) for r in records]
        found = search_pattern(model, bench, sz, seed=seed)
        searches[str(seed)] = {"mixer_types": found.mixer_types, "swa_layers": list(found.swa_layers),
                          "search_score": found.score, "full_score": found.full_score,
                          "evaluations": found.evaluations}
        args.say(f"seed {seed}: searched SWA layers {list(found.swa_layers)} ({found.evaluations} evaluations)")
        patterns = {"full": (None, None), "1:1 SWA": (interleave_pattern(sz["layers"]), sz["window"]),
                    "searched SWA": (found.mixer_types, sz["window"])}
        for name, (mixers, window) in patterns.items():
            m = model if mixers is None else with_mixers(model, mixers, window)
            raw[name][str(seed)] = {str(n): retrieval(m, bench, sz, n, seed=seed) for n in sz["lengths"]}
    settings = {"scale": args.size_key, "device": str(args.device), "sizes": sz, "base_config": base_config(sz).to_hf(), "stage": base_stage(sz).to_dict(),
                "base_tokens": sz["steps"] * sz["batch"] * sz["seq_len"], "patterns": {
                    "1:1 SWA": interleave_pattern(sz["layers"]), "searched SWA": searches},
                "search": "search_swa beam 8, per_round 2, target_fraction 0.5, score = mean(MQAR, NIAH) token "
                          f"accuracy at {sz['seq_len']} tokens", "train_curves_lm": curves}
    return result(raw, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them)."""
    sz = settings["sizes"]
    table, notes = _table(raw, sz, settings["patterns"]["searched SWA"], seeds)
    return StudyResult("swa", table, raw, settings, seeds, lambda p: _plot(raw, sz, seeds, p), notes)


def _mean(raw_v: dict, seeds, n: int, key: str = "score") -> float:
    return statistics.fmean(raw_v[str(s)][str(n)][key] for s in seeds)


def comparison(raw: dict, v: str, beyond: list[int], seeds: list[int]) -> dict:
    """Variant v against full attention: per seed, the mean score change over the lengths above
    the window, paired by seed (the same model and rows per seed), judged against the sign of the
    report's mean change above 4K (`glm5lab.ablate.stats.compare`, plus "report": that change)."""
    d_rep = rf.mean([a - b for a, b in zip(rf.SWA[v][1:], rf.SWA["full"][1:], strict=True)])
    per_seed = {s: statistics.fmean(raw[v][str(s)][str(n)]["score"] - raw["full"][str(s)][str(n)]["score"]
                                    for n in beyond) for s in seeds}
    return {"report": d_rep, **compare(per_seed, dict.fromkeys(seeds, 0.0), 1 if d_rep > 0 else -1)}


def _table(raw: dict, sz: dict, searches: dict, seeds: list[int]) -> tuple[str, list[str]]:
    beyond = [n for n in sz["lengths"] if n > sz["window"]]
    headers = (["variant"] + [f"ours {n}" for n in sz["lengths"]] + [f"paper {c}" for c in rf.CONTEXTS]
               + ["paper vs full (> 4K)", "ours vs full (> w), paired [95% t]: verdict"])
    rows = []
    for v in VARIANTS:
        ours = [interval([raw[v][str(s)][str(n)]["score"] for s in seeds]).text(1) for n in sz["lengths"]]
        if v == "full":
            rows.append([v, *ours, *rf.SWA[v], "-", "-"])
            continue
        c = comparison(raw, v, beyond, seeds)
        rows.append([v, *ours, *rf.SWA[v], f"{c['report']:+.1f}", compare_text(c, 1)])
    text = (f"Retrieval score (100 x mean of MQAR accuracy and NIAH exact match) by context length in tokens; "
            f"ours: window w = {sz['window']}, trained at T = {sz['seq_len']}, no extra training; "
            f"report: 4K..128K. Mean ± sd [95% t-interval] over seeds {seeds}; the change vs full is each seed's mean "
            f"over the lengths above the window, paired by seed (`glm5lab.ablate.stats`).\n\n"
            + markdown_table(headers, rows))
    detail = [[v, task, *[interval([raw[v][str(s)][str(n)][task] for s in seeds]).text() for n in sz["lengths"]]]
              for v in VARIANTS for task in ("mqar", "niah")]
    text += ("\nPer task (accuracy in [0, 1], mean ± sd [95% t]):\n\n"
             + markdown_table(["variant", "task", *map(str, sz["lengths"])], detail))
    pats = [[s, "".join("S" if m == "swa" else "F" for m in searches[str(s)]["mixer_types"]),
             searches[str(s)]["swa_layers"], searches[str(s)]["evaluations"]] for s in seeds]
    text += "\nSearched patterns (F full, S SWA; 1:1 SWA = " + "".join(
        "S" if m == "swa" else "F" for m in interleave_pattern(sz["layers"])) + "):\n\n" + markdown_table(
        ["seed", "pattern", "SWA layers", "search evaluations"], pats)
    return text, _notes(raw, sz, seeds)


def _per_seed(raw_v: dict, seeds, n: int) -> dict:
    return {s: raw_v[str(s)][str(n)]["score"] for s in seeds}


def _notes(raw: dict, sz: dict, seeds: list[int]) -> list[str]:
    """The report's two shapes, each judged by the verdict rule (paired by seed): 1:1 SWA collapses beyond the
    window (its score at T minus at w; the report's 94.87 -> 12.61 is negative), and searched SWA beats 1:1
    SWA at every length above the window (report: positive at every length above 4K)."""
    T, w = sz["seq_len"], sz["window"]
    full, one, srch = (_mean(raw[v], seeds, T) for v in VARIANTS)
    notes = [f"at T = {T} (> w = {w}): full {full:.1f}, 1:1 SWA {one:.1f}, searched SWA {srch:.1f}; searched keeps "
             f"{_pct(srch, full)} of full (report at 32K: {_pct(rf.SWA['searched SWA'][3], rf.SWA['full'][3])}, "
             f"at 128K: {_pct(rf.SWA['searched SWA'][5], rf.SWA['full'][5])})."]
    collapse = compare(_per_seed(raw["1:1 SWA"], seeds, T), _per_seed(raw["1:1 SWA"], seeds, w), -1)
    notes.append(f"1:1 SWA beyond the window, score at T = {T} minus at w = {w}, paired [95% t]: "
                 f"{compare_text(collapse, 1)} (report: 94.87 at 4K -> 12.61 at 32K).")
    for n in (n for n in sz["lengths"] if n > w):
        c = compare(_per_seed(raw["searched SWA"], seeds, n), _per_seed(raw["1:1 SWA"], seeds, n), 1)
        notes.append(f"searched SWA vs 1:1 SWA at {n} tokens, paired [95% t]: {compare_text(c, 1)} "
                     "(report: searched above 1:1 at every length above 4K).")
    if full < 10:
        notes.append(f"the base scores only {full:.1f} at T = {T}: it has not learned retrieval, so the comparison "
                     "above says little (expected for --quick).")
    notes.append("within the window (length w) SWA changes nothing, so all three rows agree there (as the report's "
                 "4K column, where they are within 1 point).")
    return notes


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.0f}%" if b else "n/a (full is 0)"


def _plot(raw: dict, sz: dict, seeds: list[int], path) -> None:
    plt = figure()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for v in VARIANTS:
        ax.plot(sz["lengths"], [_mean(raw[v], seeds, n) for n in sz["lengths"]], marker="o", label=v)
        bx.plot(range(len(rf.CONTEXTS)), rf.SWA[v], marker="o", label=v)
    ax.axvline(sz["window"], color="grey", ls=":", label=f"window {sz['window']}")
    ax.axvline(sz["seq_len"], color="grey", ls="--", label=f"train length {sz['seq_len']}")
    ax.set(xscale="log", xlabel="context length (tokens)", ylabel="retrieval score (%)",
           title=f"ours (no extra training, {len(seeds)} seed(s))", ylim=(-2, 102))
    ax.set_xticks(sz["lengths"], [str(n) for n in sz["lengths"]])
    bx.set_xticks(range(len(rf.CONTEXTS)), rf.CONTEXTS)
    bx.set(xlabel="context length", ylabel="score", title="paper (no extra training)", ylim=(-2, 102))
    ax.legend()
    bx.legend()
    save_png(fig, path, dpi=100)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: scores at the
    training length per variant, searched and 1:1 vs full, and the 1:1 collapse."""
    raw, seeds, sz = info["raw"], info["seeds"], info["settings"]["sizes"]
    beyond, T, w = [n for n in sz["lengths"] if n > sz["window"]], sz["seq_len"], sz["window"]
    collapse = compare(_per_seed(raw["1:1 SWA"], seeds, T), _per_seed(raw["1:1 SWA"], seeds, w), -1)
    return {"paper": "32K: " + ", ".join(f"{v} {rf.SWA[v][3]:.1f}" for v in VARIANTS),
            "ours": f"retrieval score at T = {T} ({T // w}x the window): "
                    + ", ".join(f"{v} {_mean(raw[v], seeds, T):.1f}" for v in VARIANTS),
            "verdict": "; ".join(f"{v} vs full (mean over lengths > w): {compare_text(comparison(raw, v, beyond, seeds), 1)}"
                                 for v in VARIANTS[1:]) + f"; 1:1 collapses beyond w: {compare_text(collapse, 1)}"}
