"""The Muon Split optimizer step's share of the full training step: this checkout against an older one, same run.

In one process, on the same initial weights and windows, timed interleaved (see common.py):
- new, full step: `glm5lab train`'s step (train_step.py's `ours_full_step`: forward with MTP, the stage's losses,
  `optimizer_step` with `TrainHyper`'s defaults) with this checkout's `MuonAdamW` (Muon Split, batched
  Newton-Schulz: `glm5lab.optim.ns_batch`);
- old, full step: the same with the `MuonAdamW` of the checkout at --old (its optim/newton_schulz.py,
  parallel/muon_dist.py and optim/muon.py loaded under other module names: `load_old_optimizer`), built over the
  same param groups; everything but the optimizer is this checkout's;
- new / old, optimizer alone: `step()` of each optimizer on fixed gradients, many more repeats (the same work
  as in the full step, timed without the model around it); and the new one with each of ABLATIONS.
optimizer share = optimizer step time / full step time, per step, median; in wall-clock seconds and in this
thread's CPU seconds (time.thread_time: without the time other processes hold the core). Before timing, one full
step of each from the same weights on the same window: the parameters after it may differ only by the optimizers'
rounding (printed: max |new - old|). Last, per block shape of the step, `newton_schulz` against
`newton_schulz_gram` on one stack of that shape (`gram_vs_plain`): where the Gram form pays.

    # small preset, 8 x 256, dense stage, eager, fp32, one thread (about 4 min)
    git worktree add /tmp/old-ns <commit> && \\
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_step.py --threads 1 --old /tmp/old-ns
    # check the script: tiny preset, 2 x 32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_step.py --threads 1 --old /tmp/old-ns --quick

Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, matmul_case, median, print_json_line, setup_device, time_interleaved
from train_step import TRAIN, stages_for

import glm5lab.optim
import glm5lab.parallel
from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.environment import env_facts, load_average
from glm5lab.optim.flops import optimizer_flops
from glm5lab.train.losses import stage_losses
from glm5lab.train.step import optimizer_step, set_trainable

GOAL_SHARE = 0.08
"""Issue 39: the Muon Split optimizer step <= 8% of the full `small` step, eager, one thread."""
QUICK = {"preset": "tiny", "batch_size": 2, "seq_len": 32, "steps": 1, "repeats": 2, "opt_repeats": 3}
OLD_MODULES = (("glm5lab.optim.newton_schulz", "optim/newton_schulz.py"),
               ("glm5lab.parallel.muon_dist", "parallel/muon_dist.py"),
               ("glm5lab.optim.muon", "optim/muon.py"))
"""The files that make `MuonAdamW`, in import order; each later one imports the earlier ones by these names."""
ABLATIONS = {"Gram form from aspect 2": ("glm5lab.optim.newton_schulz", "GRAM_MIN_ASPECT", 2.0),
             "one call per piece": ("glm5lab.optim.ns_batch", "MAX_BATCH_ELEMENTS", 0),
             "one stack per shape": ("glm5lab.optim.ns_batch", "MAX_BATCH_ELEMENTS", 1 << 62)}
"""Optimizer-alone variants of the new step: with the Gram form where n >= 2 m (off by default: it breaks the FSDP
equality, newton_schulz.GRAM_MIN_ASPECT); without stacking across params (each param's
piece in its own call: what the old code batched); every same-shape piece in one stack, no size cap."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="root of the older checkout (a git worktree) whose MuonAdamW to time")
    p.add_argument("--preset", default=None, help="ModelConfig preset (default small; tiny with --quick)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per step (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="input tokens per row (default 256)")
    p.add_argument("--steps", type=int, default=None, help="training steps per timed repeat (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of the full steps (default 5)")
    p.add_argument("--opt-repeats", type=int, default=None, help="timed repeats of the optimizer alone (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help=f"check the script: {QUICK} unless given")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else {"preset": "small", "batch_size": 8, "seq_len": 256, "steps": 2,
                                         "repeats": 5, "opt_repeats": 10}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device, args.dsa = "cpu", False
    return args


def load_old_optimizer(root: Path) -> type:
    """The `MuonAdamW` class of the checkout at root (root/src/glm5lab/...), loaded under "old." module names.
    While its files execute, the names they import (OLD_MODULES) resolve to the old modules; afterwards this
    checkout's modules are restored. Raises SystemExit when a file is missing."""
    src = Path(root) / "src" / "glm5lab"
    saved = {name: sys.modules.get(name) for name, _ in OLD_MODULES}
    parents = {"glm5lab.optim": glm5lab.optim, "glm5lab.parallel": glm5lab.parallel}
    attrs = {name: getattr(parents[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], None) for name, _ in OLD_MODULES}
    try:
        for name, rel in OLD_MODULES:
            if not (src / rel).is_file():
                raise SystemExit(f"--old {root}: no {src / rel}")
            spec = importlib.util.spec_from_file_location(f"old.{name}", src / rel)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            parent, leaf = name.rsplit(".", 1)
            setattr(parents[parent], leaf, module)
            spec.loader.exec_module(module)
        return module.MuonAdamW
    finally:
        for name, _ in OLD_MODULES:
            sys.modules[name] = saved[name]
            parent, leaf = name.rsplit(".", 1)
            setattr(parents[parent], leaf, attrs[name])


def same_groups(opt, cls):
    """A `cls` optimizer over the same param groups (params and every setting) as opt."""
    groups = [{k: v for k, v in g.items()} for g in opt.param_groups]
    return cls(groups)


def build(args):
    """(full-step cases, optimizer-alone cases, first-step check, cfg, stage, models, optimizers)."""
    torch.manual_seed(args.seed)
    cfg = ModelConfig.from_preset(args.preset)
    stage, _ = stages_for(cfg, args)
    old_cls = load_old_optimizer(args.old)
    models = {"new": GLM5ForCausalLM(cfg).train()}
    models["old"] = copy.deepcopy(models["new"])
    opts = {"new": TRAIN.build_optimizer(models["new"], stage.lr)}
    opts["old"] = same_groups(TRAIN.build_optimizer(models["old"], stage.lr), old_cls)
    windows = torch.randint(0, cfg.vocab_size, (args.steps, args.batch_size, args.seq_len + 1))
    steps = {k: full_step(models[k], opts[k], stage) for k in ("new", "old")}
    for step in steps.values():  # one step each from the same weights on the same window
        step(windows[0])
    check = first_step_check(models)
    full = {f"{k}, full step": (lambda step=step: [step(w) for w in windows]) for k, step in steps.items()}
    alone = {f"{k}, optimizer alone": (lambda opt=opts[k]: _clocked(opt.step)) for k in ("new", "old")}
    for name, (module, constant, value) in ABLATIONS.items():
        alone[f"new, optimizer alone, {name}"] = partial(_ablated, opts["new"], module, constant, value)
    assert type(opts["old"]).__module__ == "old.glm5lab.optim.muon", type(opts["old"]).__module__
    return full, alone, check, cfg, stage, models, opts


def _share_at(opt_cpu_s: float, full: dict) -> float:
    """The CPU-time share the full step's optimizer would have if it took opt_cpu_s, the rest of the step as is."""
    return opt_cpu_s / (full["step_cpu_s"] - full["optimizer_cpu_s"] + opt_cpu_s)


def _ablated(opt, module: str, constant: str, value) -> dict:
    """opt.step() clocked with module.constant set to value (restored after)."""
    mod = importlib.import_module(module)
    saved = getattr(mod, constant)
    setattr(mod, constant, value)
    try:
        return _clocked(opt.step)
    finally:
        setattr(mod, constant, saved)


def _clocked(fn) -> dict:
    clock = Clock()
    fn()
    wall, cpu = clock.read()
    return {"opt_wall": wall, "opt_cpu": cpu}


def block_shapes(opt) -> dict[tuple[int, int], int]:
    """(rows, cols) -> how many blocks of that shape one step of opt orthogonalises (`ns_batch.pieces`)."""
    from glm5lab.optim.muon import blocks

    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            for shape in blocks(tuple(p.shape), g["kind"], g["heads"], g.get("sections")):
                out[shape] = out.get(shape, 0) + 1
    return out


def gram_vs_plain(opt, repeats: int) -> dict:
    """Per block shape of one step: CPU seconds of `newton_schulz` and `newton_schulz_gram` on one stack of that
    shape as the step batches it (as many blocks as fit in MAX_BATCH_ELEMENTS, at most the step's count), timed
    interleaved, median over repeats; and which form `orthogonalize_ns` takes."""
    from glm5lab.optim.newton_schulz import newton_schulz, newton_schulz_gram, uses_gram
    from glm5lab.optim.ns_batch import MAX_BATCH_ELEMENTS

    out = {}
    for (a, b), count in sorted(block_shapes(opt).items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1]):
        k = max(1, min(count, MAX_BATCH_ELEMENTS // (a * b)))
        G = torch.randn(k, a, b, generator=torch.Generator().manual_seed(0))
        runs = time_interleaved({"plain": lambda G=G: _clocked(lambda: newton_schulz(G)),
                                 "gram": lambda G=G: _clocked(lambda: newton_schulz_gram(G))},
                                device="cpu", warmup=1, repeats=repeats)
        plain, gram = (median([r["opt_cpu"] for _, r in runs[f]]) for f in ("plain", "gram"))
        out[f"{a}x{b}"] = {"blocks_per_step": count, "stack": k, "plain_cpu_s": plain, "gram_cpu_s": gram,
                           "plain_over_gram": plain / gram, "muon_takes": "gram" if uses_gram(a, b, 5) else "plain"}
    return out


def matmul_peak(repeats: int) -> float:
    """GFLOP/s of 4 x fp32 [2048, 2048] `torch.mm` per repeat (common.matmul_case), by this thread's CPU time,
    median over repeats."""
    fn, flops = matmul_case(n=2048, dtype=torch.float32, device="cpu")
    runs = time_interleaved({"mm": lambda: _clocked(fn)}, device="cpu", warmup=1, repeats=repeats)
    return flops / median([r["opt_cpu"] for _, r in runs["mm"]]) / 1e9


def fixed_grads(models, seed: int) -> None:
    """The same random gradient on both models' parameters (the full steps leave none: `optimizer_step` zeroes
    them), so that the optimizer-alone cases update every parameter, as a full step does."""
    gen = torch.Generator().manual_seed(seed)
    for a, b in zip(models["new"].parameters(), models["old"].parameters(), strict=True):
        a.grad = torch.randn(a.shape, generator=gen) * 1e-3
        b.grad = a.grad.clone()


class Clock:
    """Wall seconds (time.perf_counter) and this thread's CPU seconds (time.thread_time) since start: the CPU
    time leaves out the time other processes hold the core, which on a shared machine is most of the noise."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.thread_time() - self.cpu


def full_step(model, opt, stage):
    """step(window) -> {"wall", "cpu", "opt_wall", "opt_cpu"} of one `glm5lab train` step (train_step.py's
    `ours_full_step`: the stage's losses, then `optimizer_step` with TRAIN's settings; eager, fp32), the
    optimizer's own step clocked apart."""
    set_trainable(model, stage)
    counter, spent = itertools.count(1), {}

    class Timed:
        def step(self):
            clock = Clock()
            opt.step()
            spent["opt_wall"], spent["opt_cpu"] = clock.read()

        def __getattr__(self, name):
            return getattr(opt, name)

    timed_opt = Timed()

    def step(window):
        clock = Clock()
        optimizer_step(model, timed_opt, stage_losses(model, window, stage), stage, next(counter), TRAIN)
        wall, cpu = clock.read()
        return {"wall": wall, "cpu": cpu, **spent}
    return step


def first_step_check(models) -> dict:
    """max |new - old| over the parameters after one step from the same weights."""
    diff = max((a - b).abs().max().item() for a, b in zip(models["new"].parameters(), models["old"].parameters(),
                                                          strict=True))
    return {"max_abs_param_diff": diff}


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup_device(args)
    env = env_facts("cpu")
    full, alone, check, cfg, stage, models, opts = build(args)
    runs = time_interleaved(full, device="cpu", warmup=1, repeats=args.repeats)
    fixed_grads(models, args.seed)
    opt_runs = time_interleaved(alone, device="cpu", warmup=1, repeats=args.opt_repeats)
    shapes = gram_vs_plain(opts["new"], args.opt_repeats)
    peak = matmul_peak(args.opt_repeats)
    ns_flops = optimizer_flops(models["new"], TRAIN.optimizer)["newton_schulz"]
    env["load_average_end"] = load_average()
    res = {}
    for name, samples in runs.items():
        steps = [step for _, result in samples for step in result]
        res[name] = {"step_s": median([x["wall"] for x in steps]),
                     "optimizer_s": median([x["opt_wall"] for x in steps]),
                     "optimizer_share": median([x["opt_wall"] / x["wall"] for x in steps]),
                     "step_cpu_s": median([x["cpu"] for x in steps]),
                     "optimizer_cpu_s": median([x["opt_cpu"] for x in steps]),
                     "optimizer_share_cpu": median([x["opt_cpu"] / x["cpu"] for x in steps])}
    for name, samples in opt_runs.items():
        res[name] = {"optimizer_s": median([r["opt_wall"] for _, r in samples]),
                     "optimizer_cpu_s": median([r["opt_cpu"] for _, r in samples])}
    share_new, share_old = res["new, full step"]["optimizer_share"], res["old, full step"]["optimizer_share"]
    cpu_new, cpu_old = res["new, full step"]["optimizer_share_cpu"], res["old, full step"]["optimizer_share_cpu"]
    speedup = res["old, optimizer alone"]["optimizer_cpu_s"] / res["new, optimizer alone"]["optimizer_cpu_s"]
    fmt = lambda r, k, pct=False: "-" if k not in r else (f"{r[k] * 100:.1f}%" if pct else f"{r[k]:.3f}")  # noqa: E731
    rows = [[k, fmt(r, "step_s"), fmt(r, "optimizer_s"), fmt(r, "optimizer_share", True), fmt(r, "step_cpu_s"),
             fmt(r, "optimizer_cpu_s"), fmt(r, "optimizer_share_cpu", True)] for k, r in res.items()]
    print(f"optimizer step: preset {args.preset}, batch {args.batch_size} x seq {args.seq_len}, {stage.name} stage, "
          f"eager fp32 CPU, {env['torch_threads']} threads, optimizer {TRAIN.optimizer}; old = {args.old}\n")
    print(markdown_table(["case", "s/step", "optimizer s", "optimizer share", "CPU s/step", "optimizer CPU s",
                          "optimizer share (CPU time)"], rows))
    print("\nGram form vs plain form, one stack per block shape of the step (CPU s, median):\n")
    print(markdown_table(["block", "blocks / step", "stack", "plain", "Gram", "plain / Gram", "Muon takes"],
                         [[k, v["blocks_per_step"], v["stack"], f"{v['plain_cpu_s'] * 1e3:.2f} ms",
                           f"{v['gram_cpu_s'] * 1e3:.2f} ms", f"{v['plain_over_gram']:.2f}x", v["muon_takes"]]
                          for k, v in shapes.items()]))
    met = share_new <= GOAL_SHARE and cpu_new <= GOAL_SHARE
    print(f"\n- {args.repeats} repeats x {args.steps} steps (full), {args.opt_repeats} (optimizer alone), after one "
          f"warm-up; load average at start {env['load_average_start']}, end {env['load_average_end']}\n"
          f"- after one step from the same weights: max |new - old| over parameters "
          f"{check['max_abs_param_diff']:.1e}\n"
          f"- optimizer alone, CPU time: old / new {speedup:.2f}x\n"
          f"- Newton-Schulz FLOPs of one step (optimizer_flops): {ns_flops / 1e9:.1f} G; the new optimizer alone runs "
          f"{ns_flops / res['new, optimizer alone']['optimizer_cpu_s'] / 1e9:.1f} GFLOP/s (CPU time) against a matmul "
          f"peak of {peak:.1f} (fp32 torch.mm 2048^3, CPU time); at the peak its share would be "
          f"{_share_at(ns_flops / peak / 1e9, res['new, full step']):.1%}\n"
          f"- goal Muon Split step <= {GOAL_SHARE:.0%} of the full step: {share_new:.1%} wall, {cpu_new:.1%} CPU time "
          f"(old {share_old:.1%}, {cpu_old:.1%}; {'met' if met else 'MISSED'})\n")
    record = {"benchmark": "optimizer_step", "optimizer_share": round(share_new, 4),
              "optimizer_share_old": round(share_old, 4), "optimizer_share_cpu": round(cpu_new, 4),
              "optimizer_share_cpu_old": round(cpu_old, 4), "optimizer_speedup_cpu": round(speedup, 3),
              "goal": {"target": GOAL_SHARE, "met": met},
              "cases": {k: {kk: round(vv, 5) for kk, vv in r.items()} for k, r in res.items()},
              "first_step": check, "newton_schulz_flops": ns_flops, "matmul_peak_gflops_cpu_time": round(peak, 2),
              "gram_vs_plain": {k: {kk: (round(vv, 6) if isinstance(vv, float) else vv)
                                for kk, vv in v.items()} for k, v in shapes.items()},
              "config": {"preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len,
                         "steps": args.steps, "repeats": args.repeats, "opt_repeats": args.opt_repeats,
                         "stage": stage.name, "optimizer": TRAIN.optimizer, "old": str(args.old),
                         "n_routed_experts": cfg.n_routed_experts},
              "env": env}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
