"""`glm5lab ablate baseline`: the `small` preset against the dense GPT a CPU user would reach for.

No report figure. Three arms on `glm5lab train`'s text, tokenizer (vocab 4096) and document split
(`data.pipeline.prepare_data`; `--data` picks another corpus); not the runner's `Workbench` (no MQAR rows).

  GLM-5 small        `presets.small` (MLA, DSA top-64, MoE 16 experts top-2 + shared, MTP) with
                     `glm5lab train`'s recipe: `recipe.default_stages` (dense with MTP, indexer
                     warm-up, sparse adaptation) with the 300/40/80 steps scaled to the size, and
                     its default optimizer "muon-split".
  dense GPT + AdamW  nanoGPT-shaped, from our `ModelConfig`: MHA (GQA layers, KV heads = heads)
  dense GPT + Muon   with heads of 64 and RoPE on all 64 dims (our model has no learned absolute
                     positions), a SwiGLU MLP in every layer, no MoE/MLA/DSA/MTP; small's vocab,
                     width and untied head. `dense_gpt_config`: depth at SwiGLU width 8/3 x
                     hidden so that the activated parameters per token excluding embedding +
                     output and MTP (`ledger`; the Kaplan convention; MTP is a training aid that
                     inference drops) match small's, then the width tuned in steps of 16; the
                     embedding and head are equal, so the counts with them match too. For small:
                     4 layers x 256, SwiGLU 688 (3,164,416 vs 3,162,752). One LM-only stage of as
                     many steps as the GLM-5 arm's three, with its dense stage's schedule shape
                     (warm-up fraction, linear decay to lr/10): AdamW at peak 2e-3 (`ADAMW_LR`;
                     betas 0.9/0.95 as nanoGPT), Muon ("muon" = "muon-split" on GQA) at the dense
                     stage's 3e-3. Every arm: `glm5lab train`'s weight decay, clipping, router
                     bias rate (`fit.TRAIN_HYPER`, `glm5lab train`'s `TrainHyper`).

Every arm of a seed sees the same batches in the same order (`text_batches`: global step k is batch k of one
`BatchStream` over the training split, seeded by the seed) and starts from `torch.manual_seed(seed)`. Scores:
validation loss (nats/token) and bits per byte (`evals.bpb`) over fixed validation windows (the whole split at
the cpu size), the GLM-5 arm with DSA on as in its last stage; BLiMP accuracy (`glm5lab.evals.blimp`, the
mean over paradigms of the first SIZES[...]["blimp"] pairs of each: 50 of 1,000 at the cpu size, about 6,700
sentences, about 30 s per arm at one thread); training wall seconds (sum of `fit`'s step
times, no evaluation) and training tokens per second. Comparisons are paired by seed (`ablate.stats`).

Sizes: "cpu" (default) 168 steps (120/16/32) of 8 x 256 tokens, 2 seeds: 19 minutes at one thread (on a shared
2-core machine); "gpu" the preset scaled up (`GPU_SHAPE`: hidden 768, 8 layers, 16 experts of 256, DSA top-512
at 2048 tokens; 99.1M total / 41.3M activated with embeddings) against a 5 x 768 dense GPT (SwiGLU 2016), 2100
steps of 8 x 2048 tokens, 2 seeds: estimated (not measured) 1-2 hours on one H200 in fp32. The default corpus
(1.5M training tokens) is too small for it (about 23 epochs): use `--data` with a larger corpus.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import torch

from glm5lab import ledger
from glm5lab.ablate.fit import TRAIN_HYPER, fit, glm5_stages
from glm5lab.ablate.measure import text_score
from glm5lab.ablate.models import GPU_SHAPE, seeded_model
from glm5lab.ablate.results import StudyResult, figure, markdown_table, save_png
from glm5lab.ablate.runner import StudyArgs
from glm5lab.ablate.stats import compare, compare_text, interval, per_seed, seed_mean, seed_values
from glm5lab.ablate.workbench import SPLIT_SEED, BatchFn
from glm5lab.config import ModelConfig
from glm5lab.data.batches import BatchStream, pack
from glm5lab.evals.bpb import token_byte_lengths
from glm5lab.train.stages import Stage

GLM5, ADAMW, MUON = "GLM-5 small", "dense GPT + AdamW", "dense GPT + Muon"
OPTIMIZERS = {GLM5: "muon-split", ADAMW: "adamw", MUON: "muon"}
COMPARISONS = ((GLM5, ADAMW), (GLM5, MUON), (MUON, ADAMW))
MATCHED = "without_embeddings_without_mtp"
SHOWN = (MATCHED, "with_embeddings_without_mtp")
HEAD_DIM = 64
ADAMW_LR = {"small": 2e-3, "gpu": 6e-4}
"""Peak AdamW lr. small: the best of a one-seed probe at the cpu size (seed 100, not a study seed;
first 128 validation windows, nats/token): 1e-3 5.476, 2e-3 5.341, 3e-3 5.403, 6e-3 5.602.
gpu: nanoGPT's value for GPT-2 small (124M). Muon is not tuned: both Muon arms keep `glm5lab
train`'s 3e-3 (the same probe gave the dense GPT + Muon 5.058 at 1.5e-3 and 4.795 at 6e-3)."""
SIZES = {  # steps: the GLM-5 arm's total, split 300/40/80 as default_stages; val_windows None = all;
    # blimp: BLiMP pairs per paradigm scored per arm and seed (of 1,000; x 67 paradigms)
    "quick": dict(model="small", T=128, batch=2, steps=5, val_windows=4, seeds=2, blimp=1),
    "cpu": dict(model="small", T=256, batch=8, steps=168, val_windows=None, seeds=2, blimp=50),
    "gpu": dict(model="gpu", T=2048, batch=8, steps=2100, val_windows=None, seeds=2, blimp=1000),
    "gpu-quick": dict(model="gpu", T=2048, batch=1, steps=2, val_windows=1, seeds=1, blimp=1),
}


def glm5_config(s: dict) -> ModelConfig:
    """The small preset, or (model "gpu") the preset scaled up by GPU_SHAPE."""
    return ModelConfig.from_preset("small") if s["model"] == "small" else ModelConfig.from_preset("small", **GPU_SHAPE)


def activated(cfg: ModelConfig) -> int:
    """Activated parameters per token under the matched convention (ledger: no embedding/output, no MTP)."""
    return ledger.count(cfg, embeddings=False, mtp=False, active=True)


def dense_gpt(base: ModelConfig, layers: int, ffn: int) -> ModelConfig:
    """`base` made a dense GPT: `layers` MHA layers (heads of HEAD_DIM, full RoPE), SwiGLU of width `ffn`."""
    heads = base.hidden_size // HEAD_DIM
    return base.replace(num_hidden_layers=layers, attention_types=["gqa"] * layers, mlp_layer_types=["dense"] * layers,
                        mixer_types=None, indexer_types=None, num_attention_heads=heads, num_key_value_heads=heads,
                        q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=HEAD_DIM,
                        v_head_dim=HEAD_DIM, intermediate_size=ffn, use_dsa=False, index_n_heads=0,
                        index_head_dim=0, num_nextn_predict_layers=0)


def dense_gpt_config(glm5: ModelConfig) -> ModelConfig:
    """The dense GPT whose `activated` count is closest to `glm5`'s: depth at SwiGLU width 8/3 x
    hidden, then the width (a multiple of 16) for that depth."""
    target, width = activated(glm5), 16 * round(8 * glm5.hidden_size / 3 / 16)
    miss = lambda cfg: abs(activated(cfg) - target)  # noqa: E731
    layers = min(range(1, 4 * glm5.num_hidden_layers + 1), key=lambda n: miss(dense_gpt(glm5, n, width)))
    ffn = min(range(16, 8 * glm5.hidden_size + 1, 16), key=lambda f: miss(dense_gpt(glm5, layers, f)))
    return dense_gpt(glm5, layers, ffn)


def dense_stage(glm5: list[Stage], lr: float) -> Stage:
    """One LM-only stage of the GLM-5 arm's total steps with its dense stage's schedule shape."""
    first, steps = glm5[0], sum(st.steps for st in glm5)
    warmup = min(round(steps * first.warmup_steps / first.steps), steps - 1)
    return Stage("lm", steps, lr, first.seq_len, first.batch_size, lr_end=lr * first.lr_end / first.lr,
                 warmup_steps=warmup, mtp_weights=())


def plans(s: dict) -> dict[str, list[Stage]]:
    """Arm -> its stages (see the module docstring)."""
    glm5 = glm5_stages(s)
    return {GLM5: glm5, ADAMW: [dense_stage(glm5, ADAMW_LR[s["model"]])], MUON: [dense_stage(glm5, glm5[0].lr)]}


def text_batches(windows: torch.Tensor, batch_size: int, seed: int, stages: list[Stage]) -> BatchFn:
    """(stage index, stage, step in stage) -> (ids, labels) [batch_size, L]: global step k (over
    `stages`) is batch k of one seeded BatchStream of `windows` [N, L + 1], whatever the split into stages."""
    stream = BatchStream(windows, batch_size, seed=seed)
    offsets = list(itertools.accumulate([0] + [st.steps for st in stages[:-1]]))

    def batch(stage_index: int, stage: Stage, i: int):
        w = stream.batch(offsets[stage_index] + i)
        return w[:, :-1], w[:, 1:]

    return batch


def train_and_score(cfg: ModelConfig, stages: list[Stage], optimizer: str, batches: BatchFn, seed: int,
                    val_BT: torch.Tensor, byte_lengths: torch.Tensor, device, blimp_lm=None) -> dict:
    """Train one arm for one seed on `device`; its raw numbers. blimp_lm(model, use_dsa) -> BLiMP accuracy
    (`blimp_score`), or None for no BLiMP score."""
    model = seeded_model(cfg, seed, device)
    records = fit(model, stages, batches, hyper=dataclasses.replace(TRAIN_HYPER, optimizer=optimizer), seed=seed)
    t0 = time.perf_counter()
    scores = text_score(model, val_BT, byte_lengths, use_dsa=stages[-1].use_dsa)
    if blimp_lm is not None:
        scores["blimp"] = blimp_lm(model, stages[-1].use_dsa)
    seconds = sum(r["seconds"] for r in records)
    tokens = sum(st.steps * st.batch_size * st.seq_len for st in stages)
    return {**scores, "train_seconds": seconds, "train_tokens": tokens, "tokens_per_s": tokens / seconds,
            "last_train_loss": records[-1]["lm_loss"], "eval_seconds": time.perf_counter() - t0}


def run(args: StudyArgs, bench=None) -> StudyResult:
    """Train the three arms for every seed on the same batches and score them; the StudyResult.
    `bench` (the runner's Workbench) is not used: see the module docstring."""
    from glm5lab.data.pipeline import prepare_data

    s, seeds = args.size_and_seeds(SIZES)
    plan = plans(s)
    cfgs = {GLM5: glm5_config(s)}
    cfgs[ADAMW] = cfgs[MUON] = dense_gpt_config(cfgs[GLM5])
    data = prepare_data(cfgs[GLM5].vocab_size, args.data, SPLIT_SEED)
    windows = pack(data.train_tokens, s["T"])
    val = pack(data.val_tokens, s["T"])[:s["val_windows"]]
    byte_lengths = token_byte_lengths(data.tokenizer, cfgs[GLM5].vocab_size)
    score_blimp = blimp_score(data.tokenizer, s["blimp"])
    raw = {arm: {} for arm in OPTIMIZERS}
    for seed in seeds:
        for arm, optimizer in OPTIMIZERS.items():
            batches = text_batches(windows, s["batch"], seed, plan[arm])
            r = train_and_score(cfgs[arm], plan[arm], optimizer, batches, seed, val, byte_lengths, args.device,
                                score_blimp)
            raw[arm][str(seed)] = r
            args.say(f"seed {seed}: {arm} val bpb {r['val_bpb']:.3f} ({r['val_loss']:.3f} nats/token), "
                     f"BLiMP {100 * r['blimp']:.1f}% ({s['blimp']} pairs per paradigm), "
                     f"{r['train_seconds']:.0f} s, {r['tokens_per_s']:.0f} tok/s")
    settings = {"size": s, "scale": args.size_key, "device": str(args.device), "threads": torch.get_num_threads(),
                "optimizers": OPTIMIZERS,
                "train": {k: v for k, v in dataclasses.asdict(TRAIN_HYPER).items() if k != "optimizer"},
                "stages": {a: [st.to_dict() for st in p] for a, p in plan.items()},
                "matched_convention": MATCHED, "params": {a: ledger.conventions(c) for a, c in cfgs.items()},
                "flops_per_token": {a: ledger.flops(c, context=s["T"])["prefill"]["total"] for a, c in cfgs.items()},
                "eval": {"windows": len(val), "seq_len": s["T"], "whole_val_split": s["val_windows"] is None,
                         "glm5_use_dsa": plan[GLM5][-1].use_dsa, "blimp_pairs_per_paradigm": s["blimp"]},
                "data": {"source": data.source, "train_tokens": len(data.train_tokens),
                         "val_tokens": len(data.val_tokens),
                         "epochs": sum(st.steps for st in plan[GLM5]) * s["batch"] * s["T"] / len(data.train_tokens)},
                "models": {a: c.to_hf() for a, c in cfgs.items()}}
    return result(raw, settings, seeds)


def result(raw: dict, settings: dict, seeds: list[int]) -> StudyResult:
    """The StudyResult of these raw numbers and settings (as `run` builds them or results.json holds them)."""
    return StudyResult("baseline", table(raw, settings), raw, settings, seeds, lambda path: plot(raw, path),
                       notes(raw, settings))


def blimp_score(tokenizer, pairs_per_paradigm: int):
    """(model, use_dsa) -> BLiMP accuracy (the mean over the 67 paradigms, `glm5lab.evals.blimp`) on the first
    `pairs_per_paradigm` pairs of each, with the packaged data; the model is scored in eval mode."""
    from glm5lab.evals import blimp
    from glm5lab.evals.causal_lm import model_lm

    pairs, published = blimp.load_pairs(limit=pairs_per_paradigm), blimp.load_published()

    def score(model, use_dsa: bool) -> float:
        model.eval()
        good, bad = blimp.score_pairs(model_lm(model, tokenizer, "arm", use_dsa=use_dsa), pairs, progress=False)
        return blimp.summarize(pairs, good, bad, published)["overall"]["accuracy"]

    return score


def bpb_comparisons(raw: dict) -> dict:
    """(a, b) -> compare(a's bpb, b's bpb) paired by seed; report_sign -1: the expectation tested is a < b."""
    return {(a, b): compare(per_seed(raw[a], "val_bpb"), per_seed(raw[b], "val_bpb"), report_sign=-1)
            for a, b in COMPARISONS}


def speed_ratio(raw: dict, a: str, b: str):
    """Interval of a's tok/s / b's, per seed."""
    return interval([raw[a][k]["tokens_per_s"] / raw[b][k]["tokens_per_s"] for k in raw[a] if k in raw[b]])


def _millions(p: dict) -> str:
    return f"{p['total'] / 1e6:.2f}M / {p['activated'] / 1e6:.2f}M"


def table(raw: dict, settings: dict) -> str:
    """The arms (mean ± sd [95% t] over seeds) and the paired comparisons."""
    shown = [f"params total / activated, {ledger.CONVENTIONS[c]}" for c in SHOWN]
    scored = [("val_bpb", 3), ("val_loss", 3), ("train_seconds", 0), ("tokens_per_s", 0)]
    head = ["arm", "optimizer (peak lr)", "layers x hidden", *shown, "train tokens", "val bpb [95% t]",
            "val loss (nats/token) [95% t]", "train wall s [95% t]", "tok/s [95% t]"]
    if all("blimp" in r for arm in raw.values() for r in arm.values()):  # results.json of before BLiMP lack it
        scored.append(("blimp", 3))
        head.append(f"BLiMP accuracy, {settings['eval'].get('blimp_pairs_per_paradigm')} pairs/paradigm [95% t]")
    rows = []
    for arm, opt in OPTIMIZERS.items():
        m, p = settings["models"][arm], settings["params"][arm]
        rows.append([arm, f"{opt} ({settings['stages'][arm][0]['lr']:g})",
                     f"{m['num_hidden_layers']} x {m['hidden_size']}", *(_millions(p[c]) for c in SHOWN),
                     next(iter(raw[arm].values()))["train_tokens"],
                     *(interval(seed_values(raw[arm], k)).text(digits) for k, digits in scored)])
    cmp_rows = [[f"{a} vs {b}", compare_text(c), speed_ratio(raw, a, b).text(2)]
                for (a, b), c in bpb_comparisons(raw).items()]
    return ("Validation bits per byte and loss, training time and speed, mean ± sd [95% t-interval] over seeds; "
            f"activated parameters matched {ledger.CONVENTIONS[MATCHED]} (within 5%). No report figure: the "
            "expectation tested is that the first arm of each comparison has the LOWER bpb (report_sign -1): "
            "'reproduced' = the paired 95% interval of its difference lies below zero, 'opposite' = above, "
            "'inconclusive' = it contains zero.\n\n" + markdown_table(head, rows) + "\n"
            + markdown_table(["comparison", "val bpb difference, paired by seed [95% t]: verdict",
                              "tok/s ratio [95% t]"], cmp_rows))


def notes(raw: dict, settings: dict) -> list[str]:
    """Inconclusive comparisons, what is matched and what is not, the GLM-5 recipe's costs."""
    out = [f"{a} vs {b} (val bpb): inconclusive; {compare_text(c)}."
           for (a, b), c in bpb_comparisons(raw).items() if c["verdict"].startswith("inconclusive")]
    p, f = settings["params"], settings["flops_per_token"]
    out.append(f"Matched: activated parameters per token {ledger.CONVENTIONS[MATCHED]} "
               f"({p[GLM5][MATCHED]['activated']:,} vs {p[ADAMW][MATCHED]['activated']:,}); embedding and untied "
               "output are the same size in both. Not "
               f"matched: total parameters (MoE) and forward FLOPs per token at the training length (ledger: "
               f"{f[GLM5] / 1e6:.1f}M vs {f[ADAMW] / 1e6:.1f}M, the GLM-5 figure without its MTP layer).")
    glm5 = settings["stages"][GLM5]
    warm = sum(st["steps"] for st in glm5 if st["lm_weight"] == 0)
    out.append(f"The GLM-5 arm spends {warm} of its {sum(st['steps'] for st in glm5)} steps on the indexer warm-up "
               "(only the indexer trains, no LM loss) and trains an MTP loss (depth 3, weight 0.3) in its dense and "
               "sparse stages: its recipe, counted in its wall time and tokens. Every arm sees the same batches.")
    e, d = settings["eval"], settings["data"]
    which = "the whole validation split" if e["whole_val_split"] else "from the start of the validation split"
    out.append(f"Validation: {e['windows']} windows of {e['seq_len']} tokens ({which}), "
               f"GLM-5 with DSA {'on' if e['glm5_use_dsa'] else 'off'}; bpb counts the document separators' loss at "
               "0 bytes, the same for every arm.")
    if e.get("blimp_pairs_per_paradigm"):
        out.append(f"BLiMP: the mean over its 67 paradigms of the first {e['blimp_pairs_per_paradigm']} pairs each "
                   "(`glm5lab eval blimp --limit`; a subset at the cpu size for time), each arm's final model in "
                   "eval mode, GLM-5 with DSA as validated; on the default Shakespeare corpus a modern-English "
                   "benchmark stays near chance (README, BLiMP).")
    out.append(f"Data: {d['source']} with `glm5lab train`'s tokenizer and split ({d['train_tokens']:,} training "
               f"tokens; each arm trains {d['epochs']:.2f} epochs); text only, the ablation workbench is not used.")
    out.append(f"Peak lr: AdamW {settings['stages'][ADAMW][0]['lr']:g} (the best of a one-seed probe, `ADAMW_LR`); "
               f"both Muon arms {settings['stages'][MUON][0]['lr']:g}, `glm5lab train`'s, not tuned.")
    out.append(f"Times: sum of training step times on {settings['device']} with {settings['threads']} thread(s), "
               "no evaluation; a shared machine makes them noisy.")
    return out


def readme_row(info: dict) -> dict:
    """The README's line for this study from a parsed results.json (no training)."""
    raw = info["raw"]
    mean = {arm: {k: seed_mean(raw[arm], k) for k in ("val_bpb", "tokens_per_s")} for arm in raw}
    cmps = bpb_comparisons(raw)
    ours = ", ".join(f"{arm} {mean[arm]['val_bpb']:.3f}" for arm in OPTIMIZERS)
    speed = " / ".join(f"{mean[arm]['tokens_per_s']:.0f}" for arm in OPTIMIZERS)
    verdict = "; ".join(f"{a} lower than {b} (bpb): {compare_text(cmps[(a, b)])}" for a, b in COMPARISONS[:2])
    return {"paper": "no paper figure (the comparison a CPU user would make)",
            "ours": f"val bits per byte {ours}; training tok/s {speed}", "verdict": verdict}


def plot(raw: dict, path) -> None:
    """Validation bpb and training tok/s per arm: mean bars, seed dots."""
    plt = figure()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    arms, x = list(OPTIMIZERS), range(len(OPTIMIZERS))
    panels = ((axes[0], "val_bpb", "validation bits per byte"), (axes[1], "tokens_per_s", "training tok/s"))
    for ax, key, label in panels:
        vals = [seed_values(raw[arm], key) for arm in arms]
        ax.bar(x, [statistics.fmean(v) for v in vals], color="tab:blue", alpha=0.6, label="mean")
        for i, v in enumerate(vals):
            ax.plot([i] * len(v), v, "k.", label="seeds" if i == 0 else None)
        if key == "val_bpb":
            lo, hi = min(min(v) for v in vals), max(max(v) for v in vals)
            ax.set_ylim(lo - 0.1 * max(hi - lo, 0.1), hi + 0.1 * max(hi - lo, 0.1))
        ax.set_xticks(list(x), [a.replace(" + ", "\n+ ") for a in arms], fontsize=8)
        ax.set(ylabel=label, title=label)
        ax.legend(fontsize=8)
    save_png(fig, path)
