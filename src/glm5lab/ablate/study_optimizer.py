"""`glm5lab ablate optimizer`: AdamW vs Muon vs Muon Split vs Muon Split with K and V apart, on the GLM-5 recipe
in miniature, at equal tokens and at equal compute (the seed's first open question: "Muon Split relative to
AdamW at the same data and the same compute"). No report figure: the report gives none.

Model: the `small` preset (MLA, DSA with an indexer and index sharing, MoE of 16 experts top-2 + a shared one
with the router's selection-only bias, one shared-parameter MTP layer) at `hidden` width and `layers` layers
(`config`), the workbench's vocabulary (512: text + MQAR ids) and `index_topk` below the training length.
Recipe: `glm5lab train`'s three stages (`default_stages`: dense with MTP depth 3, indexer warm-up, sparse
adaptation) scaled to `steps` in total (`fit.glm5_stages`) and its step settings (`TrainHyper`:
weight decay 0.1, clipping 1.0, router bias rate 1.5e-2). Every stage's lr and lr_end are the default schedule's
times one factor; an arm's "peak lr" is its dense stage's. Batches: `Workbench.mixed` (text rows and
`task_rows` fresh MQAR rows); batch k of stage j is the same for every arm of a seed, so a longer run sees the
same first batches and then more. The four arms (`ARMS`, `glm5lab.optim.groups`): AdamW on every parameter;
Muon on every hidden matrix, whole (embedding, head, norms and biases stay on AdamW in the three Muon arms);
Muon Split (MLA's q_b_proj / kv_b_proj per head, the report's); Muon Split with each head's kv_b block cut
into its K rows and its V rows, orthogonalised apart ("muon-split-kv").

Learning rates: per arm, a sweep over `lrs` (peak lr of the dense stage; every stage scales with it) on
SWEEP_SEED, a seed no scored run uses, at the equal-token budget; the arm's lr is the one with the lowest
validation loss on `val_windows` validation windows that come after the scored ones (disjoint). While the
best lr is at an edge of what was tried, the sweep tries one more past it (x2 or /2), at most SWEEP_EXTENSIONS
times (`next_lr`); a run that diverges scores inf. An lr still at the edge is flagged in the notes.

Budgets:
  equal tokens   every arm trains the same `steps` on the same batches;
  equal compute  every arm's FLOPs equal the Muon Split arm's at equal tokens: each arm's stages are scaled
                 by C / cost (steps rounded, at least 1), so AdamW trains more tokens. Whole-matrix Muon and
                 K/V apart train a little more or fewer: cutting a matrix into blocks saves Newton-Schulz FLOPs
                 or costs more, by the shapes (`glm5lab.optim.flops`; at the cpu size both train slightly more).
                 FLOPs per step = the model's forward + backward as `torch.utils.flop_counter.FlopCounterMode`
                 counts them (one step per stage, measured on a fresh model) + the optimizer's Newton-Schulz
                 FLOPs (`glm5lab.optim.flops`, tied to the same counter by a test). Runs whose scaled stages equal
                 the equal-token ones are not trained twice.
The measured optimizer seconds (`Optimizer` step hooks) are reported beside, with the step factor that
equal wall time would have given; the compute budget is the FLOP count, which does not depend on the machine.

Scores (per arm, budget, seed): validation loss (nats/token) and bits per byte over the first `val_windows`
windows of the validation split with DSA on (`evals.bpb`), MQAR per-query accuracy (teacher forced, DSA on) on
EVAL_SEED rows, and the MTP acceptance length of greedy speculative decoding with DRAFT_STEPS drafts from
`prompts` validation prompts. Comparisons are paired by seed and judged by `glm5lab.ablate.stats.compare`.

Sizes: "cpu" (default): 4 layers of width 128 at 64 tokens, 400 steps of 16 rows (8 of them MQAR), 4 lrs x 4
arms on the sweep seed, 3 scored seeds: 72 minutes on 2 cores (BENCHMARKS.md, "Optimizer study"). "gpu":
the baseline study's GPU shape (hidden 768, 16 experts, DSA top-512) with 7 of its 8 layers (95M parameters
with the MTP layer) at 2048 tokens, 2100 steps of 8 rows: an estimated 8-12 GPU-hours in fp32 for the sweep and
3 seeds (not measured). "gpu-quick": that shape with 2 layers, one step per stage, on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from glm5lab.ablate.fit import TRAIN_HYPER, fit, glm5_stages, scaled
from glm5lab.ablate.measure import mqar_accuracy, mtp_acceptance, text_score, val_prompts
from glm5lab.ablate.models import GPU_SHAPE, meta_model, seeded_model
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.stats import compare, compare_text, interval, per_seed, seed_mean, seed_values
from glm5lab.ablate.workbench import Workbench
from glm5lab.config import ModelConfig
from glm5lab.evals.bpb import token_byte_lengths
from glm5lab.train.stages import Stage
from glm5lab.train.recipe import default_stages
from glm5lab.train.step import TrainingDiverged

ARMS = {"AdamW": "adamw", "Muon": "muon", "Muon Split": "muon-split", "Muon Split, K/V apart": "muon-split-kv"}
REFERENCE = "Muon Split"
"""The arm whose equal-token FLOPs define the equal-compute budget (GLM-5's optimizer)."""
BUDGETS = ("equal tokens", "equal compute")
COMPARISONS = (("Muon Split", "AdamW"), ("Muon", "AdamW"), ("Muon Split", "Muon"),
               ("Muon Split, K/V apart", "Muon Split"))
"""(a, b): the expectation tested is that a is better than b (lower bpb, higher MQAR and acceptance). For the
first three it is the claim of the Muon / Muon Split literature; for K/V apart nothing is published."""
METRICS = {"val_bpb": ("val bpb", -1), "mqar_accuracy": ("MQAR acc", 1), "acceptance_length": ("MTP acceptance", 1)}
"""raw key -> (label, the better side: -1 lower, +1 higher)."""
DEFAULT_DENSE_LR = default_stages()[0].lr
"""`default_stages`' dense peak lr: an arm's lr / this scales every stage's lr and lr_end."""
SWEEP_SEED = 100
EVAL_SEED = 424_242
DRAFT_STEPS = 3
SWEEP_EXTENSIONS = 2
"""How many lrs the sweep may add past an edge of `lrs` while the best one lies at that edge (`next_lr`)."""
SIZES = {
    "quick": dict(model="small", hidden=64, layers=2, T=32, topk=8, batch=4, task_rows=1, pairs=2, steps=6,
                  lrs=(2e-3, 4e-3), val_windows=4, eval_rows=8, prompts=2, prompt_len=8, max_new=6, seeds=1),
    "cpu": dict(model="small", hidden=128, layers=4, T=64, topk=16, batch=16, task_rows=8, pairs=4, steps=400,
                lrs=(1.5e-3, 3e-3, 6e-3, 1.2e-2), val_windows=64, eval_rows=128, prompts=8, prompt_len=32,
                max_new=32, seeds=3),
    "gpu": dict(model="gpu", layers=7, T=2048, topk=512, batch=8, task_rows=2, pairs=32, steps=2100,
                lrs=(5e-4, 1e-3, 2e-3, 4e-3), val_windows=64, eval_rows=128, prompts=16, prompt_len=256, max_new=128,
                seeds=3),
    "gpu-quick": dict(model="gpu", layers=2, T=2048, topk=512, batch=1, task_rows=1, pairs=32, steps=3, lrs=(1e-3,),
                      val_windows=1, eval_rows=1, prompts=1, prompt_len=64, max_new=4, seeds=1),
}
"""quick: seconds (the test suite runs it); cpu: the default (module docstring); gpu / gpu-quick: the baseline
study's GPU shape (`GPU_SHAPE`)."""


def config(s: dict, vocab_size: int) -> ModelConfig:
    """The small preset at hidden size s["hidden"] (model "small": FFN 3x, experts of hidden/2, q rank hidden/2
    as in the preset, whose hidden is 256; heads, latent and indexer widths kept) or the baseline study's GPU
    shape (model "gpu"), with s["layers"] layers (the preset's indexer pattern cut to them), index_topk
    s["topk"] and the workbench's vocabulary."""
    if s["model"] == "small":
        h = s["hidden"]
        base = ModelConfig.from_preset("small", hidden_size=h, intermediate_size=3 * h, moe_intermediate_size=h // 2,
                                       q_lora_rank=h // 2)
    else:
        base = ModelConfig.from_preset("small", **GPU_SHAPE)
    n = s["layers"]
    return base.replace(vocab_size=vocab_size, num_hidden_layers=n, indexer_types=list(base.indexer_types[:n]),
                        index_topk=s["topk"], max_position_embeddings=max(s["T"], s["prompt_len"] + s["max_new"] + 8))


def stages(s: dict, lr: float, scale: float = 1.0) -> list[Stage]:
    """`glm5_stages(s)` with every lr and lr_end times lr / DEFAULT_DENSE_LR, and (scale != 1) every stage's
    steps and warm-up times `scale`, rounded (at least 1 step; warm-up below the steps)."""
    f = lr / DEFAULT_DENSE_LR
    return scaled([dataclasses.replace(st, lr=st.lr * f, lr_end=None if st.lr_end is None else st.lr_end * f)
                   for st in glm5_stages(s)], scale)


def step_costs(cfg: ModelConfig, bench: Workbench, s: dict, device) -> dict:
    """FLOPs of one step per stage: {"model": [per stage], "optimizer": {arm: [per stage]}}. The model's
    forward + backward is counted by FlopCounterMode on one batch per stage (a fresh seeded model, the stage's
    trainable parameters); the optimizer's by `optim.flops.optimizer_flops` over the parameters that train.
    "expert_share": {arm: the routed experts' share of a full step's Newton-Schulz FLOPs}."""
    from torch.utils.flop_counter import FlopCounterMode

    from glm5lab.optim import indexer_parameter_names
    from glm5lab.optim.flops import optimizer_flops
    from glm5lab.train.losses import task_losses
    from glm5lab.train.step import set_trainable

    model = seeded_model(cfg, SWEEP_SEED, device)
    plan = stages(s, DEFAULT_DENSE_LR)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=SWEEP_SEED)
    indexer = indexer_parameter_names(model)
    out = {"model": [], "optimizer": {arm: [] for arm in ARMS}, "expert_share": {}}
    for j, st in enumerate(plan):
        set_trainable(model, st)
        ids, labels = (t.to(device) for t in batches(j, st, 0))
        with FlopCounterMode(display=False) as fc:
            task_losses(model, ids, labels, st).total.backward()
        model.zero_grad(set_to_none=True)
        out["model"].append(int(fc.get_total_flops()))
        trains = None if st.trainable == "all" else indexer.__contains__
        for arm, opt in ARMS.items():
            out["optimizer"][arm].append(optimizer_flops(model, opt, trains=trains)["newton_schulz"])
    for arm, opt in ARMS.items():
        total = optimizer_flops(model, opt)["newton_schulz"]
        experts = optimizer_flops(model, opt, trains=lambda name: ".mlp.experts." in name)["newton_schulz"]
        out["expert_share"][arm] = experts / total if total else 0.0
    return out


def run_flops(costs: dict, arm: str, plan: list[Stage]) -> dict:
    """Total FLOPs of `plan` for `arm`: {"model", "optimizer", "total"}."""
    model = sum(st.steps * f for st, f in zip(plan, costs["model"], strict=True))
    opt = sum(st.steps * f for st, f in zip(plan, costs["optimizer"][arm], strict=True))
    return {"model": model, "optimizer": opt, "total": model + opt}


def compute_scales(costs: dict, s: dict) -> dict:
    """Arm -> the factor on every stage's steps that makes its FLOPs the REFERENCE arm's at equal tokens."""
    plan = stages(s, DEFAULT_DENSE_LR)
    budget = run_flops(costs, REFERENCE, plan)["total"]
    return {arm: budget / run_flops(costs, arm, plan)["total"] for arm in ARMS}


class OptimizerClock:
    """Wall seconds inside `optimizer.step()`, summed, by the optimizer's own step pre/post hooks."""

    def __init__(self, optimizer):
        self.seconds, self._t0 = 0.0, None
        optimizer.register_step_pre_hook(self._start)
        optimizer.register_step_post_hook(self._stop)

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0


def train(cfg: ModelConfig, bench: Workbench, s: dict, arm: str, plan: list[Stage], seed: int, device):
    """Train one arm on `plan` from seed `seed`; (model in eval mode, {"train_seconds", "optimizer_seconds",
    "steps", "tokens", "last_train_loss"})."""
    model = seeded_model(cfg, seed, device)
    hyper = dataclasses.replace(TRAIN_HYPER, optimizer=ARMS[arm])
    optimizer = hyper.build_optimizer(model, plan[0].lr)
    clock = OptimizerClock(optimizer)
    batches = bench.mixed(s["T"], s["batch"], task_rows=s["task_rows"], num_kv_pairs=s["pairs"], seed=seed)
    records = fit(model, plan, batches, hyper=hyper, seed=seed, optimizer=optimizer)
    return model, {"train_seconds": sum(r["seconds"] for r in records), "optimizer_seconds": clock.seconds,
                   "steps": sum(st.steps for st in plan),
                   "tokens": sum(st.steps * st.batch_size * st.seq_len for st in plan),
                   "last_train_loss": records[-1]["lm_loss"]}


def val_windows(bench: Workbench, s: dict, part: str) -> torch.Tensor:
    """[val_windows, T + 1] windows of the validation split: part "score" the first ones, "sweep" the next ones.
    Raises ValueError when the split holds fewer than 2 x val_windows windows."""
    w = bench.text_windows("val", s["T"])
    n = s["val_windows"]
    if len(w) < 2 * n:
        raise ValueError(f"the validation split has {len(w)} windows of {s['T']} tokens: {2 * n} needed "
                         f"(val_windows = {n} scored + {n} for the lr sweep); use a larger corpus")
    return w[:n] if part == "score" else w[n:2 * n]


def score(model, bench: Workbench, s: dict, byte_lengths: torch.Tensor) -> dict:
    """Every score of a trained model (module docstring)."""
    return {**text_score(model, val_windows(bench, s, "score"), byte_lengths, use_dsa=True),
            "mqar_accuracy": mqar_accuracy(model, bench, s["eval_rows"], s["T"], s["pairs"], seed=EVAL_SEED,
                                           use_dsa=True),
            "acceptance_length": mtp_acceptance(model, val_prompts(bench, s), s["max_new"], DRAFT_STEPS)}


def sweep(cfg, bench: Workbench, s: dict, byte_lengths, say, device) -> dict:
    """{arm: {repr(lr): sweep validation loss}} on SWEEP_SEED at equal tokens (module docstring): every lr of
    s["lrs"], then, while the best is at an edge of what was tried (and s["lrs"] has two or more), one more lr
    past that edge (x2 or /2), at most SWEEP_EXTENSIONS times. A run that diverges (`TrainingDiverged`) scores
    inf."""
    out = {arm: {} for arm in ARMS}
    windows = val_windows(bench, s, "sweep")

    def loss(arm: str, lr: float) -> float:
        try:
            model, _ = train(cfg, bench, s, arm, stages(s, lr), SWEEP_SEED, device)
        except TrainingDiverged as e:
            say(f"sweep: {arm} lr {lr:g} diverged ({e})")
            return math.inf
        value = text_score(model, windows, byte_lengths, use_dsa=True)["val_loss"]
        say(f"sweep: {arm} lr {lr:g}: val loss {value:.4f}")
        return value

    for arm in ARMS:
        for lr in s["lrs"]:
            out[arm][repr(lr)] = loss(arm, lr)
        for _ in range(SWEEP_EXTENSIONS if len(s["lrs"]) > 1 else 0):
            lr = next_lr(out[arm])
            if lr is None:
                break
            out[arm][repr(lr)] = loss(arm, lr)
    return out


def next_lr(losses: dict) -> float | None:
    """The lr past the edge of {repr(lr): loss} where the best (`chosen_lr`) lies: x2 above the largest, /2
    below the smallest; None when the best is inside."""
    tried, best = sorted(float(k) for k in losses), chosen_lr(losses)
    if best == tried[-1]:
        return tried[-1] * 2
    if best == tried[0]:
        return tried[0] / 2
    return None


def chosen_lr(sweep_losses: dict) -> float:
    """The lr (a float) with the lowest sweep loss of one arm's {str(lr): loss}; the smaller lr on a tie."""
    return float(min(sweep_losses, key=lambda k: (sweep_losses[k], float(k))))


def run(args: StudyArgs, bench: Workbench) -> StudyResult:
    """The sweep, then every arm at both budgets for every seed, scored (module docstring); the StudyResult. When
    --seeds extends a folder (`args.prior`: its settings), its sweep is reused: the new seeds train at the lrs the
    old ones did, and the sweep's cost is not paid again."""
    s, seeds = args.size_and_seeds(SIZES)
    device = args.device
    cfg = config(s, bench.vocab_size)
    byte_lengths = token_byte_lengths(bench.tokenizer, bench.vocab_size)
    val_windows(bench, s, "sweep")  # fail early on a corpus too small
    costs = step_costs(cfg, bench, s, device)
    scales = compute_scales(costs, s)
    if args.prior and "sweep" in args.prior:  # --seeds extending a folder: its seeds' sweep, not a new one
        swept = {arm: {lr: float(loss) for lr, loss in losses.items()} for arm, losses in args.prior["sweep"].items()}
        args.say(f"the lr sweep of the seeds already run, reused: {', '.join(map(str, swept))}")
    else:
        swept = sweep(cfg, bench, s, byte_lengths, args.say, device)
    lrs = {arm: chosen_lr(swept[arm]) for arm in ARMS}
    plans = {"equal tokens": {arm: stages(s, lrs[arm]) for arm in ARMS},
             "equal compute": {arm: stages(s, lrs[arm], scales[arm]) for arm in ARMS}}
    raw = {b: {arm: {} for arm in ARMS} for b in BUDGETS}
    for seed in seeds:
        for budget in BUDGETS:
            for arm in ARMS:
                plan = plans[budget][arm]
                if budget == "equal compute" and plan == plans["equal tokens"][arm]:
                    raw[budget][arm][str(seed)] = {**raw["equal tokens"][arm][str(seed)], "reused": True}
                    continue
                model, r = train(cfg, bench, s, arm, plan, seed, device)
                r.update(score(model, bench, s, byte_lengths), flops=run_flops(costs, arm, plan))
                raw[budget][arm][str(seed)] = r
                args.say(f"seed {seed}, {budget}: {arm} ({r['steps']} steps) val bpb {r['val_bpb']:.4f}, MQAR "
                         f"{r['mqar_accuracy']:.3f}, acceptance {r['acceptance_length']:.2f}, "
                         f"{r['train_seconds']:.0f} s ({r['optimizer_seconds'] / r['train_seconds']:.0%} optimizer)")
    settings = {"scale": args.size_key, "device": str(device), "threads": torch.get_num_threads(), "size": s,
                "optimizers": ARMS, "reference": REFERENCE, "lrs": lrs, "sweep": swept, "sweep_seed": SWEEP_SEED,
                "step_flops": costs, "compute_scales": scales,
                "plans": {b: {a: [st.to_dict() for st in p] for a, p in ps.items()} for b, ps in plans.items()},
                "train": {k: v for k, v in dataclasses.asdict(TRAIN_HYPER).items() if k != "optimizer"},
                "eval": {"val_windows": s["val_windows"], "mqar_rows": s["eval_rows"], "mqar_seed": EVAL_SEED,
                         "draft_steps": DRAFT_STEPS, "prompts": s["prompts"], "use_dsa": True},
                "at_glm5_scale": at_scale(), "model": cfg.to_hf()}
    return result(raw, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them)."""
    return StudyResult("optimizer", table(raw, settings), raw, settings, seeds, lambda path: plot(raw, settings, path),
                       notes(raw, settings))


def at_scale(preset: str = "glm5", context: int = 4096, share: float = 0.01) -> dict:
    """What Newton-Schulz costs at a preset's shape (meta device, no memory): NS FLOPs per step under each Muon
    optimizer, training FLOPs per token (3 x the ledger's forward at `context`, main model and MTP at depth 3),
    and the tokens per step at which NS is `share` of the step's FLOPs."""
    from glm5lab import ledger
    from glm5lab.optim.flops import optimizer_flops

    cfg = ModelConfig.from_preset(preset)
    model = meta_model(cfg)
    f = ledger.flops(cfg, context=context)
    per_token = 3 * (f["prefill"]["total"] + 3 * f.get("mtp_prefill", {}).get("total", 0.0))
    ns = {opt: optimizer_flops(model, opt)["newton_schulz"] for opt in ARMS.values() if opt != "adamw"}
    return {"preset": preset, "context": context, "train_flops_per_token": per_token, "ns_flops_per_step": ns,
            "share": share, "tokens_per_step_at_share": {o: v * (1 - share) / share / per_token for o, v in ns.items()}}


def comparisons(raw: dict, budget: str) -> dict:
    """(a, b) -> {metric key: compare(a, b) paired by seed, the expectation "a better"} for COMPARISONS."""
    return {(a, b): {k: compare(per_seed(raw[budget][a], k), per_seed(raw[budget][b], k), side)
                     for k, (_, side) in METRICS.items()} for a, b in COMPARISONS}


def table(raw: dict, settings: dict) -> str:
    """Per budget: one row per arm (lr, steps, tokens, FLOPs, NS share, optimizer time share, scores as mean ±
    sd [95% t]) and the comparisons' paired verdicts; then the lr sweep."""
    head = ["arm", "optimizer", "peak lr", "steps", "train tokens", "TFLOP (model + NS)", "NS share of FLOPs",
            "optimizer share of step time", "val bpb [95% t]", "val loss (nats) [95% t]", "MQAR acc [95% t]",
            f"MTP acceptance (k={DRAFT_STEPS}) [95% t]"]
    out = []
    for budget in BUDGETS:
        rows = []
        for arm, opt in ARMS.items():
            runs = list(raw[budget][arm].values())
            fl = runs[0]["flops"]
            time_share = statistics.fmean(r["optimizer_seconds"] / r["train_seconds"] for r in runs)
            rows.append([arm, opt, f"{settings['lrs'][arm]:g}", runs[0]["steps"], runs[0]["tokens"],
                         f"{fl['model'] / 1e12:.3g} + {fl['optimizer'] / 1e12:.3g}",
                         f"{fl['optimizer'] / fl['total']:.1%}",
                         f"{time_share:.1%}",
                         *(interval(seed_values(raw[budget][arm], k)).text(d) for k, d in
                           (("val_bpb", 4), ("val_loss", 4), ("mqar_accuracy", 3), ("acceptance_length", 2)))])
        cmp_rows = [[f"{a} better than {b}", *(compare_text(c[k], 4 if k == "val_bpb" else 3) for k in METRICS)]
                    for (a, b), c in comparisons(raw, budget).items()]
        out.append(f"### {budget}\n\n" + markdown_table(head, rows) + "\n"
                   + markdown_table(["expectation tested", *(f"{lbl}: a - b, paired [95% t]: verdict"
                                                             for lbl, _ in METRICS.values())], cmp_rows))
    lrs = sorted({float(k) for arm in ARMS for k in settings["sweep"][arm]})
    sweep_rows = [[arm, *("-" if repr(lr) not in settings["sweep"][arm] else
                          f"{settings['sweep'][arm][repr(lr)]:.4f}" + (" *" if lr == settings["lrs"][arm] else "")
                          for lr in lrs)] for arm in ARMS]
    return ("Validation bits per byte and loss (DSA on), MQAR per-query accuracy and greedy MTP acceptance length, "
            "mean ± sd [95% t-interval] over seeds. No report figure: each comparison tests that the first arm is "
            "better (lower bpb, higher MQAR and acceptance): 'reproduced' = the paired 95% interval lies on that "
            "side, 'opposite' = on the other, 'inconclusive' = it contains zero. FLOPs: model forward + backward "
            "(FlopCounterMode) + Newton-Schulz (optim.flops).\n\n" + "\n".join(out)
            + f"\n### learning-rate sweep (seed {settings['sweep_seed']}, equal tokens; validation loss on windows "
              "disjoint from the scored ones; * = chosen)\n\n"
            + markdown_table(["arm", *(f"peak lr {lr:g}" for lr in lrs)], sweep_rows))


def notes(raw: dict, settings: dict) -> list[str]:
    """The budgets' headline verdicts, the cost of Newton-Schulz here and at GLM-5's shape, the time-matched
    factor, sweep edges, what the study does not show."""
    out = []
    for budget in BUDGETS:
        c = comparisons(raw, budget)[("Muon Split", "AdamW")]["val_bpb"]
        out.append(f"{budget}: Muon Split vs AdamW, val bpb {compare_text(c, 4)}.")
    fl = {arm: next(iter(raw["equal tokens"][arm].values()))["flops"] for arm in ARMS}
    ref = fl[REFERENCE]
    scales = settings["compute_scales"]
    out.append(f"Newton-Schulz is {ref['optimizer'] / ref['total']:.1%} of the Muon Split arm's FLOPs at this size "
               f"(whole-matrix Muon {fl['Muon']['optimizer'] / fl['Muon']['total']:.1%}): equal compute gives AdamW "
               f"x{scales['AdamW']:.3f} the steps, whole-matrix Muon x{scales['Muon']:.3f}, K/V apart "
               f"x{scales['Muon Split, K/V apart']:.3f}. The routed experts take "
               f"{settings['step_flops']['expert_share'][REFERENCE]:.0%} of it: each expert's matrices are "
               "orthogonalised every step while each expert sees only its share of the batch's tokens.")
    secs = {arm: seed_mean(raw["equal tokens"][arm], "train_seconds") for arm in ARMS}
    out.append("Measured instead (equal-token runs, mean wall seconds): equal time would give AdamW x"
               f"{secs[REFERENCE] / secs['AdamW']:.3f} the steps of Muon Split and whole-matrix Muon x"
               f"{secs[REFERENCE] / secs['Muon']:.3f} ({settings['threads']} thread(s) on {settings['device']}; "
               "machine-dependent, so the budget is the FLOP count).")
    g = settings["at_glm5_scale"]
    need = g["tokens_per_step_at_share"]["muon-split"]
    out.append(f"At GLM-5's shape (preset {g['preset']}, {g['context']}-token context) Muon Split's Newton-Schulz "
               f"costs {g['ns_flops_per_step']['muon-split'] / 1e15:.1f} PFLOP per step against "
               f"{g['train_flops_per_token'] / 1e9:.0f} GFLOP of training per token: it falls below "
               f"{g['share']:.0%} of the step from {need / 1e6:.1f}M tokens per step, so the charge that matters "
               "here is small at the report's scale (batch size not stated in the report).")
    for arm in ARMS:
        tried = sorted(float(k) for k in settings["sweep"][arm])
        if len(tried) > 1 and settings["lrs"][arm] in (tried[0], tried[-1]):
            out.append(f"{arm}: the chosen lr {settings['lrs'][arm]:g} is still at the edge of the sweep "
                       f"{[f'{x:g}' for x in tried]} after its extensions; a wider grid may find a better one.")
    extended = [f"{arm} ({', '.join(f'{float(k):g}' for k in settings['sweep'][arm] if float(k) not in grid)})"
                for arm in ARMS if len(settings["sweep"][arm]) > len(grid := settings["size"]["lrs"])]
    if extended:
        out.append("The sweep went past its grid for: " + "; ".join(extended) + " (the best lr was at an edge).")
    out.append("K/V apart: no published expectation (torchtitan's DistMuon and other public Muon Split code keep a "
               "head's K and V rows in one block; the report does not say); its row tests 'K/V apart is better'.")
    out.append("What this does not show: the report's scale (billions of parameters, batches of millions of tokens, "
               "where Newton-Schulz is a small share), downstream benchmarks, or lr schedules other than the "
               "default one scaled; the models are CPU-sized and trained for minutes.")
    return out


def plot(raw: dict, settings: dict, path) -> None:
    """Val bpb per arm at both budgets (mean bars, seed dots); the lr sweep; FLOPs per run (model and NS)."""
    plt = figure()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    arms, x = list(ARMS), range(len(ARMS))
    for k, (budget, color) in enumerate(zip(BUDGETS, ("tab:blue", "tab:orange"), strict=True)):
        vals = [seed_values(raw[budget][arm], "val_bpb") for arm in arms]
        pos = [i + (k - 0.5) * 0.38 for i in x]
        axes[0].bar(pos, [statistics.fmean(v) for v in vals], width=0.36, color=color, alpha=0.6, label=budget)
        for p, v in zip(pos, vals, strict=True):
            axes[0].plot([p] * len(v), v, "k.")
    everything = [v for b in BUDGETS for a in arms for v in seed_values(raw[b][a], "val_bpb")]
    lo, hi = min(everything), max(everything)
    axes[0].set_ylim(lo - 0.2 * max(hi - lo, 0.01), hi + 0.2 * max(hi - lo, 0.01))
    axes[0].set(ylabel="validation bits per byte", title="val bpb by optimizer (dots: seeds)")
    for arm in arms:
        tried = sorted(settings["sweep"][arm], key=float)
        axes[1].plot([float(k) for k in tried], [settings["sweep"][arm][k] for k in tried], marker="o", label=arm)
    axes[1].set_xscale("log")
    axes[1].set(xlabel="peak lr (dense stage)", ylabel="sweep validation loss (nats)",
                title=f"lr sweep (seed {settings['sweep_seed']})")
    for k, budget in enumerate(BUDGETS):
        fl = [next(iter(raw[budget][a].values()))["flops"] for a in arms]
        pos = [i + (k - 0.5) * 0.38 for i in x]
        axes[2].bar(pos, [f["model"] / 1e12 for f in fl], width=0.36, color="tab:gray",
                    label="model fwd+bwd" if k == 0 else None)
        axes[2].bar(pos, [f["optimizer"] / 1e12 for f in fl], width=0.36, bottom=[f["model"] / 1e12 for f in fl],
                    color="tab:red", label="Newton-Schulz" if k == 0 else None)
    axes[2].set(ylabel="TFLOP per run", title="compute per run (left: equal tokens, right: equal compute)")
    for ax in (axes[0], axes[2]):
        ax.set_xticks(list(x), [a.replace(", ", ",\n") for a in arms], fontsize=8)
    for ax in axes:
        ax.legend(fontsize=8)
    save_png(fig, path)


def readme_row(info: dict) -> dict:
    """The summary row from a parsed results.json: bpb per arm at both budgets; the verdicts of Muon Split vs
    AdamW at both budgets and of the split comparisons at equal tokens, worded as in the table."""
    raw = info["raw"]
    ours = "; ".join(f"{b}: val bpb " + ", ".join(f"{a} {seed_mean(raw[b][a], 'val_bpb'):.3f}" for a in ARMS)
                     for b in BUDGETS)
    picks = [("equal tokens", COMPARISONS[0]), ("equal compute", COMPARISONS[0]),
             ("equal tokens", COMPARISONS[2]), ("equal tokens", COMPARISONS[3])]
    verdict = "; ".join(f"{a} lower than {b} ({budget}, bpb): "
                        f"{compare_text(comparisons(raw, budget)[(a, b)]['val_bpb'], 4)}" for budget, (a, b) in picks)
    return {"paper": "not measured in the report (the seed's first open question)", "ours": ours, "verdict": verdict}
