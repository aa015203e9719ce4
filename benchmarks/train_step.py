"""Training-step throughput: glm5lab eager and compiled vs transformers' GlmMoeDsaForCausalLM, MFU,
optimizer share, compile time.

In one process, on one config and the same initial weights, timed interleaved (see common.py):
- ours, full step: the step `glm5lab train` runs: forward with MTP (depth 3, weights 0.3), the
  stage's losses (`glm5lab.train.losses.stage_losses`: CE + MTP, + the indexer KL with --dsa),
  then `glm5lab.train.step.optimizer_step` (backward, non-finite check, grad clip, the `MuonAdamW`
  Muon Split step, router bias update) with `TrainHyper`'s defaults, `glm5lab train`'s (optimizer,
  weight decay, clip, bias rate);
- ours, full step, compiled: the same with the losses' forward and backward through torch.compile
  (`glm5lab.train.compile.CompiledLosses`, inductor: what `glm5lab train --compile` runs);
- ours, like for like: forward without MTP, CE, backward, `torch.optim.AdamW` step; and the same
  compiled;
- transformers: `glm5lab.hf.load_transformers_twin` of our saved weights (its default attention
  implementation, sdpa, and its default experts implementation, which in transformers 5.24 is
  `grouped_mm`: `torch._grouped_mm` over the sorted assignments), forward, CE, backward,
  `torch.optim.AdamW` step (the like-for-like step, `plain_step`, on both); and the same twin
  with `experts_implementation="eager"`: its per-expert Python loop (one matmul chain per hit
  expert). transformers has no MTP, so the headline speedup is like for like (ours eager,
  without MTP, same AdamW, vs transformers' default).
Compile time: every case is called once before the warm-up, timed on its own ("first call");
compile s = first call - the median timed call (for the compiled cases; eager cases show their
first-call overhead only). It depends on inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`,
default /tmp/torchinductor_$USER): the first run on a machine compiles every kernel, later runs
reuse them. Set TORCHINDUCTOR_CACHE_DIR to an empty folder to measure a cold start.
Without --dsa the dense stage (use_dsa=False); transformers has no dense switch (its indexer
always runs and masks to index_topk keys), so there it is loaded with index_topk = seq_len: every
key kept, attention exactly dense, its indexer still computed. With --dsa the sparse-adaptation
stage (use_dsa=True, top-k keys; ours adds the indexer KL loss in the full step only).

--routing glm5: GLM-5's routing shape on the preset: 256 routed experts, top-8, and the glm5
preset's n_group, topk_group and routed_scaling_factor (1, 1, 2.5), at a reduced expert width
(moe_intermediate_size = GLM5_ROUTING_MOE_WIDTH) so that it fits a 2-core CPU; everything else is
the preset's. There a per-expert loop runs 256 matmul chains per MoE layer and direction.

MFU = model FLOPs per step / step time / matmul peak. The ledger has no training FLOPs, so model
FLOPs = 3 x its forward FLOPs per token ("prefill" at context T on T tokens, plus "mtp_prefill"
at context T-j on T-j tokens for each MTP depth j), with the ledger's conventions (2 per
multiply-add; norms, softmax, activations, the indexer KL and the optimizer not counted).
Peak = median GFLOP/s of a large `torch.mm` (fp32 2048^3 on CPU, bf16 8192^3 on CUDA), timed
in the same process and thread count, interleaved with the cases so it sees the same load.
Before timing, both models' losses on the first window cut to index_topk tokens must agree
(`PARITY_RTOL`): the comparison is between the same weights; and each compiled case's first loss
must equal its eager twin's (`COMPILED_RTOL`).

    # small preset, 8 x 256, fp32 CPU, dense stage (about 4.5 min on one thread, 2 of them compiling)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step.py --threads 1
    # GLM-5's routing: 256 experts, top-8 (about 7 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step.py --threads 1 --routing glm5
    # sparse-adaptation stage
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step.py --threads 1 --dsa
    # tiny preset, 2 x 32: checks the script (about 3 min, nearly all compiling)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step.py --threads 1 --quick
    # a cold start (empty inductor cache), as the compile times in BENCHMARKS.md were measured
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_step.py --threads 1
    # top ops of one full step
    .venv/bin/python benchmarks/train_step.py --profile ours
    # only the full step, eager and compiled (scripts/gpu_check.sh: bf16 on CUDA, its MFU)
    .venv/bin/python benchmarks/train_step.py --device cuda --cases ours,ours-compiled

--cases times a subset; the ratios and goals that need a case not timed print "not measured" (null in the JSON).

Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, matmul_case, median, print_json_line, setup_device, time_interleaved, timed

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.environment import env_facts, load_average
from glm5lab.hf import load_transformers_twin
from glm5lab.ledger import flops
from glm5lab.train.balance import moe_layers
from glm5lab.train.compile import CompiledLosses
from glm5lab.train.losses import cross_entropy, stage_losses
from glm5lab.train.recipe import TrainHyper, default_stages
from glm5lab.train.stages import Stage
from glm5lab.train.step import optimizer_step, set_trainable

GOALS = {"speedup": 3.0, "mfu": 0.40, "muon_split_share": 0.15}
"""Targets: like-for-like tokens/s >= 3x transformers' (its default experts implementation);
full step >= 40% of the matmul peak; the Muon Split optimizer step <= 15% of the full step."""
GLM5_ROUTING_GOALS = {**GOALS, "speedup_vs_loop": 3.0}
"""--routing glm5 adds: like-for-like tokens/s >= 3x transformers' per-expert loop
(experts_implementation="eager"), the baseline the 256-expert shape was added for."""
TRAIN = TrainHyper.default()
"""`glm5lab train`'s step settings: the full step's optimizer, weight decay, grad clip and router bias rate."""
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": TRAIN.weight_decay}
PARITY_RTOL = 1e-5
"""fp32 CPU: ours and transformers, same weights, on the first window cut to index_topk tokens
(where both attend densely), must give the same loss to this relative error. Observed: equal to
7 digits. Garbage checks (small preset, random init, 64 tokens): one layer's routed experts
reversed 2.1e-3, one layer's kv_b_proj rows reversed 1.6e-4: both fail it. (At full length with
--dsa the two differed by ~7e-5 because of top-k ties: the small preset's then 4 indexer heads
gave exactly equal ReLU scores at the boundary in ~6% of rows; ours keeps the earlier key. It has
16 since issue 11, and such ties are rare: BENCHMARKS.md, "Index-score ties".)"""
COMPILED_RTOL = 1e-4
"""fp32 CPU: a compiled case's first loss (initial weights, window 0) vs its eager twin's, the
bar of tests/train/test_compile.py (observed there <= 2e-7; inductor reorders reductions)."""
GLM5_ROUTING_MOE_WIDTH = 32
"""--routing glm5: moe_intermediate_size (GLM-5: 2048). With the small preset's hidden 256, 6
MoE layers (5 + MTP) of 256 experts hold 38M expert parameters: each of the six models this
benchmark builds fits in ~0.6 GB with its gradients and optimizer state."""
QUICK = {"preset": "tiny", "batch_size": 2, "seq_len": 32, "steps": 1, "repeats": 2, "warmup": 1, "mm_size": 512}
"""--quick: a run that checks the script (its compile time dominates), not one to quote."""
CASES = ("ours", "ours-compiled", "ours-plain", "ours-plain-compiled", "hf", "hf-loop")
COMPILED = {"ours-compiled": "ours", "ours-plain-compiled": "ours-plain"}
"""Each compiled case and its eager twin (same initial weights, same step but the losses' forward
and backward compiled)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help="ModelConfig preset (default: small; tiny with --quick)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per step (default 8; 2 with --quick)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="input tokens per row (windows hold seq-len + 1; default 256, 32 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per timed repeat (default 2; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per case; the median is reported (default 5; 2 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed repeats per case first (default 1)")
    p.add_argument("--dsa", action="store_true", help="sparse-adaptation stage (use_dsa=True) instead of dense")
    p.add_argument("--routing", choices=("preset", "glm5"), default="preset",
                   help="the preset's MoE routing (default), or GLM-5's: 256 experts, top-8 (see the docstring)")
    p.add_argument("--quick", action="store_true", help=f"check the script: {QUICK} unless given")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda runs under bf16 autocast")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--mm-size", type=int, default=None, help="matmul peak size n (default 2048 CPU, 8192 CUDA)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"cases to time, comma-separated (default all: {','.join(CASES)})")
    p.add_argument("--profile", choices=CASES,
                   default=None, help="instead of the benchmark: profile one step of this case, print top ops by "
                   "self CPU time")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else {"preset": "small", "batch_size": 8, "seq_len": 256, "steps": 2,
                                         "repeats": 5, "warmup": 1, "mm_size": None}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.case_list = [c for c in args.cases.split(",") if c]
    bad = sorted(set(args.case_list) - set(CASES))
    if bad or not args.case_list:
        p.error(f"--cases {args.cases!r} is not allowed: one or more of {', '.join(CASES)}")
    if args.profile:
        args.case_list = [args.profile]
    args.case_list = [c for c in CASES if c in args.case_list]
    return args


def model_config(args) -> ModelConfig:
    """The preset, with GLM-5's routing under --routing glm5 (n_routed_experts, num_experts_per_tok,
    n_group, topk_group, routed_scaling_factor of the glm5 preset; expert width GLM5_ROUTING_MOE_WIDTH)."""
    cfg = ModelConfig.from_preset(args.preset)
    if args.routing == "preset":
        return cfg
    glm5 = ModelConfig.from_preset("glm5")
    routing = {k: getattr(glm5, k) for k in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                                             "routed_scaling_factor")}
    return cfg.replace(**routing, moe_intermediate_size=GLM5_ROUTING_MOE_WIDTH)


def stages_for(cfg: ModelConfig, args) -> tuple[Stage, Stage]:
    """(full stage, like-for-like stage): the loop's dense or sparse-adaptation stage, and the same
    without MTP and without the indexer loss."""
    if args.dsa and not cfg.has_indexer_weights:
        raise SystemExit(f"--dsa needs a preset with a DSA indexer; {args.preset!r} has none")
    stages = {s.name: s for s in default_stages(seq_len=args.seq_len, batch_size=args.batch_size,
                                                mtp_depth=3 if cfg.num_nextn_predict_layers else 0,
                                                use_indexer=cfg.has_indexer_weights)}
    full = stages["sparse_adaptation" if args.dsa else "dense"]
    plain = Stage.from_dict({**full.to_dict(), "mtp_weights": (), "indexer_weight": 0.0})
    return full, plain


def step_flops(cfg: ModelConfig, B: int, T: int, mtp_depth: int, use_dsa: bool) -> float:
    """Model FLOPs of one training step: 3 x the ledger's forward FLOPs (see module docstring)."""
    c = cfg.replace(use_dsa=use_dsa)
    forward = T * flops(c, context=T)["prefill"]["total"]
    forward += sum((T - j) * flops(c, context=T - j)["mtp_prefill"]["total"] for j in range(1, mtp_depth + 1))
    return 3.0 * B * forward


class Case:
    """`steps` training steps over fixed windows per call; returns {"optimizer_s", "loss"} and keeps
    the very first loss (initial weights, window 0), printed beside the parity check."""

    def __init__(self, step_fn, windows):
        self.step_fn, self.windows, self.first_loss = step_fn, windows, None

    def __call__(self) -> dict:
        opt_s = 0.0
        for w in self.windows:
            loss, s = self.step_fn(w)
            opt_s += s
            if self.first_loss is None:
                self.first_loss = float(loss)
        return {"optimizer_s": opt_s, "loss": float(loss)}


class TimedOptimizer:
    """`optimizer` with its `step` timed on its own (the device synchronised around it):
    `seconds` sums those times. Everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, device):
        self.optimizer, self.device, self.seconds = optimizer, device, 0.0

    def step(self) -> None:
        s, _ = timed(self.optimizer.step, self.device)
        self.seconds += s

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


def ours_full_step(model, opt, stage: Stage, autocast, device, losses_fn=None):
    """One step of `glm5lab train` (`_Loop.train_step`): the stage's losses under autocast
    (losses_fn(window, stage); default eager `stage_losses`, or a `CompiledLosses`), then the
    library's `optimizer_step` with TRAIN's grad clip and bias rate; the optimizer's own step
    is timed apart (`TimedOptimizer`)."""
    set_trainable(model, stage)
    timed_opt, steps = TimedOptimizer(opt, device), itertools.count(1)
    losses_fn = losses_fn or (lambda window, stage: stage_losses(model, window, stage))

    def step(window):
        with autocast():
            losses = losses_fn(window, stage)
        before = timed_opt.seconds
        optimizer_step(model, timed_opt, losses, stage, next(steps), TRAIN)
        return losses.total.detach(), timed_opt.seconds - before
    return step


def plain_step(model, opt, loss_fn, autocast, device):
    """The like-for-like step, ours (no MTP) and transformers alike: loss_fn(window) under
    autocast, backward, AdamW step (timed on its own), zero_grad; no clipping, no router bias
    (ours' expert-load counters are emptied, O(1); transformers has none)."""
    moes = [moe for _, moe in moe_layers(model)]

    def step(window):
        with autocast():
            loss = loss_fn(window)
        loss.backward()
        opt_s, _ = timed(opt.step, device)
        opt.zero_grad(set_to_none=True)
        for moe in moes:  # the load counter would otherwise grow
            moe.pop_load()
        return loss.detach(), opt_s
    return step


def transformers_twin_of(model: GLM5ForCausalLM, args, device, **overrides):
    """transformers' twin of `model` (`load_transformers_twin` of its `save_pretrained` folder:
    the same weights), fp32, train mode; without --dsa loaded with index_topk = seq_len (every
    key kept: exactly dense attention); `overrides`: more config fields (experts_implementation)."""
    overrides = {**({} if args.dsa else {"index_topk": args.seq_len}), **overrides}
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        hf = load_transformers_twin(folder, dtype=torch.float32, device=device, **overrides)
    return hf.train()


def build_cases(args, device):
    torch.manual_seed(args.seed)
    cfg = model_config(args)
    full_stage, plain_stage = stages_for(cfg, args)
    ours = GLM5ForCausalLM(cfg).train()
    hf = transformers_twin_of(ours, args, device)  # saved from CPU, before `ours` moves (also the parity check's)
    hf_loop = transformers_twin_of(ours, args, device, experts_implementation="eager") if "hf-loop" in \
        args.case_list else None
    ours_c, ours_plain, ours_plain_c = (copy.deepcopy(ours).to(device) for _ in range(3))
    ours = ours.to(device)
    windows = torch.randint(0, cfg.vocab_size, (args.steps, args.batch_size, args.seq_len + 1), device=device)
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)

    def full(model, losses_fn=None):
        opt = TRAIN.build_optimizer(model, full_stage.lr)
        return Case(ours_full_step(model, opt, full_stage, autocast, device, losses_fn), windows)

    def plain(model, loss_fn):
        opt = torch.optim.AdamW(model.parameters(), lr=full_stage.lr, **ADAMW)
        return Case(plain_step(model, opt, loss_fn, autocast, device), windows)

    def hf_loss(model):
        return lambda w: cross_entropy(model(input_ids=w[:, :-1], use_cache=False).logits, w[:, 1:])

    compiled_plain = CompiledLosses(ours_plain_c)
    make = {
        "ours": lambda: full(ours),
        "ours-compiled": lambda: full(ours_c, CompiledLosses(ours_c)),
        "ours-plain": lambda: plain(ours_plain, lambda w: stage_losses(ours_plain, w, plain_stage).total),
        "ours-plain-compiled": lambda: plain(ours_plain_c, lambda w: compiled_plain(w, plain_stage).total),
        "hf": lambda: plain(hf, hf_loss(hf)),
        "hf-loop": lambda: plain(hf_loop, hf_loss(hf_loop)),
    }
    cases = {name: make[name]() for name in args.case_list}
    info = {"cfg": cfg, "full_stage": full_stage, "attn_implementation": hf.config._attn_implementation,
            "experts_implementation": hf.config._experts_implementation,
            "parity": same_weights_check(ours_plain, hf, windows[0], cfg, autocast)}
    return cases, info


@torch.no_grad()
def same_weights_check(ours, hf, window_BT1, cfg: ModelConfig, autocast) -> dict:
    """Loss of both models on the window cut to index_topk + 1 tokens (exactly dense attention in
    both); raises SystemExit when they differ by more than PARITY_RTOL (CPU fp32 only)."""
    w = window_BT1[:, : min(window_BT1.shape[1], cfg.index_topk + 1)]
    with autocast():
        ours_loss = float(cross_entropy(ours(w[:, :-1], use_dsa=False).logits, w[:, 1:]))
        hf_loss = float(cross_entropy(hf(input_ids=w[:, :-1], use_cache=False).logits, w[:, 1:]))
    for _, moe in moe_layers(ours):
        moe.pop_load()
    rel = abs(ours_loss - hf_loss) / abs(hf_loss)
    if w.device.type == "cpu" and rel > PARITY_RTOL:
        raise SystemExit(f"ours and transformers disagree ({ours_loss} vs {hf_loss}, relative {rel:.1e} > "
                         f"{PARITY_RTOL}): the two models do not hold the same weights")
    return {"tokens": w.shape[1] - 1, "ours": ours_loss, "hf": hf_loss, "relative": rel}


def compiled_check(first_losses: dict, device) -> dict:
    """Relative difference of each compiled case's first loss from its eager twin's; raises
    SystemExit above COMPILED_RTOL (CPU fp32 only)."""
    out = {}
    for case, twin in COMPILED.items():
        if case not in first_losses or twin not in first_losses:
            continue
        rel = abs(first_losses[case] - first_losses[twin]) / abs(first_losses[twin])
        if device.type == "cpu" and rel > COMPILED_RTOL:
            raise SystemExit(f"{case} and {twin} disagree on the first loss ({first_losses[case]} vs "
                             f"{first_losses[twin]}, relative {rel:.1e} > {COMPILED_RTOL})")
        out[case] = rel
    return out


def profile(args, device) -> None:
    """One warm-up and one profiled call of a case; prints top ops by self CPU time + JSON line."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cases, _ = build_cases(args, device)
    case = cases[args.profile]
    case()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        case()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.profile_rows]
    print_json_line({"profile": args.profile, "steps": args.steps, "self_cpu_total_s": total / 1e6,
                     "top_ops": [{"op": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4),
                                  "share": round(e.self_cpu_time_total / total, 4), "calls": e.count}
                                 for e in top]})


def first_calls(cases: dict, device) -> dict[str, float]:
    """Seconds of each case's first call (`steps` steps; for the compiled cases it includes
    tracing and compiling forward and backward), timed one case at a time."""
    return {name: timed(fn, device)[0] for name, fn in cases.items()}


def summarise(runs, info, args, peak: float, first_s: dict) -> dict:
    cfg, stage = info["cfg"], info["full_stage"]
    B, T, n = args.batch_size, args.seq_len, args.steps
    full = step_flops(cfg, B, T, stage.mtp_depth, stage.use_dsa)
    plain = step_flops(cfg, B, T, 0, stage.use_dsa)
    model_flops = {"ours": full, "ours-compiled": full, "ours-plain": plain, "ours-plain-compiled": plain,
                   "hf": plain, "hf-loop": plain}
    out = {}
    for name, samples in runs.items():
        seconds = [s for s, _ in samples]
        out[name] = {
            "step_s": median(seconds) / n,
            "tokens_per_s": median([n * B * T / s for s in seconds]),
            "tokens_per_s_repeats": [round(n * B * T / s, 1) for s in seconds],
            "model_flops_per_step": model_flops[name],
            "mfu": median([n * model_flops[name] / s / (peak * 1e9) for s in seconds]),
            "optimizer_share": median([r["optimizer_s"] / s for s, r in samples]),
            "first_call_s": first_s[name],
            "compile_s": max(0.0, first_s[name] - median(seconds)),
        }
    return out


def goals_for(args) -> dict:
    return GLM5_ROUTING_GOALS if args.routing == "glm5" else GOALS


def headline(res: dict, goals: dict) -> dict:
    """speedup (like for like, eager vs transformers' default), the compiled and per-expert-loop
    ratios beside it, mfu and muon_split_share (full step, eager), and which of `goals` are met
    (ratios at least their target, muon_split_share at most)."""
    tps = lambda k: res[k]["tokens_per_s"]  # noqa: E731
    ratio = lambda a, b: tps(a) / tps(b) if a in res and b in res else None  # noqa: E731
    of = lambda k, field: res[k][field] if k in res else None  # noqa: E731
    h = {"speedup": ratio("ours-plain", "hf"), "compiled_speedup": ratio("ours-plain-compiled", "hf"),
         "speedup_vs_loop": ratio("ours-plain", "hf-loop"),
         "compile_gain_plain": ratio("ours-plain-compiled", "ours-plain"),
         "compile_gain_full": ratio("ours-compiled", "ours"),
         "mfu": of("ours", "mfu"), "mfu_compiled": of("ours-compiled", "mfu"),
         "muon_split_share": of("ours", "optimizer_share")}
    h["met"] = {k: None if h[k] is None else (h[k] <= target if k == "muon_split_share" else h[k] >= target)
                for k, target in goals.items()}
    return h


def routing_label(cfg: ModelConfig, args) -> str:
    name = "GLM-5's (--routing glm5)" if args.routing == "glm5" else "the preset's"
    return (f"{name} routing: {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, n_group {cfg.n_group}, "
            f"topk_group {cfg.topk_group}, scale {cfg.routed_scaling_factor}, hidden {cfg.hidden_size}, "
            f"expert width {cfg.moe_intermediate_size}")


def print_report(res: dict, info, args, peak: tuple[float, list[float]], first_losses: dict, env: dict) -> None:
    stage, goals = info["full_stage"], goals_for(args)
    h = headline(res, goals)
    speedup, mfu, share, met = h["speedup"], h["mfu"], h["muon_split_share"], h["met"]
    mode = "sparse adaptation (use_dsa=True)" if stage.use_dsa else "dense (use_dsa=False)"
    full = (f"MTP {stage.mtp_depth}x{stage.mtp_weights[0] if stage.mtp_weights else 0}"
            + (", indexer KL" if stage.indexer_weight else "") + ", clip, Muon Split, router bias")
    hf_label = f"transformers ({info['attn_implementation']}, experts {info['experts_implementation']})"
    labels = {
        "ours": f"ours, full: {full}",
        "ours-compiled": "ours, full, compiled (inductor)",
        "ours-plain": "ours, like for like: no MTP, CE, AdamW",
        "ours-plain-compiled": "ours, like for like, compiled (inductor)",
        "hf": f"{hf_label}: CE, AdamW",
        "hf-loop": f"transformers ({info['attn_implementation']}, experts eager: per-expert loop): CE, AdamW",
    }
    rows = [[labels[k], f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['model_flops_per_step'] / 1e9:.1f}",
             f"{r['mfu'] * 100:.1f}%", f"{r['optimizer_share'] * 100:.1f}%", f"{r['first_call_s']:.1f}",
             f"{r['compile_s']:.1f}" if k in COMPILED else "-"] for k, r in res.items()]
    print(f"train step: preset {args.preset}, batch {args.batch_size} x seq {args.seq_len}, {mode}, "
          f"{args.device} {'bf16 autocast' if args.device == 'cuda' else 'fp32'}, {env['torch_threads']} threads"
          f"{', --quick' if args.quick else ''}\n{routing_label(info['cfg'], args)}\n")
    print(markdown_table(["step", "s/step (median)", "tokens/s (median)", "model GFLOP/step", "MFU",
                          "optimizer share", f"first call s ({args.steps} steps)", "compile s"], rows))
    print(f"\n- matmul peak: {peak[0]:.1f} GFLOP/s (4 x torch.mm {info['mm_size']}^3 {info['mm_dtype']} per "
          f"repeat, timed between the cases, median of {len(peak[1])})\n"
          f"- {args.repeats} repeats x {args.steps} steps after {args.warmup} warm-up (and the first call); "
          f"load average at start {env['load_average_start']}, end {env['load_average_end']}")
    par, comp = info["parity"], info["compiled_check"]
    loss = lambda k: _shown(first_losses.get(k), ".6f")  # noqa: E731
    print(f"- same weights: loss on {par['tokens']} tokens (dense in both) ours {par['ours']:.7f}, transformers "
          f"{par['hf']:.7f} (relative {par['relative']:.1e})\n"
          f"- first training loss (full length) ours like for like {loss('ours-plain')} (compiled: "
          f"relative {_shown(comp.get('ours-plain-compiled'), '.1e')}), transformers {loss('hf')}, full step "
          f"{loss('ours')} (compiled: relative {_shown(comp.get('ours-compiled'), '.1e')})")
    print(f"- compiled / eager tokens/s: like for like {_shown(h['compile_gain_plain'], '.2f', 'x')}, full step "
          f"{_shown(h['compile_gain_full'], '.2f', 'x')}; compiled like for like / transformers "
          f"{_shown(h['compiled_speedup'], '.2f', 'x')}; ours like for like / transformers' per-expert loop "
          f"{_shown(h['speedup_vs_loop'], '.2f', 'x')}")
    print(f"- goal like-for-like speedup >= {GOALS['speedup']:.0f}x: {_goal(speedup, '.2f', 'x', met['speedup'])}")
    if "speedup_vs_loop" in goals:
        print(f"- goal like-for-like speedup over transformers' per-expert loop >= {goals['speedup_vs_loop']:.0f}x: "
              f"{_goal(h['speedup_vs_loop'], '.2f', 'x', met['speedup_vs_loop'])}")
    print(f"- goal MFU of the full step >= {GOALS['mfu']:.0%}: {_goal(mfu, '.1%', '', met['mfu'])} (compiled "
          f"{_shown(h['mfu_compiled'], '.1%')})")
    print(f"- goal Muon Split step <= {GOALS['muon_split_share']:.0%} of the full step: "
          f"{_goal(share, '.1%', '', met['muon_split_share'])}\n")


def json_record(res: dict, info, args, peak: tuple[float, list[float]], first_losses: dict, env: dict) -> dict:
    """Every figure, the configuration and the environment: the benchmark's JSON last line."""
    stage, goals, cfg = info["full_stage"], goals_for(args), info["cfg"]
    h = headline(res, goals)
    return {
        "benchmark": "train_step",
        "ours_tokens_per_s": _rounded(res.get("ours", {}).get("tokens_per_s"), 1),
        "ours_compiled_tokens_per_s": _rounded(res.get("ours-compiled", {}).get("tokens_per_s"), 1),
        "ours_like_for_like_tokens_per_s": _rounded(res.get("ours-plain", {}).get("tokens_per_s"), 1),
        "ours_like_for_like_compiled_tokens_per_s": _rounded(res.get("ours-plain-compiled", {}).get("tokens_per_s"), 1),
        "hf_tokens_per_s": _rounded(res.get("hf", {}).get("tokens_per_s"), 1),
        "hf_loop_tokens_per_s": _rounded(res.get("hf-loop", {}).get("tokens_per_s"), 1),
        "speedup": _rounded(h["speedup"], 3),
        "speedup_definition": "ours like for like, eager (no MTP, AdamW) / transformers, default experts "
                              "implementation (no MTP, AdamW)",
        "compiled_speedup": _rounded(h["compiled_speedup"], 3),
        "speedup_vs_loop": _rounded(h["speedup_vs_loop"], 3),
        "compile_gain": {"like_for_like": _rounded(h["compile_gain_plain"], 3),
                         "full": _rounded(h["compile_gain_full"], 3)},
        "compile_s": {k: round(res[k]["compile_s"], 2) for k in COMPILED if k in res},
        "mfu": _rounded(h["mfu"], 4),
        "mfu_compiled": _rounded(h["mfu_compiled"], 4),
        "mfu_definition": "full step: 3 x ledger forward FLOPs (main + MTP depths) / step time / matmul peak",
        "matmul_peak_gflops": round(peak[0], 2),
        "muon_split_share": _rounded(h["muon_split_share"], 4),
        "goals": {k: {"target": v, "met": h["met"][k]} for k, v in goals.items()},
        "cases": {k: {kk: (round(vv, 5) if isinstance(vv, float) else vv) for kk, vv in r.items()}
                  for k, r in res.items()},
        "first_loss": first_losses,
        "parity": info["parity"],
        "compiled_first_loss_relative": info["compiled_check"],
        "config": {"preset": args.preset, "routing": args.routing, "quick": args.quick,
                   "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                   "n_group": cfg.n_group, "topk_group": cfg.topk_group,
                   "routed_scaling_factor": cfg.routed_scaling_factor, "hidden_size": cfg.hidden_size,
                   "moe_intermediate_size": cfg.moe_intermediate_size,
                   "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "stage": stage.name, "use_dsa": stage.use_dsa, "mtp_weights": list(stage.mtp_weights),
                   "indexer_weight": stage.indexer_weight, "lr": stage.lr, "steps": args.steps,
                   "repeats": args.repeats, "warmup": args.warmup, "device": args.device, "cases": args.case_list,
                   "dtype": "bf16 autocast" if args.device == "cuda" else "fp32",
                   "compile_backend": "inductor",
                   "hf_attn_implementation": info["attn_implementation"],
                   "hf_experts_implementation": info["experts_implementation"],
                   "hf_index_topk": cfg.index_topk if stage.use_dsa else args.seq_len,
                   "mm_size": info["mm_size"], "mm_dtype": info["mm_dtype"]},
        "env": env,
    }


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _goal(x: float | None, spec: str, suffix: str, ok: bool | None) -> str:
    """A goal's value and verdict, or "not measured" (a case --cases left out)."""
    return "not measured" if x is None else f"{format(x, spec)}{suffix} ({_verdict(ok)})"


def _shown(x: float | None, spec: str, suffix: str = "") -> str:
    """x formatted with `spec` and `suffix`, or "not measured" for None (a case --cases left out)."""
    return "not measured" if x is None else format(x, spec) + suffix


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    device = setup_device(args)
    if args.profile:
        return profile(args, device)
    env = env_facts(device)
    cases, info = build_cases(args, device)
    info["mm_size"] = args.mm_size or (8192 if device.type == "cuda" else 2048)
    mm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info["mm_dtype"] = str(mm_dtype).removeprefix("torch.")
    mm_fn, mm_flops = matmul_case(n=info["mm_size"], dtype=mm_dtype, device=device)
    first_s = first_calls(cases, device)
    first = {k: c.first_loss for k, c in cases.items()}
    info["compiled_check"] = compiled_check(first, device)
    runs = time_interleaved({**cases, "matmul": mm_fn}, device=device, warmup=args.warmup, repeats=args.repeats)
    peak_samples = [mm_flops / s / 1e9 for s, _ in runs.pop("matmul")]
    peak = (median(peak_samples), peak_samples)
    env["load_average_end"] = load_average()
    env["matmul_peak_repeats_gflops"] = [round(x, 1) for x in peak_samples]
    res = summarise(runs, info, args, peak[0], first_s)
    print_report(res, info, args, peak, first, env)
    record = json_record(res, info, args, peak, first, env)
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
