"""Expert parallelism (issue 26): one process vs EP = 2 and EP = 4 under torchrun (gloo), the same
global batch; and a token sweep checking the all-to-all bytes against the ledger.

**CPU figures with gloo over loopback are not GPU figures.** The all-to-alls here are memory copies
through loopback sockets between processes sharing the same cores, and the experts are fp32 CPU
matmuls; on GPUs (NCCL over NVLink / InfiniBand, bf16) the ratio of communication to compute is
entirely different. Keep these figures as a check that the cost grows as the ledger says (bytes
linear in tokens x top-k x hidden width, equal to `glm5lab.parallel.alltoall.a2a_bytes` of the measured
routing counts), and as a measure of the overheads EP adds on one machine, not as a forecast of
EP's speedup. Each process runs 1 torch thread: EP = 1 uses one core, EP = 2 both cores of a
2-core machine, and **EP = 4 runs 4 processes on 2 cores: it measures contention, not scaling**.

What runs: `glm5lab.train.ep_check` (the EP tests' run: `ep_check_model`, the `tiny` preset with vocab 320, seed
0; `train_ep_check`, `run_stages` with DSA on, indexer KL weight 1, MTP depth 3, Muon Split, router bias rate 1e-2,
each rank training on its contiguous slice of the global batch), on two shapes:
- `tiny`: the tiny preset's MoE, 8 routed experts top-2 (+1 shared), hidden 64, expert width 32;
- `glm5-routing`: the same model at GLM-5's routing shape, 256 routed experts top-8 (n_group 1,
  topk_group 1, scale 2.5 as GLM-5), expert width 32.
Each (shape, EP) is one `python -m torch.distributed.run --standalone --nproc_per_node=EP` launch
of this script (`--worker`), so every configuration starts from a fresh process (its peak memory
is its own); EP = 1 is the same launch with one process (no process group, no sharding). The
world is pure EP (world size = EP, no data-parallel replica); the non-expert weights are FSDP2-
sharded over the same ranks (`glm5lab.parallel.dist.shard_model(model, ctx, ep=EP)`).

Per configuration (figures from the ranks, gathered to rank 0, written as JSON for the parent):
- step s: `--warmup` untimed repeats, then `--repeats` timed repeats of `--steps` steps; each step
  starts after a barrier and is timed with `time.perf_counter` on every rank (one `run_stages` step:
  forward and losses, backward, clip, Muon Split, router bias); a step's time is
  the slowest rank's; a repeat's figure is its mean step; reported: the median repeat.
  tokens/s = global batch x seq-len / step s.
- a2a share: the share of a step spent in the all-to-alls, measured with torch.profiler (CPU
  activity) over `--repeats` further steps, each profiled on its own (median over them, mean over
  ranks): on every rank, the union of the wall-clock intervals of the forward all-to-all launches
  (`_c10d_functional::all_to_all_single`: the per-expert count exchange, dispatch and combine), the
  `_c10d_functional::wait_tensor` calls that wait for them, and the backward's all-to-all nodes
  (the autograd functions of `all_to_all_single_autograd`: launch + wait of the gradients'
  all-to-alls), divided by that profiled step's wall time. Waiting for a slower rank (imbalance,
  or a process descheduled by oversubscription) is inside a wait, so it counts as all-to-all
  time. The share is taken within the profiled step, numerator and denominator alike; the
  profiler adds per-op overhead (here 1-36% of a step; profiled step s is in the JSON), mostly to
  the many small compute ops, so the collectives' shares are approximate and if anything low.
  Beside it, measured the same way, where else EP's step goes: FSDP2 share (the union of FSDP2's
  `FSDP::*` ranges: all-gathers of the non-expert weights, which `shard_model` shards over the EP
  ranks, their waits and copies, the gradients' reduce-scatter) and optimizer share
  (`Optimizer.step#MuonAdamW.step`).
- a2a bytes / step: `pop_ep_metrics(model)["a2a_bytes"]`: token payload the all-to-alls sent
  between ranks in a step, forward and backward, over all ranks (median over the timed steps).
- ep_imbalance: `pop_ep_metrics`: rows received by the busiest EP index / the mean (median over
  the timed steps).
- peak RSS: `resource.getrusage(RUSAGE_SELF).ru_maxrss` of each rank read right after the timed
  steps, the largest over ranks: the peak resident set of that process since it started (Python,
  torch and glm5lab code, gloo buffers, the model, gradients, optimizer state, activations, and
  freed memory the allocator kept). The JSON also has each rank's RSS before the model was built.

Token sweep (EP > 1): after the timing, one step at each global batch of `--sweep` (seq-len
fixed), and one step of a twice-as-wide model (hidden 128) at `--batch`: the measured `a2a_bytes`
beside `a2a_bytes(load_RE, ep, hidden, "fp32")` of the ledger on that step's routing counts
(load_RE: each rank's rows per routed expert, summed over the step's MoE forwards: 3 MoE layers + 3
MTP depths), and bytes / (tokens x top-k x hidden): constant when the bytes are linear in all three
(it is 4 bytes x 2 (dispatch, combine) x 2 (forward, backward) x the MoE forwards per token (3
layers + 3 MTP depths, the depths on slightly fewer positions: ~5.9 at seq-len 64) x the share of
rows whose expert is on another rank, ~(EP - 1) / EP under uniform routing).

    # both shapes, EP 1, 2, 4, batch 8 x 64 (about 2 min on a quiet 2-core CPU, 6 under load)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/expert_parallel.py
    # one shape, EP 1 and 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/expert_parallel.py --shape tiny --ep 1,2

Prints a markdown table per part, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path.insert(0, str(SCRIPT.parent))
from common import markdown_table, median, print_json_line

from glm5lab.environment import env_facts, load_average

SHAPES = {"tiny": {}, "glm5-routing": {"n_routed_experts": 256, "num_experts_per_tok": 8}}
"""Overrides of `ep_check_model`'s config (the tiny preset, vocab 320) per shape; every other
field is the preset's (n_group 1, topk_group 1, routed_scaling_factor 2.5: GLM-5's)."""
WIDE = {"hidden_size": 128}
"""The sweep's width point: the same model at twice the hidden width."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", default="1,2,4", help="expert-parallel sizes, comma-separated (default 1,2,4); "
                   "each must divide the routed experts and the global batch")
    p.add_argument("--shape", default="tiny,glm5-routing", help=f"shapes, comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--batch", type=int, default=8, help="global batch: rows per step over all ranks (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row (windows hold seq-len + 1; default 64)")
    p.add_argument("--steps", type=int, default=2, help="steps per timed repeat (default 2)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats, median reported; also the number of profiled steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first (default 1)")
    p.add_argument("--sweep", default="4,8,16", help="global batches of the token sweep (default 4,8,16); '' skips it")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ep_sizes = [int(x) for x in args.ep.split(",") if x]
    args.shapes = [s for s in args.shape.split(",") if s]
    args.sweep_batches = [int(x) for x in args.sweep.split(",") if x]
    for s in args.shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shape {s!r}: choose from {', '.join(SHAPES)}")
    for ep in args.ep_sizes:
        if ep < 1:
            raise SystemExit(f"--ep {ep}: at least 1")
        bad = [b for b in [args.batch, *args.sweep_batches] if b % ep]
        if bad:
            raise SystemExit(f"--ep {ep}: the global batches {bad} (--batch, --sweep) are not multiples of it")
    return args


# --- one (shape, EP) configuration, on every rank of a torchrun launch ---

def worker(args) -> None:
    """One (shape, EP) configuration on this rank; rank 0 writes its `config_record` to --out."""
    from glm5lab.parallel import dist as gdist
    from glm5lab.train.ep_check import ep_check_model

    torch.set_num_threads(args.threads)
    ctx = gdist.setup()
    ep = ctx.world_size
    rss_before = _rss_bytes()
    trainer = Trainer(ep_check_model(ctx, ep, SHAPES[args.shape]), ctx)
    g = torch.Generator().manual_seed(1)
    vocab = trainer.cfg.vocab_size

    def window(batch: int) -> torch.Tensor:  # the same draws on every rank; each trains on its slice
        return torch.randint(0, vocab, (batch, args.seq_len + 1), generator=g)

    for _ in range(args.warmup * args.steps):
        trainer.step(window(args.batch))
    steps = [trainer.step(window(args.batch)) for _ in range(args.repeats * args.steps)]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    profiled = [trainer.profiled_step(window(args.batch)) for _ in range(args.repeats)]
    sweep = []
    if ep > 1:
        for batch in args.sweep_batches:
            sweep.append({"batch": batch, "hidden_size": trainer.cfg.hidden_size, **trainer.step(window(batch))})
        wide = Trainer(ep_check_model(ctx, ep, {**SHAPES[args.shape], **WIDE}), ctx)
        sweep.append({"batch": args.batch, "hidden_size": wide.cfg.hidden_size, **wide.step(window(args.batch))})
    shares = [p[part] / p["seconds"] for part in PARTS for p in profiled]  # part-major
    per_rank = _gather([peak_rss, rss_before, *shares], ctx)
    if ctx.is_main:
        record = config_record(args, trainer.cfg, ep, steps, profiled, sweep, per_rank)
        Path(args.out).write_text(json.dumps(record))
    gdist.teardown(ctx)


def config_record(args, cfg, ep: int, steps: list[dict], profiled: list[dict], sweep: list[dict],
                  per_rank: list[list[float]]) -> dict:
    """The figures of one configuration (see the module docstring). per_rank: each rank's [peak RSS,
    RSS before the model, then the PARTS shares of each profiled step, part-major]."""
    T, n = args.seq_len, len(profiled)
    repeats = [statistics.fmean(s["seconds"] for s in steps[i:i + args.steps])
               for i in range(0, len(steps), args.steps)]
    share = {part: [statistics.fmean(r[2 + j * n + i] for r in per_rank) for i in range(n)]
             for j, part in enumerate(PARTS)}
    return {
        "shape": args.shape, "ep": ep, "processes": len(per_rank), "global_batch": args.batch, "seq_len": T,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "step_s": median(repeats), "step_s_repeats": repeats,
        "tokens_per_s": median([args.batch * T / s for s in repeats]),
        **{f"{part}_share": median(share[part]) for part in PARTS},
        **{f"{part}_share_steps": share[part] for part in PARTS},
        "a2a_share_per_rank": [statistics.median(r[2:2 + n]) for r in per_rank],
        "profiled_step_s": [p["seconds"] for p in profiled],
        "a2a_bytes": median([s["a2a_bytes"] for s in steps]) if ep > 1 else 0,
        "a2a_bytes_steps": [s["a2a_bytes"] for s in steps],
        "ep_imbalance": median([s["ep_imbalance"] for s in steps]) if ep > 1 else None,
        "ep_tokens_steps": [s["ep_tokens"] for s in steps],
        "peak_rss_bytes": max(r[0] for r in per_rank), "peak_rss_bytes_per_rank": [r[0] for r in per_rank],
        "rss_before_model_bytes_per_rank": [r[1] for r in per_rank],
        "sweep": [{k: v for k, v in s.items() if k != "load_RE"} | {"tokens": s["batch"] * T} for s in sweep],
    }


class Trainer:
    """`train_ep_check` (the EP tests' step) one step at a time on a built model (`ep_check_model`), with each
    step timed between barriers, its EP metrics popped and its routing counts gathered (untimed)."""

    def __init__(self, model, ctx):
        self.model, self.ctx, self.cfg, self.optimizer = model, ctx, model.config, None

    def _run(self, window_BT1: torch.Tensor) -> torch.Tensor:
        """One step on the global batch window_BT1; this rank's routing loads load_E [E]."""
        from glm5lab.train.ep_check import train_ep_check

        loads = []
        self.optimizer = train_ep_check(self.model, self.ctx, [window_BT1], lambda _, load_E: loads.append(load_E),
                                        self.optimizer)
        return loads[0]

    def _barrier(self) -> None:
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def step(self, window_BT1: torch.Tensor) -> dict:
        """One step on the global batch `window_BT1`: {seconds (slowest rank), a2a_bytes, ep_imbalance,
        ep_tokens, load_RE, ledger_a2a_bytes, rows}."""
        from glm5lab.parallel.alltoall import a2a_bytes
        from glm5lab.parallel.expert_parallel import pop_ep_metrics

        self._barrier()
        t0 = time.perf_counter()
        load_E = self._run(window_BT1)
        seconds = _max_over_ranks(time.perf_counter() - t0, self.ctx)
        metrics = pop_ep_metrics(self.model)
        load_RE = [[int(x) for x in row] for row in _gather(load_E.tolist(), self.ctx)]
        ep = self.ctx.world_size
        return {"seconds": seconds, "a2a_bytes": metrics.get("a2a_bytes", 0),
                "ep_imbalance": metrics.get("ep_imbalance"), "ep_tokens": metrics.get("ep_tokens"),
                "ledger_a2a_bytes": a2a_bytes(load_RE, ep, self.cfg.hidden_size, "fp32") if ep > 1 else 0,
                "rows": sum(map(sum, load_RE)), "load_RE": load_RE}

    def profiled_step(self, window_BT1: torch.Tensor) -> dict:
        """One step under torch.profiler: {seconds: this rank's wall time, and the seconds of each of
        PARTS in it (`part_seconds`)}."""
        from torch.profiler import ProfilerActivity, profile

        from glm5lab.parallel.expert_parallel import pop_ep_metrics

        self._barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            self._run(window_BT1)
            seconds = time.perf_counter() - t0
        pop_ep_metrics(self.model)
        # the raw events: `prof.events()` builds a Python tree of them, ~10 s per step here
        events = [(e.name(), e.start_thread_id(), e.start_ns(), e.end_ns())
                  for e in prof.profiler.kineto_results.events()]
        return {"seconds": seconds, **part_seconds(events)}


def a2a_seconds(events) -> float:
    """Wall seconds a profiled step spent in the expert-parallel all-to-alls, from the profiler's
    events as (name, thread, start ns, end ns): the union of the intervals of (a) forward launches
    `_c10d_functional::all_to_all_single` (count exchange, dispatch, combine), (b)
    `_c10d_functional::wait_tensor` calls whose latest preceding functional collective on that
    thread was an all-to-all, (c) the backward nodes of the autograd-aware functional collectives
    (`GeneratedBackwardFor__c10d_functional_*`: in this model only the dispatcher's
    `all_to_all_single_autograd` and its wait). gloo's worker-thread events (`gloo:*`) are left
    out: they run while the calling thread waits."""
    spans, last = [], {}
    for name, thread, start, end in sorted(events, key=lambda e: e[2]):
        if name.startswith("gloo:"):
            continue
        if name.startswith("autograd::engine::evaluate_function: GeneratedBackwardFor__c10d_functional"):
            spans.append((start, end))
        elif name == "_c10d_functional::wait_tensor":
            if last.get(thread) == "a2a":
                spans.append((start, end))
        elif name.startswith("_c10d_functional::") and "_wrap_tensor" not in name:
            last[thread] = "a2a" if "all_to_all" in name else "other"
            if last[thread] == "a2a":
                spans.append((start, end))
    return _union_seconds(spans)


PARTS = ("a2a", "fsdp", "optimizer")
"""The parts of a profiled step reported as shares: the all-to-alls (`a2a_seconds`), FSDP2's hooks
(the union of its `FSDP::*` profiler ranges: all-gathers of the sharded weights before each block
and their waits and copy-out, resharding, the gradients' reduce-scatter), and the optimizer step
(`Optimizer.step#MuonAdamW.step`: Muon Split and AdamW on the DTensor shards, the Newton-Schulz
exchanges across ranks included). The three do not overlap."""


def part_seconds(events) -> dict[str, float]:
    """{part: wall seconds} of PARTS in one profiled step's events (name, thread, start ns, end ns)."""
    def ranges(prefix: str) -> float:
        return _union_seconds([(start, end) for name, _, start, end in events if name.startswith(prefix)])
    return {"a2a": a2a_seconds(events), "fsdp": ranges("FSDP::"), "optimizer": ranges("Optimizer.step")}


def _union_seconds(spans) -> float:
    """Length of the union of [start, end) ns intervals, in seconds."""
    total, covered = 0, None
    for start, end in sorted(spans):
        if covered is None or end > covered:
            total += end - (start if covered is None else max(start, covered))
            covered = end
    return total / 1e9


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _max_over_ranks(x: float, ctx) -> float:
    if ctx.world_size == 1:
        return x
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _gather(values: list[float], ctx) -> list[list[float]]:
    """Every rank's `values` (same length on every rank), in rank order."""
    t = torch.tensor(values, dtype=torch.float64)
    if ctx.world_size == 1:
        return [t.tolist()]
    import torch.distributed as dist

    parts = [torch.zeros_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t)
    return [p.tolist() for p in parts]


# --- the parent: one torchrun launch per (shape, EP), then the report ---

def launch(args, shape: str, ep: int, out: Path) -> dict:
    """`python -m torch.distributed.run --standalone --nproc_per_node=ep` of this script's worker for
    `shape`; returns rank 0's record (plus launch_s: the launch's wall seconds). Raises SystemExit
    with the launch's output when it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ep}", str(SCRIPT),
           "--worker", "--out", str(out), "--shape", shape, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--sweep", args.sweep, "--threads", str(args.threads), "--ep", str(ep)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{shape} at EP {ep} failed (exit {proc.returncode}): {' '.join(cmd)}")
    record = json.loads(out.read_text())
    record["launch_s"] = time.perf_counter() - t0
    print(f"{shape} EP {ep}: {record['launch_s']:.0f} s", file=sys.stderr, flush=True)
    return record


def processes_label(ep: int, cores: int) -> str:
    return f"{ep} on {cores} cores" + (" (oversubscribed)" if ep > cores else "")


def print_report(records: list[dict], args, env: dict) -> None:
    cores = env["cpu_count"]
    base = {r["shape"]: r["tokens_per_s"] for r in records if r["ep"] == 1}
    pct = lambda x: f"{x * 100:.1f}%"  # noqa: E731
    rows = []
    for r in records:
        vs = f"{r['tokens_per_s'] / base[r['shape']]:.2f}x" if r["shape"] in base else "-"
        single = r["ep"] == 1
        rows.append([r["shape"], f"{r['n_routed_experts']} top-{r['num_experts_per_tok']}", r["ep"],
                     processes_label(r["processes"], cores), f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}", vs,
                     "-" if single else pct(r["a2a_share"]), "-" if single else pct(r["fsdp_share"]),
                     pct(r["optimizer_share"]), "-" if single else f"{r['a2a_bytes'] / 2**20:.2f}",
                     "-" if single else f"{r['ep_imbalance']:.2f}", f"{r['peak_rss_bytes'] / 2**20:.0f}"])
    print(f"expert parallelism: global batch {args.batch} x seq {args.seq_len}, fp32 CPU, gloo, "
          f"{args.threads} torch thread(s) per process, {cores} cores\n")
    print(markdown_table(["shape", "routed experts", "EP", "processes", "s/step (median)", "tokens/s",
                          "vs one process", "a2a share", "FSDP2 share", "optimizer share", "a2a MiB/step",
                          "ep_imbalance", "peak RSS MiB (max rank)"], rows))
    print(f"\n- {args.repeats} repeats x {args.steps} steps after {args.warmup} warm-up repeat(s); a step's time is "
          f"the slowest rank's. Shares: torch.profiler over {args.repeats} further steps, median, mean over ranks: "
          "a2a = all-to-all launches, their waits and backward nodes; FSDP2 = its FSDP::* ranges; optimizer = "
          "MuonAdamW.step; each / the profiled step\n"
          "- peak RSS: ru_maxrss after the timed steps (the process's peak since it started: runtime, model, "
          "optimizer state, activations), the largest over ranks\n"
          "- gloo over loopback on a CPU: not GPU figures; they check that the bytes grow as the ledger says. "
          f"EP > {cores} runs more processes than cores: it measures contention, not scaling\n"
          f"- load average at start {env['load_average_start']}, end {env['load_average_end']}\n")
    sweep = [(r, s) for r in records for s in r["sweep"]]
    if not sweep:
        return
    rows = []
    for r, s in sweep:
        k, D = r["num_experts_per_tok"], s["hidden_size"]
        rows.append([r["shape"], r["ep"], s["tokens"], k, D, s["rows"], s["a2a_bytes"], s["ledger_a2a_bytes"],
                     "yes" if s["a2a_bytes"] == s["ledger_a2a_bytes"] else "NO",
                     f"{s['a2a_bytes'] / (s['tokens'] * k * D):.2f}",
                     f"{16 * s['rows'] / (s['tokens'] * k) * (r['ep'] - 1) / r['ep']:.2f}",
                     f"{s['a2a_bytes'] / (s['rows'] * D * 4 * 2 * 2):.3f}"])
    print("token sweep: one step per row (global tokens = batch x seq-len), fp32\n")
    print(markdown_table(["shape", "EP", "tokens", "top-k", "hidden", "rows routed", "a2a_bytes measured",
                          "a2a_bytes ledger", "equal", "bytes / (tokens x top-k x hidden)",
                          "uniform routing", "crossing share"], rows))
    print("\n- rows routed: token x expert assignments over the step's MoE forwards (3 layers + 3 MTP depths); "
          "uniform routing: the bytes / (tokens x top-k x hidden) expected when a fraction (EP - 1) / EP of the rows "
          "crosses, 4 B x 2 (dispatch, combine) x 2 (forward, backward) x rows / (tokens x top-k) x (EP - 1) / EP; "
          "crossing share: a2a_bytes / (rows x hidden x 4 B x 2 x 2), the measured fraction\n")


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    torch.set_num_threads(args.threads)
    env = env_facts("cpu")
    t0 = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for ep in args.ep_sizes:
                records.append(launch(args, shape, ep, Path(tmp) / f"{shape}-ep{ep}.json"))
    env["load_average_end"] = load_average()
    runtime = time.perf_counter() - t0
    print_report(records, args, env)
    record = {"benchmark": "expert_parallel", "runtime_s": round(runtime, 1),
              "configs": records,
              "config": {"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "repeats": args.repeats,
                         "warmup": args.warmup, "ep": args.ep_sizes, "shapes": args.shapes,
                         "sweep_batches": args.sweep_batches, "threads_per_process": args.threads,
                         "dtype": "fp32", "backend": "gloo", "model": "glm5lab.train.ep_check.ep_check_model (tiny "
                         "preset, vocab 320) + shape overrides", "shape_overrides": {s: SHAPES[s] for s in args.shapes},
                         "wide_overrides": WIDE},
              "env": env}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
