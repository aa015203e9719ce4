"""Context parallelism (issue 38): one long sequence split over 2 and 4 processes under torchrun (gloo, CPU):
training step time per layout and length, the all-gather bytes against the ledger, and the causal load balance.

**CPU figures with gloo over loopback are not GPU figures.** The gathers are memory copies through loopback
sockets between processes sharing the same cores, and attention is fp32 CPU kernels. Each process runs 1 torch
thread: 2 processes use both cores of a 2-core machine, and **4 processes on 2 cores time-share them: their step
times measure contention, not scaling** (a rank that waits in a gather lets another run; the per-rank attention
times below are wall time and include being descheduled). Keep these figures as checks: the bytes equal the
ledger's formula, and the layouts' balance is what their causal (query, key) pair counts say.

The model (`bench_config`): GLM-5's structure at tiny width: 2 layers, MLA (4 heads, latent 32 + RoPE 8, q/k
16 + 8, v 16) with DSA (top-64, far below every length; 16 indexer heads of 16) on layer 0 and an IndexCache
"shared" layer 1 reusing its top-k; layer 0's MLP dense, layer 1 an MoE (8 routed experts top-2 + 1 shared, width
32); hidden 64, vocab 512; no MTP layer (it would add a third layer and its own gathers; the CP tests cover it).
fp32, batch 1 sequence per step (the whole sequence on every rank of the group; each rank computes its T / cp
tokens).

Per (processes, length, layout), one torchrun launch per process count builds the model once (seed 0) and runs,
for each length, the layouts interleaved (contiguous, head_tail, round_robin, then again for the next repeat):
- step s: forward + backward of `stage_losses(model, window, stage, context_parallel=cp)` (no optimizer), for
  the sparse stage (DSA on, indexer KL weight 1: `sparse`) and the dense stage (DSA off, indexer weight 0:
  `dense`); after a barrier, timed on every rank; a step's time is the slowest rank's; `--warmup` untimed rounds
  of every (layout, stage) at the first length, then the median of `--repeats` rounds at every length.
- gathered bytes: `ContextParallel.gathered_bytes` over one step's forward (bytes rank 0 received in the forward
  all-gathers; the backward's reduce-scatter moves as much again) against the ledger's formula
  `glm5lab.activations.cp_gather_bytes(cfg, cp, dtype="fp32")` x tokens x layers: "latent" x T x (MLA layers) +
  "indexer_keys" x T x ("own" DSA layers, sparse stage only: the dense stage computes no indexer keys).
- attention balance: each rank's forward time inside its MLA modules (forward pre/post hooks) minus the time in
  their `ContextParallel.gather` calls (there a rank waits for the slowest one), summed over the layers of one
  step; reported: max / mean over the ranks (median over the repeats), beside the same ratio of the causal
  (query, key) pairs each rank's positions own (`pairs max/mean`: what a kernel that skips future keys does).
  Which kernels skip future keys here: DSA's blocked indexer (per block of 64 queries, `dsa_blocked`) does; the
  sparse attention gathers top-k keys per query (the same work on every rank); the dense stage's SDPA with a
  position mask ([T / cp, T], CP's queries are not a causal prefix) computes every (query, key) pair, so on
  this CPU its attention work is the same on every rank whatever the layout (GPU flash kernels skip masked
  blocks; there the dense stage is as unbalanced as the pair counts).

    # default: 2 and 4 processes, 4K-32K tokens, the three layouts (295 s on 2 cores at load average 5-9)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_parallel.py
    # the recorded run (BENCHMARKS.md, "Context parallelism"): 3 repeats, 702 s under the same load
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_parallel.py --repeats 3
    # a quick look: 2 processes, 4K and 8K
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_parallel.py --processes 2 --lengths 4096,8192

Prints a markdown table (every row with its threads and load average), then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
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

LAYOUT_ORDER = ("contiguous", "head_tail", "round_robin")
STAGES = ("sparse", "dense")


def bench_config():
    """The benchmark's model (see the module docstring): the `tiny` preset cut to 2 layers, DSA top-64, positions
    up to 32768, no MTP."""
    from glm5lab.config import ModelConfig

    return ModelConfig.from_preset("tiny", num_hidden_layers=2, indexer_types=["full", "shared"], index_topk=64,
                                   max_position_embeddings=32768, num_nextn_predict_layers=0, use_dsa=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", default="2,4", help="CP group sizes (= processes), comma-separated (default 2,4)")
    p.add_argument("--layouts", default=",".join(LAYOUT_ORDER),
                   help=f"layouts, comma-separated, of {', '.join(LAYOUT_ORDER)} (default all)")
    p.add_argument("--lengths", default="4096,8192,16384,32768",
                   help="sequence lengths in tokens, comma-separated (default 4096,8192,16384,32768); each a multiple "
                        "of 2 x processes (head_tail) and at most 32768")
    p.add_argument("--dense-max-length", type=int, default=8192,
                   help="run the dense stage at lengths up to this (default 8192; its masked SDPA costs T^2 / cp: "
                        "7-13 s a step at 8K on 2 processes, minutes at 32K)")
    p.add_argument("--repeats", type=int, default=1, help="timed steps per (length, layout, stage), median reported "
                   "(default 1)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds of every (layout, stage) at the first length (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.cp_sizes = [int(x) for x in args.processes.split(",") if x]
    args.layout_list = [x for x in args.layouts.split(",") if x]
    args.length_list = [int(x) for x in args.lengths.split(",") if x]
    for x in args.layout_list:
        if x not in LAYOUT_ORDER:
            raise SystemExit(f"--layouts {x!r}: choose from {', '.join(LAYOUT_ORDER)}")
    for cp in args.cp_sizes:
        if cp < 2:
            raise SystemExit(f"--processes {cp}: at least 2 (a CP group of one is one process)")
        bad = [T for T in args.length_list if T % (2 * cp) or not 0 < T <= 32768]
        if bad:
            raise SystemExit(f"--lengths {bad}: with --processes {cp} each must be a multiple of {2 * cp} in 1..32768")
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)}: at least 1")
    return args


# --- on every rank of one torchrun launch ---

class AttentionClock:
    """Forward seconds inside the model's MLA modules on this rank, less the seconds inside the CP gathers they
    call (`ContextParallel.gather`, where a rank waits for the others). `reset()`, run, read `seconds`."""

    def __init__(self, model):
        from glm5lab.model.mla import MLAttention

        self.seconds, self._t0, self._gather = 0.0, None, 0.0
        for m in model.modules():
            if isinstance(m, MLAttention):
                m.register_forward_pre_hook(self._enter)
                m.register_forward_hook(self._leave)

    def watch(self, cp) -> None:
        """Time the gathers of `cp` (wraps its `gather` method)."""
        inner = cp.gather

        def gather(*a, **kw):
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            self._gather += time.perf_counter() - t0
            return out
        cp.gather = gather

    def reset(self) -> None:
        self.seconds = 0.0

    def _enter(self, module, inputs) -> None:
        self._t0, self._gather = time.perf_counter(), 0.0

    def _leave(self, module, inputs, output) -> None:
        self.seconds += time.perf_counter() - self._t0 - self._gather


def worker(args) -> None:
    """Every (length, layout, stage) on this rank; rank 0 writes the records to --out."""
    import torch.distributed as dist

    from glm5lab import GLM5ForCausalLM
    from glm5lab.parallel.context_parallel import ContextParallel
    from glm5lab.parallel.dist import end_process, teardown
    from glm5lab.train.stages import Stage

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    cfg = bench_config()
    model = GLM5ForCausalLM(cfg)
    clock = AttentionClock(model)
    groups = {layout: ContextParallel(dist.group.WORLD, layout) for layout in args.layout_list}
    for cp in groups.values():
        clock.watch(cp)
    records = []
    for T in args.length_list:
        window = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(T))
        stages = {"sparse": Stage("sparse", 1, 1e-3, T, 1, use_dsa=True, indexer_weight=1.0, mtp_weights=()),
                  "dense": Stage("dense", 1, 1e-3, T, 1, indexer_weight=0.0, mtp_weights=())}
        run_stages = [st for st in STAGES if st == "sparse" or T <= args.dense_max_length]
        runs = {(layout, st): [] for layout in args.layout_list for st in run_stages}
        for i in range(args.warmup + args.repeats):
            if i < args.warmup and T != args.length_list[0]:
                continue  # warm-up once per launch, at the first length
            for layout in args.layout_list:
                for st in run_stages:
                    run = _step(model, window, stages[st], groups[layout], clock)
                    if i >= args.warmup:
                        runs[layout, st].append(run)
        for (layout, st), rs in runs.items():
            records.append(_record(cfg, model.layer_specs, T, layout, st, size, rs))
        if rank == 0:
            print(f"cp {size} T {T}: done (load {load_average()})", file=sys.stderr, flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))
    teardown()
    end_process()


def _step(model, window, stage, cp, clock) -> dict:
    """One forward + backward of `stage_losses` under `cp`: {step_s (slowest rank), attention_s (every rank's),
    gathered_bytes (this rank's forward gathers), load (1-minute load average after it)}."""
    import torch.distributed as dist

    from glm5lab.train.losses import stage_losses

    model.zero_grad(set_to_none=True)
    cp.gathered_bytes = 0
    clock.reset()
    dist.barrier()
    t0 = time.perf_counter()
    stage_losses(model, window, stage, context_parallel=cp).total.backward()
    seconds = time.perf_counter() - t0
    per_rank = torch.tensor([seconds, clock.seconds], dtype=torch.float64)
    parts = [torch.zeros_like(per_rank) for _ in range(cp.size)]
    dist.all_gather(parts, per_rank)
    return {"step_s": max(float(p[0]) for p in parts), "attention_s": [float(p[1]) for p in parts],
            "gathered_bytes": cp.gathered_bytes, "load": load_average()}


def _record(cfg, specs, T: int, layout: str, stage: str, cp: int, runs: list[dict]) -> dict:
    """The figures of one (length, layout, stage) from its timed runs (module docstring); specs: the model's
    `layer_specs`."""
    from glm5lab.activations import cp_gather_bytes
    from glm5lab.parallel.context_parallel import positions

    per_token = cp_gather_bytes(cfg, cp, dtype="fp32")
    mla = sum(s.attention == "mla" for s in specs)
    own = sum(s.indexer == "own" for s in specs) if stage == "sparse" and T > cfg.index_topk else 0
    ledger = T * (mla * per_token["latent"] + own * per_token["indexer_keys"])
    pairs = [float((positions(T, cp, r, layout) + 1).sum()) for r in range(cp)]
    ratios = [max(r["attention_s"]) / statistics.fmean(r["attention_s"]) for r in runs]
    return {"processes": cp, "length": T, "layout": layout, "stage": stage,
            "step_s": median([r["step_s"] for r in runs]), "step_s_repeats": [r["step_s"] for r in runs],
            "attention_max_over_mean": median(ratios),
            "attention_s_per_rank": [r["attention_s"] for r in runs],
            "pairs_max_over_mean": max(pairs) / statistics.fmean(pairs),
            "gathered_bytes": runs[0]["gathered_bytes"], "gathered_bytes_repeats": [r["gathered_bytes"] for r in runs],
            "ledger_bytes": ledger, "mla_layers": mla, "own_indexer_layers": own,
            "bytes_equal": all(r["gathered_bytes"] == round(ledger) for r in runs) and ledger == round(ledger),
            "load_average": [r["load"] for r in runs]}


# --- the parent: one torchrun launch per process count, then the report ---

def launch(args, cp: int, out: Path) -> list[dict]:
    """`python -m torch.distributed.run --standalone --nproc_per_node=cp` of this script's worker; returns rank 0's
    records. Raises SystemExit with the launch's output when it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", str(SCRIPT),
           "--worker", "--out", str(out), "--processes", str(cp), "--layouts", args.layouts,
           "--lengths", args.lengths, "--dense-max-length", str(args.dense_max_length), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"CP {cp} failed (exit {proc.returncode}): {' '.join(cmd)}")
    print(f"CP {cp}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def print_report(records: list[dict], args, env: dict) -> None:
    cores = env["cpu_count"]
    rows = []
    for r in records:
        procs = f"{r['processes']}" + (f" on {cores} cores (time-shared)" if r["processes"] > cores else "")
        rank_s = [statistics.median(x) for x in zip(*r["attention_s_per_rank"], strict=True)]
        rows.append([procs, r["length"], r["layout"], r["stage"], f"{r['step_s']:.2f}",
                     f"{max(rank_s):.2f} / {statistics.fmean(rank_s):.2f}",
                     f"{r['attention_max_over_mean']:.2f}", f"{r['pairs_max_over_mean']:.2f}",
                     r["gathered_bytes"], f"{r['ledger_bytes']:.0f}", "yes" if r["bytes_equal"] else "NO",
                     args.threads, " / ".join(f"{x[0]:.2f}" for x in r["load_average"] if x)])
    print(f"context parallelism: batch 1, fp32 CPU, gloo, {args.threads} torch thread(s) per process, {cores} cores; "
          "model: bench_config (2 layers, MLA + DSA top-64, IndexCache shared layer, MoE)\n")
    print(markdown_table(["processes", "tokens", "layout", "stage", "step s (fwd+bwd)", "attention s max / mean rank",
                          "attention max/mean", "pairs max/mean", "gathered bytes (rank 0, fwd)", "ledger bytes",
                          "equal", "threads/process", "load (1 min) after each step"], rows))
    print(f"\n- step: forward + backward of stage_losses, the slowest rank's, median of {args.repeats} after "
          f"{args.warmup} warm-up round(s) at the first length; attention s: per rank (median over repeats), the "
          "largest and the mean over ranks; attention max/mean (median over repeats): per-rank forward time in the "
          "MLA modules less their gathers; pairs max/mean: the causal (query, key) pairs each rank's positions own\n"
          "- gloo over loopback on a CPU: not GPU figures. "
          f"More processes than the {cores} cores time-share them: contention, not scaling\n"
          f"- load average at start {env['load_average_start']}, end {env['load_average_end']}\n")
    print(verdict(records))


def verdict(records: list[dict]) -> str:
    """The balanced layouts compared: the sparse stage's attention max/mean, by processes and length."""
    lines = ["sparse stage by layout: attention max/mean (1.00 = balanced), step s:"]
    for cp in sorted({r["processes"] for r in records}):
        for T in sorted({r["length"] for r in records}):
            got = [r for r in records if r["processes"] == cp and r["length"] == T and r["stage"] == "sparse"]
            lines.append(f"  cp {cp}, {T} tokens: " + ", ".join(
                f"{r['layout']} {r['attention_max_over_mean']:.2f}, {r['step_s']:.2f} s" for r in got))
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    torch.set_num_threads(args.threads)
    env = env_facts("cpu")
    t0 = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp_sizes:
            records += launch(args, cp, Path(tmp) / f"cp{cp}.json")
    env["load_average_end"] = load_average()
    runtime = time.perf_counter() - t0
    print_report(records, args, env)
    cfg = bench_config()
    record = {"benchmark": "context_parallel", "runtime_s": round(runtime, 1), "records": records,
              "config": {"processes": args.cp_sizes, "layouts": args.layout_list, "lengths": args.length_list,
                         "dense_max_length": args.dense_max_length, "repeats": args.repeats, "warmup": args.warmup,
                         "threads_per_process": args.threads,
                         "batch": 1, "dtype": "fp32", "backend": "gloo", "model": "bench_config",
                         "model_fields": {k: getattr(cfg, k) for k in (
                             "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_topk", "index_n_heads",
                             "index_head_dim", "n_routed_experts", "num_experts_per_tok", "vocab_size")}},
              "env": env}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
