"""`glm5lab ablate efficient`: SWA interleave, searched SWA, Gated DeltaNet and SimpleGDN after
equal further training, as change versus full attention.

Counterpart of the report's efficient-attention table (`report_figures.EFFICIENT`: change vs full
attention at 128K on RULER / MRCR / HELMET / RepoQA after 190B tokens of training at 64K). Per
seed: train the full-attention GQA base of `study_swa` (`gqa_base.train_base`) at T tokens,
search its SWA pattern (`gqa_base.search_pattern`), then build five models from its weights:
  full attention   the base, unchanged;
  SWA interleave   `interleave_pattern(L)` (swa, full, ...) with window w;
  searched SWA     the searched pattern, window w;
  Gated DeltaNet   mixer "gdn" on the SWA layers of the 1:1 pattern: those layers' token mixers
                   are new (initialised as `GLM5ForCausalLM` does, torch seed = the seed), the
                   rest loads from the base;
  SimpleGDN        mixer "simple_gdn" on the same layers, its q/k/v/o loaded from the base's GQA
                   projections (`load_state_dict(strict=False)`, as `SimpleGDN.from_gqa`); only
                   the decay / write-strength parameters are new.
Each gets the same further training: one `fit` stage on identical batches (text + MQAR + NIAH
rows) of 2T tokens (the report continues at a longer length too), same steps, lr and optimizer.
Scored with full forwards only (GDN layers have no decode cache): MQAR accuracy and NIAH exact
match at 2T and 4T (both above the window; 4T also above the further-training length, as the
report scores 128K after 64K training), and validation text loss at 2T (nats/token).
"""

from __future__ import annotations

import copy
import statistics

import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.ablate import report_figures as rf
from glm5lab.ablate.fit import decay_stage, fit
from glm5lab.ablate.gqa_base import SIZES as BASE_SIZES
from glm5lab.ablate.gqa_base import base_config, retrieval, search_pattern, task_batches, train_base
from glm5lab.ablate.measure import labelled_loss
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.stats import compare, compare_text, interval, paired_difference
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.workbench import Workbench
from glm5lab.train.stages import Stage
from glm5lab.evals.search_swa import interleave_pattern

VARIANTS = ("full attention", "SWA interleave", "searched SWA", "Gated DeltaNet", "SimpleGDN")
TASKS = ("mqar", "niah")


SIZES = {
    "quick": dict(base=BASE_SIZES["quick"], steps=3, seq_len=32, lr=1e-3, val_rows=8, seeds=1),
    "cpu": dict(base=BASE_SIZES["cpu"], steps=200, seq_len=128, lr=1e-3, val_rows=64, seeds=3),
    "gpu": dict(base=BASE_SIZES["gpu"], steps=1000, seq_len=4096, lr=1e-3, val_rows=64, seeds=3),
    "gpu-quick": dict(base=BASE_SIZES["gpu-quick"], steps=2, seq_len=2048, lr=1e-3, val_rows=1, seeds=1),
}
"""base: the base's sizes (`gqa_base.SIZES`, the swa study's; its seeds unused). Then the further training every
variant gets: steps at seq_len tokens per row (batch rows as the base), lr peak (10% warm-up,
linear decay to lr / 10). val_rows: validation text rows. seeds: unless --seeds. gpu: the swa
study's 2K base, then 1000 further steps at 4K, scored at 4K and 8K (an estimated 2-3 GPU-hours
per seed, not measured)."""


def layer_plan(sz: dict) -> list[int]:
    """The layers that become GDN / SimpleGDN: the SWA layers of the 1:1 interleave."""
    return [i for i, m in enumerate(interleave_pattern(sz["layers"])) if m == "swa"]


def build_variants(base: GLM5ForCausalLM, sz: dict, searched: list[str], *, seed: int) -> dict:
    """The five models of the module docstring, each with its own copy of the weights.
    Raises RuntimeError if a GDN / SimpleGDN model would load anything but its mixers' new
    parameters wrongly (missing keys outside the replaced layers, or unexpected keys)."""
    cfg, state = base.config, base.state_dict()
    swa = interleave_pattern(sz["layers"])
    out = {"full attention": copy.deepcopy(base)}
    for name, mixers in (("SWA interleave", swa), ("searched SWA", searched)):
        out[name] = _loaded(cfg.replace(mixer_types=list(mixers), sliding_window=sz["window"]), state, strict=True)
    replaced = layer_plan(sz)
    for name, mixer in (("Gated DeltaNet", "gdn"), ("SimpleGDN", "simple_gdn")):
        mixers = [mixer if i in replaced else "attention" for i in range(sz["layers"])]
        torch.manual_seed(seed)
        keep = state if mixer == "simple_gdn" else {k: v for k, v in state.items()
                                                     if not any(k.startswith(_mixer_prefix(i)) for i in replaced)}
        out[name] = _loaded(cfg.replace(mixer_types=mixers), keep, strict=False, new_in=replaced)
    return out


def _mixer_prefix(i: int) -> str:
    return f"model.layers.{i}.self_attn."


def _loaded(cfg, state: dict, *, strict: bool, new_in: list[int] = ()) -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(cfg)
    result = model.load_state_dict(state, strict=strict)
    stray = [k for k in result.missing_keys if not any(k.startswith(_mixer_prefix(i)) for i in new_in)]
    if stray or result.unexpected_keys:
        raise RuntimeError(f"loading the base into mixer_types={cfg.mixer_types}: missing {stray[:6]}, "
                           f"unexpected {result.unexpected_keys[:6]}")
    return model.eval()


def further_stage(sz: dict, fz: dict) -> Stage:
    """The further-training Stage every variant gets (10% warm-up, decay to lr / 10)."""
    return decay_stage("further", fz["steps"], fz["lr"], fz["seq_len"], sz["batch"], max(1, fz["steps"] // 10))


def score(model, bench: Workbench, sz: dict, fz: dict, *, seed: int) -> dict:
    """{length: `retrieval`} at fz["seq_len"] and 2 x fz["seq_len"], and "val_loss": mean CE (nats/token) on
    fz["val_rows"] validation text rows of fz["seq_len"] tokens."""
    ids, labels = bench.val_text(fz["seq_len"], fz["val_rows"])
    out = {str(n): retrieval(model, bench, sz, n, seed=seed) for n in eval_lengths(fz)}
    out["val_loss"] = labelled_loss(model, ids, labels)
    return out


def eval_lengths(fz: dict) -> tuple[int, int]:
    """Evaluation lengths in tokens: 2T and 4T (both above the window)."""
    return fz["seq_len"], 2 * fz["seq_len"]


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Base, search, five variants, equal further training, scores (module docstring); the StudyResult."""
    fz, seeds = args.size_and_seeds(SIZES)
    sz = fz["base"]
    raw: dict = {v: {} for v in VARIANTS}
    patterns, curves = {}, {}
    for seed in seeds:
        args.say(f"seed {seed}: training the full-attention base ({sz['steps']} steps of {sz['batch']} x "
                 f"{sz['seq_len']})")
        base, _ = train_base(bench, sz, seed=seed, device=args.device)
        found = search_pattern(base, bench, sz, seed=seed)
        patterns[str(seed)] = found.mixer_types
        args.say(f"seed {seed}: searched SWA layers {list(found.swa_layers)}")
        batches = task_batches(bench, sz, fz["seq_len"], seed=10_000 + seed)
        for name, model in build_variants(base, sz, found.mixer_types, seed=seed).items():
            model.to(args.device)
            args.say(f"seed {seed}: {name}: {fz['steps']} further steps of {sz['batch']} x {fz['seq_len']}")
            records = fit(model, [further_stage(sz, fz)], batches, seed=seed)
            curves.setdefault(name, {})[str(seed)] = [round(r["lm_loss"], 4) for r in records]
            raw[name][str(seed)] = score(model, bench, sz, fz, seed=seed)
    settings = {"scale": args.size_key, "device": str(args.device), "base_sizes": sz,
                "further": {k: v for k, v in fz.items() if k != "base"}, "base_config": base_config(sz).to_hf(),
                "further_stage": further_stage(sz, fz).to_dict(),
                "base_tokens": sz["steps"] * sz["batch"] * sz["seq_len"],
                "further_tokens": fz["steps"] * sz["batch"] * fz["seq_len"],
                "replaced_layers": layer_plan(sz), "interleave": interleave_pattern(sz["layers"]),
                "searched": patterns, "eval_lengths": list(eval_lengths(fz)), "further_curves_lm": curves}
    return result(raw, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them)."""
    sz, fz = settings["base_sizes"], {**settings["further"], "base": settings["base_sizes"]}
    table, notes = _table(raw, sz, fz, seeds, settings["searched"])
    return StudyResult("efficient", table, raw, settings, seeds, lambda p: _plot(raw, fz, seeds, p), notes)


def _retrieval_change(raw: dict, v: str, fz: dict, seeds, task: str | None = None) -> float:
    """Mean over seeds and eval lengths (and tasks, unless given) of (variant - full), in points."""
    tasks = (task,) if task else TASKS
    return 100 * statistics.fmean(raw[v][str(s)][str(n)][t] - raw["full attention"][str(s)][str(n)][t]
                                  for s in seeds for n in eval_lengths(fz) for t in tasks)


def comparison(raw: dict, a: str, fz: dict, seeds, b: str = "full attention") -> dict:
    """Variant a against variant b (default full attention): per seed, a's mean retrieval change (points, over
    the eval lengths and tasks) minus b's, paired by seed, judged against the sign of the report's difference of
    their mean changes (full attention's is 0) (`glm5lab.ablate.stats.compare`)."""
    per_seed = {s: _retrieval_change(raw, a, fz, [s]) - _retrieval_change(raw, b, fz, [s]) for s in seeds}
    report = {v: rf.mean(rf.EFFICIENT[v]) if v in rf.EFFICIENT else 0.0 for v in (a, b)}
    return compare(per_seed, dict.fromkeys(seeds, 0.0), 1 if report[a] > report[b] else -1)


def _table(raw, sz, fz, seeds, patterns) -> tuple[str, list[str]]:
    lengths = eval_lengths(fz)
    abs_rows = [[v, *[interval([raw[v][str(s)][str(n)][t] for s in seeds]).text() for t in TASKS for n in lengths],
                 interval([raw[v][str(s)]["val_loss"] for s in seeds]).text()] for v in VARIANTS]
    text = (f"After {fz['steps']} equal further steps of {sz['batch']} x {fz['seq_len']} tokens (base: "
            f"{sz['steps']} steps at {sz['seq_len']}; window {sz['window']}; seeds {seeds}). Accuracy in [0, 1], loss in nats/token, "
            "mean ± sd [95% t]:\n\n"
            + markdown_table(["variant", *[f"{t.upper()} {n}" for t in TASKS for n in lengths],
                              f"val loss {fz['seq_len']}"], abs_rows))
    ours = {v: _retrieval_change(raw, v, fz, seeds) for v in VARIANTS[1:]}
    rep = {v: rf.mean(rf.EFFICIENT[v]) for v in VARIANTS[1:]}
    rank = lambda d: {v: i + 1 for i, v in enumerate(sorted(d, key=lambda k: -d[k]))}  # noqa: E731
    r_ours, r_rep = rank(ours), rank(rep)
    verdicts = {v: comparison(raw, v, fz, seeds) for v in VARIANTS[1:]}
    loss = {v: statistics.fmean(raw[v][str(s)]["val_loss"] - raw["full attention"][str(s)]["val_loss"] for s in seeds)
            for v in VARIANTS[1:]}
    rows = [[v, *[f"{_retrieval_change(raw, v, fz, seeds, t):+.1f}" for t in TASKS], f"{loss[v]:+.3f}",
             *[f"{x:+.2f}" for x in rf.EFFICIENT[v]], f"{ours[v]:+.1f} / {rep[v]:+.2f}", f"{r_ours[v]} / {r_rep[v]}",
             compare_text(verdicts[v], 1)] for v in VARIANTS[1:]]
    text += ("\nChange vs full attention (ours: points of accuracy, mean over lengths " + ", ".join(map(str, lengths))
             + "; loss in nats, lower is better; report: points at 128K):\n\n" + markdown_table(
                 ["variant", "ours Δ MQAR", "ours Δ NIAH", "ours Δ val loss",
                  *[f"paper Δ {b}" for b in rf.EFFICIENT_BENCHMARKS], "mean Δ ours / paper",
                  "rank ours / paper", "ours mean Δ, paired [95% t]: verdict"], rows))
    text += "\nSearched SWA pattern per seed (F full, S SWA): " + "; ".join(
        f"seed {s}: " + "".join("S" if m == "swa" else "F" for m in patterns[str(s)]) for s in seeds) + "\n"
    return text, _notes(ours, rep, raw, seeds, verdicts, fz)


def _notes(ours, rep, raw, seeds, verdicts: dict, fz: dict) -> list[str]:
    """Verdicts (the rule of `glm5lab.ablate.stats`) for every variant vs full attention that is not reproduced,
    and for the report's two pairwise orderings; the ordering of the means is printed as a description only."""
    notes = [f"{v}: mean retrieval change {compare_text(c, 1)} (report {rep[v]:+.2f})."
             for v, c in verdicts.items() if c["verdict"] != "reproduced"]
    order = sorted(ours, key=lambda k: -ours[k])
    report_order = sorted(rep, key=lambda k: -rep[k])
    notes.append(f"ordering of the mean retrieval changes (a description, not a verdict): ours {' > '.join(order)}; "
                 f"paper {' > '.join(report_order)}.")
    for a, b in (("searched SWA", "SWA interleave"), ("SimpleGDN", "Gated DeltaNet")):
        notes.append(f"{a} vs {b}, difference of retrieval changes, paired [95% t]: "
                     f"{compare_text(comparison(raw, a, fz, seeds, b), 1)} (report {rep[a] - rep[b]:+.2f}).")
    full = 100 * statistics.fmean(cell[t] for r in raw["full attention"].values() for n, cell in r.items()
                                  if n != "val_loss" for t in TASKS)
    if full < 10:
        notes.append(f"full attention scores only {full:.1f} points of retrieval: the base has not learned it, so "
                     "the changes above say little (expected for --quick).")
    loss = {v: paired_difference([raw[v][str(s)]["val_loss"] for s in seeds],
                                 [raw["full attention"][str(s)]["val_loss"] for s in seeds]) for v in ours}
    notes.append("validation loss change vs full attention, nats, paired [95% t] (the report gives none, so no "
                 "verdict): " + "; ".join(f"{v} {d.text()}" for v, d in loss.items()) + ".")
    return notes


def _plot(raw, fz, seeds, path) -> None:
    plt = figure()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    names = VARIANTS[1:]
    width = 0.8 / len(TASKS)
    for j, t in enumerate(TASKS):
        ax.bar([i + j * width for i in range(len(names))], [_retrieval_change(raw, v, fz, seeds, t) for v in names],
               width, label=t.upper())
    width = 0.8 / len(rf.EFFICIENT_BENCHMARKS)
    for j, b in enumerate(rf.EFFICIENT_BENCHMARKS):
        bx.bar([i + j * width for i in range(len(names))], [rf.EFFICIENT[v][j] for v in names], width, label=b)
    for a, title in ((ax, f"ours: change vs full, lengths {eval_lengths(fz)}"), (bx, "report: change vs full at 128K")):
        a.axhline(0, color="black", lw=0.8)
        a.set_xticks([i + 0.3 for i in range(len(names))], names, rotation=20, fontsize=8)
        a.set(ylabel="change vs full attention (points)", title=title)
        a.legend(fontsize=8)
    save_png(fig, path, dpi=100)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: each variant's mean
    retrieval change vs full attention with its verdict, and the two pairwise verdicts."""
    raw, seeds, fz = info["raw"], info["seeds"], info["settings"]["further"]
    names = VARIANTS[1:]
    pairs = (("searched SWA", "SWA interleave"), ("SimpleGDN", "Gated DeltaNet"))
    return {"paper": "change vs full at 128K (mean of 4): " + ", ".join(f"{v} {rf.mean(rf.EFFICIENT[v]):+.1f}" for v in names),
            "ours": f"change in retrieval after {fz['steps']} equal further steps: "
                    + ", ".join(f"{v} {_retrieval_change(raw, v, fz, seeds):+.1f}" for v in names),
            "verdict": "; ".join(f"{v} vs full: {compare_text(comparison(raw, v, fz, seeds), 1)}" for v in names) + "; "
                       + "; ".join(f"{a} vs {b}: {compare_text(comparison(raw, a, fz, seeds, b), 1)}" for a, b in pairs)}
