"""`glm5lab ablate mtp`: MTP acceptance length vs draft steps 1..4, for training unroll depth 1 vs 3
(the report's shared-parameter MTP: acceptance length 2.76 for GLM-5, 2.55 for DeepSeek-V3.2, at
4 speculative steps; `report_figures.MTP`).

Recipe: per seed, two models from one init (dense MLA `variant_config(study_config(...), "mla")`
with its one MTP layer) train on the same Shakespeare text batches (training split, next-token
targets, no task rows), one stage each, lm weight 1 and MTP weight 0.3 per depth:
  depth 1:  Stage mtp_weights (0.3,): the MTP layer is trained to draft one token ahead;
  depth 3:  (0.3, 0.3, 0.3): the shared layer is unrolled 3 times (z^(j) = f(z^(j-1), e(x_{t+j}))),
            as GLM-5 trains it.
Score: mean acceptance length (`glm5lab.generate(..., speculative="mtp", draft_steps=k)
.stats.acceptance_length`: tokens per verification forward = 1 + accepted drafts) for k = 1..4, on `prompts`
held-out prompts (the first tokens of validation-split windows), `max_new` new tokens each, greedy
(temperature 0) and sampled (temperature 1, seeded). Also the teacher-forced validation CE of MTP depth j =
1..4 (`mtp_depth=4` forward), the draft quality the acceptance reflects.

`generate` drafts by chaining the one shared MTP layer k times (each step feeds its own z and
drafted token back), so draft steps beyond the training depth (k > 1 for depth 1, k = 4 for
depth 3) use the layer at unroll positions it never trained on: extrapolation, which is what the
depth 1 vs 3 comparison shows. Cached generation needs "attention" mixers (study_config has them).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from glm5lab.ablate.fit import STUDY_HYPER, decay_stage, fit
from glm5lab.ablate.measure import mtp_acceptance, val_prompts
from glm5lab.ablate.models import seeded_model, study_config, variant_config
from glm5lab.ablate.report_figures import MTP
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.stats import compare, compare_text, interval
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.workbench import Workbench
from glm5lab.train.stages import Stage
from glm5lab.validate import one_of

DEPTHS = (1, 3)
DRAFT_STEPS = (1, 2, 3, 4)
MODES = {"greedy": 0.0, "T=1": 1.0}  # decoding mode -> temperature
MTP_WEIGHT = 0.3
SIZES = {
    "quick": dict(layers=1, hidden=64, T=32, batch=8, steps=6, lr=3e-3, prompts=2, prompt_len=16, max_new=8,
                  val_rows=8, seeds=1),
    "cpu": dict(layers=2, hidden=128, T=128, batch=16, steps=600, lr=3e-3, prompts=16, prompt_len=32,
                max_new=64, val_rows=32, seeds=3),
    "gpu": dict(layers=12, hidden=768, T=2048, batch=16, steps=3000, lr=2e-3, prompts=64, prompt_len=256,
                max_new=256, val_rows=64, seeds=3),
    "gpu-quick": dict(layers=4, hidden=768, T=2048, batch=1, steps=1, lr=2e-3, prompts=1, prompt_len=64,
                      max_new=8, val_rows=1, seeds=1),
}
"""gpu: two ~60M-parameter 12-layer models per seed, 3000 steps of 16 x 2048 tokens (an estimated
1-2 GPU-hours per seed on one H100-class GPU, not measured); gpu-quick: the gpu widths and lengths with 4 layers, one step."""
SAMPLE_SEED = 1234


def config(s: dict, depth: int):
    """Dense MLA with one MTP layer whose `mtp_depth` field records the training unroll depth."""
    base = study_config(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_nextn_predict_layers=1,
                        mtp_depth=depth, max_position_embeddings=max(s["T"], s["prompt_len"] + s["max_new"] + 8))
    return variant_config(base, "mla")


def stage(s: dict, depth: int) -> Stage:
    """One stage: linear warm-up (5%), then lr -> lr/10; CE + 0.3 x CE of each of `depth` MTP depths."""
    one_of("depth", depth, DEPTHS)
    return decay_stage(f"mtp_depth_{depth}", s["steps"], s["lr"], s["T"], s["batch"], s["steps"] // 20,
                       (MTP_WEIGHT,) * depth)


@torch.no_grad()
def mtp_depth_losses(model, bench: Workbench, s: dict, max_depth: int = max(DRAFT_STEPS)) -> list[float]:
    """Teacher-forced validation CE (nats) of the main head (entry 0) and MTP depths 1..max_depth."""
    device = next(model.parameters()).device
    ids, labels = (t.to(device) for t in bench.val_text(s["T"], s["val_rows"]))
    out = model(ids, mtp_depth=max_depth)
    heads = [out.logits, *out.mtp_logits]
    return [float(F.cross_entropy(lg.flatten(0, 1), labels[:, j:].flatten())) for j, lg in enumerate(heads)]


def run_seed(bench: Workbench, s: dict, seed: int, say, device="cpu") -> dict:
    """Train depth 1 and depth 3 from one init (on the CPU, then moved to `device`) on the same
    batches; score both."""
    batches = bench.mixed(s["T"], s["batch"], task_rows=0, num_kv_pairs=1, seed=seed)
    rows, out = val_prompts(bench, s), {}
    for depth in DEPTHS:
        model = seeded_model(config(s, depth), seed, device)
        records = fit(model, [stage(s, depth)], batches, seed=seed)
        acc = {mode: {str(k): mtp_acceptance(model, rows, s["max_new"], k, temperature=t, seed=SAMPLE_SEED)
                      for k in DRAFT_STEPS} for mode, t in MODES.items()}
        res = {"acceptance_length": acc,
               "val_ce_by_depth": mtp_depth_losses(model, bench, s),
               "last_train_lm_loss": records[-1]["lm_loss"], "train_seconds": sum(r["seconds"] for r in records)}
        out[str(depth)] = res
        say(f"seed {seed}: depth {depth} trained ({res['train_seconds']:.0f} s), greedy acceptance "
            + ", ".join(f"k={k}: {v:.2f}" for k, v in res["acceptance_length"]["greedy"].items()))
    return out


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """Train depth 1 and depth 3 per seed, measure acceptance for k = 1..4 (module docstring); the StudyResult."""
    s, seeds = args.size_and_seeds(SIZES)
    raw = {str(seed): run_seed(bench, s, seed, args.say, args.device) for seed in seeds}
    settings = {"scale": args.size_key, "device": str(args.device), "size": s, "tokens_per_model": s["steps"] * s["batch"] * s["T"],
                "stages": {str(d): stage(s, d).to_dict() for d in DEPTHS}, "optimizer": STUDY_HYPER.optimizer,
                "eval": {"prompts": s["prompts"], "prompt_len": s["prompt_len"], "max_new_tokens": s["max_new"],
                         "draft_steps": list(DRAFT_STEPS), "temperatures": MODES, "sample_seed": SAMPLE_SEED,
                         "prompt_source": "validation split windows"},
                "models": {str(d): config(s, d).to_hf() for d in DEPTHS}}
    return result(raw, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them)."""
    return StudyResult("mtp", table(raw), raw, settings, seeds, lambda path: plot(raw, path), notes(raw))


def _acc(raw: dict, depth: int, mode: str, k: int) -> list[float]:
    return [raw[seed][str(depth)]["acceptance_length"][mode][str(k)] for seed in raw]


def comparison(raw: dict, mode: str) -> dict:
    """Acceptance at k=4, depth 3 against depth 1, paired by seed (both depths train from the
    same seed's data and initialisation), judged against the report's sign (GLM-5's 3 depths
    2.76 > DeepSeek-V3.2's one 2.55: positive) by `glm5lab.ablate.stats.compare`."""
    by_seed = {depth: {seed: raw[seed][str(depth)]["acceptance_length"][mode]["4"] for seed in raw}
               for depth in (1, 3)}
    return compare(by_seed[3], by_seed[1], 1 if MTP["GLM-5"] > MTP["DeepSeek-V3.2"] else -1)


def table(raw: dict) -> str:
    """Acceptance length (mean ± sd [95% t-interval] over seeds): rows depth x mode, columns k = 1..4,
    the report's figures at 4 steps beside, depth 3 - depth 1 at k=4 with its paired interval and
    verdict (`glm5lab.ablate.stats`); then the teacher-forced CE by MTP depth."""
    head = ["training depth", "decoding", *[f"k={k}" for k in DRAFT_STEPS], "paper GLM-5 (k=4)",
            "paper DeepSeek-V3.2 (k=4)", "paper: GLM-5 - DeepSeek-V3.2",
            "ours: depth 3 - depth 1 at k=4, paired [95% t]: verdict"]
    d_rep = MTP["GLM-5"] - MTP["DeepSeek-V3.2"]
    rows = []
    for mode in MODES:
        for depth in DEPTHS:
            cmp = [f"{d_rep:+.2f}", compare_text(comparison(raw, mode), 2)] if depth == 3 else ["", ""]
            rows.append([f"depth {depth}", mode, *[interval(_acc(raw, depth, mode, k)).text(2) for k in DRAFT_STEPS],
                         f"{MTP['GLM-5']:.2f}", f"{MTP['DeepSeek-V3.2']:.2f}", *cmp])
    ce_head = ["training depth", "main head", *[f"MTP depth {j}" for j in DRAFT_STEPS]]
    ce_rows = [[f"depth {d}", *[interval([raw[s][str(d)]["val_ce_by_depth"][j] for s in raw]).text()
                               for j in range(len(DRAFT_STEPS) + 1)]] for d in DEPTHS]
    return ("Mean acceptance length (tokens per verification forward) vs MTP draft steps k; report: 4 steps\n\n"
            + markdown_table(head, rows)
            + "\nTeacher-forced validation CE (nats/token, mean ± sd [95% t]) by prediction depth (depths above the "
              "training depth are extrapolation)\n\n" + markdown_table(ce_head, ce_rows))


def notes(raw: dict) -> list[str]:
    """Direction against the report (GLM-5, unroll depth 3, vs DeepSeek-V3.2, one MTP depth) and the
    extrapolation caveat."""
    out = []
    for mode in MODES:
        a1, a3 = statistics.fmean(_acc(raw, 1, mode, 4)), statistics.fmean(_acc(raw, 3, mode, 4))
        out.append(f"{mode}, k=4: depth 3 {a3:.2f} vs depth 1 {a1:.2f}, paired difference "
                   f"{compare_text(comparison(raw, mode), 2)} (the report: GLM-5 2.76 > DeepSeek-V3.2 2.55).")
    out.append("Drafting chains the one shared MTP layer k times: draft steps beyond the training depth (k >= 2 for "
               "depth 1, k = 4 for depth 3) apply it at unroll positions never trained, i.e. extrapolation; the "
               "CE table shows the draft quality by depth.")
    out.append("Report analogy, not identity: GLM-5 trains 3 shared-parameter MTP depths, DeepSeek-V3.2 one MTP "
               "module; their models, data and (private) prompts differ from each other and from ours.")
    out.append("Greedy speculative output equals plain greedy output (the target's distribution is kept), so "
               "acceptance length measures speed only; at T=1 acceptance follows the speculative-sampling rule.")
    return out


def plot(raw: dict, path) -> None:
    """Acceptance length vs k per training depth and decoding mode (error bars: sd over seeds),
    with the report's two figures at k = 4."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode, style in zip(MODES, ("-", "--"), strict=True):
        for depth, color in zip(DEPTHS, ("tab:blue", "tab:green"), strict=True):
            vals = [_acc(raw, depth, mode, k) for k in DRAFT_STEPS]
            ax.errorbar(DRAFT_STEPS, [statistics.fmean(v) for v in vals], [interval(v).sd for v in vals], capsize=3,
                        marker="o", linestyle=style, color=color, label=f"ours: training depth {depth}, {mode}")
    ax.plot([4], [MTP["GLM-5"]], "r*", markersize=12, label="report: GLM-5 (2.76)")
    ax.plot([4], [MTP["DeepSeek-V3.2"]], "kx", markersize=10, label="report: DeepSeek-V3.2 (2.55)")
    ax.plot(DRAFT_STEPS, [k + 1 for k in DRAFT_STEPS], ":", color="grey", label="upper bound k + 1")
    ax.set(xlabel="draft steps k", ylabel="mean acceptance length (tokens / verify forward)", xticks=DRAFT_STEPS,
           title="MTP speculative decoding: acceptance length vs draft steps")
    ax.legend(fontsize=7)
    save_png(fig, path)


def readme_row(info: dict) -> dict:
    """The summary row (`glm5lab.ablate.summary`) from a parsed results.json: acceptance at 4 draft
    steps per training depth and mode, and the depth-3-vs-1 verdicts."""
    raw = info["raw"]
    ours = "; ".join(f"{mode}: depth 3 {statistics.fmean(_acc(raw, 3, mode, 4)):.2f}, "
                     f"depth 1 {statistics.fmean(_acc(raw, 1, mode, 4)):.2f}" for mode in MODES)
    return {"paper": f"acceptance at 4 steps: GLM-5 (3 shared depths) {MTP['GLM-5']:.2f}, DeepSeek-V3.2 "
                      f"{MTP['DeepSeek-V3.2']:.2f}",
            "ours": "acceptance at 4 draft steps, " + ours,
            "verdict": "; ".join(f"deeper unroll drafts longer ({mode}): {compare_text(comparison(raw, mode), 2)}"
                                 for mode in MODES)}
