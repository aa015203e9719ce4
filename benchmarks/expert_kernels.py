"""The fourth MoE cost account (issue 39 item 5): achieved FLOP/s of the expert kernels (loop, grouped = the
padded batch, grouped_mm, gathered), forward and backward, as a share of the same run's matmul peak, against
tokens per expert and routing skew, at the `small` preset's expert shape and GLM-5's divided by 8.

Definitions (skews, useful FLOPs, time basis, shapes): `glm5lab.expert_sweep`. Figure: `--png`
(docs/figures/expert_kernels.png); record: `--json-out` (benchmarks/results/expert_kernels.json); both written by
default only without --quick.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/expert_kernels.py --threads 1          # the full sweep
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/expert_kernels.py --threads 1 --quick  # seconds, no record
    .venv/bin/python benchmarks/expert_kernels.py --device cuda --dtype bf16             # the GPU check

Prints a table (share of peak per cell), the tokens per expert at which each kernel reaches half of the
peak, then one JSON line (the record, with threads and load average at start and end).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, print_json_line, setup_device

from glm5lab.expert_sweep import (DIRECTIONS, KERNELS, SHAPES, SKEWS, SweepPlan, half_peak_text, sweep)
from glm5lab.report import expert_kernels

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FULL_TOKENS = [1, 4, 16, 64, 256, 1024, 4096]


def plan_of(args, device) -> SweepPlan:
    """The sweep `args` ask for (`--quick`: the small shape, two skews, 1-256 tokens, short timings). The peak
    matmul: 8192-square on CUDA (a smaller one measures launch overhead, not the peak), else 2048 (quick 512)."""
    peak_n = 8192 if device.type == "cuda" else 512 if args.quick else 2048
    if args.quick:
        return SweepPlan(shapes=[SHAPES["small"]], skews=["uniform", "one_hot"], tokens=[1, 16, 256],
                         kernels=list(KERNELS), directions=list(DIRECTIONS), device=device, dtype=DTYPES[args.dtype],
                         rounds=1, target_s=0.01, peak_n=peak_n)
    return SweepPlan(shapes=list(SHAPES.values()), skews=list(SKEWS), tokens=FULL_TOKENS, kernels=list(KERNELS),
                     directions=list(DIRECTIONS), device=device, dtype=DTYPES[args.dtype], rounds=args.rounds,
                     target_s=args.target_s, max_bytes=int(args.max_gib * 2**30), peak_n=peak_n)


def table(record: dict) -> str:
    """One row per (shape, skew, tokens per expert): each kernel's forward / backward share of peak."""
    cells = {(p["shape"], p["skew"], p["tokens_per_expert"], p["kernel"], p["direction"]): p["share"]
             for p in record["points"]}
    keys = sorted({k[:3] for k in cells}, key=lambda k: (list(SHAPES).index(k[0]), SKEWS.index(k[1]), k[2]))
    kernels = [k for k in KERNELS if any(c[3] == k for c in cells)]

    def pct(key):
        return f"{100 * cells[key]:.0f}%" if key in cells else "-"
    rows = [[sh, sk, m, *[f"{pct((sh, sk, m, k, 'forward'))} / {pct((sh, sk, m, k, 'backward'))}" for k in kernels]]
            for sh, sk, m in keys]
    return markdown_table(["shape", "skew", "tokens/expert", *[f"{k} fwd / bwd" for k in kernels]], rows)


def half_peak_rows(record: dict) -> list[list[str]]:
    shapes = list(dict.fromkeys(p["shape"] for p in record["points"]))
    skews = list(dict.fromkeys(p["skew"] for p in record["points"]))
    kernels = list(dict.fromkeys(p["kernel"] for p in record["points"]))
    return [[sh, k, d, *[half_peak_text(record["points"], sh, sk, k, d) for sk in skews]]
            for sh in shapes for k in kernels for d in DIRECTIONS], skews


RECORD = ROOT / "benchmarks" / "results" / "expert_kernels.json"
FIGURE = ROOT / "docs" / "figures" / "expert_kernels.png"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds: small shape, 2 skews, 1-256 tokens per expert")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="the kernels' and the peak matmul's dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds per cell (default 2; --quick: 1)")
    p.add_argument("--target-s", type=float, help="seconds of repeated calls per cell, round, direction (default "
                   "0.1; --quick: 0.01)")
    p.add_argument("--max-gib", type=float, help="skip a kernel whose estimated memory exceeds this (default 4; "
                   "--quick: no bound)")
    p.add_argument("--json-out", type=Path, help="the record (default: benchmarks/results/expert_kernels.json; with --quick: "
                   "none, so that a quick try never replaces the full sweep's record)")
    p.add_argument("--png", type=Path, help="the figure (default: docs/figures/expert_kernels.png; with --quick: none)")
    args = p.parse_args(argv)
    if not args.quick:
        args.json_out = args.json_out or RECORD
        args.png = args.png or FIGURE
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads = {args.threads} is not allowed: an integer >= 1")
    given = [f"--{k.replace('_', '-')}" for k in ("rounds", "target_s", "max_gib") if getattr(args, k) is not None]
    if args.quick and given:
        p.error(f"{', '.join(given)} applies only to the full sweep: --quick fixes its own timings; drop --quick or them")
    args.rounds = 2 if args.rounds is None else args.rounds
    args.target_s = 0.1 if args.target_s is None else args.target_s
    args.max_gib = 4.0 if args.max_gib is None else args.max_gib
    if args.rounds < 1 or not 0 < args.target_s < math.inf or not 0 < args.max_gib < math.inf:
        p.error(f"--rounds = {args.rounds}, --target-s = {args.target_s}, --max-gib = {args.max_gib}: "
                "rounds >= 1 and positive finite seconds and GiB are allowed")
    for flag, path in (("--json-out", args.json_out), ("--png", args.png)):
        if path is not None and path.is_dir():
            p.error(f"{flag} = '{path}' is not allowed: a file path (it is a folder)")
    device = setup_device(args)
    from glm5lab.environment import env_facts, load_average

    env = env_facts(device)
    plan = plan_of(args, device)
    result = sweep(plan, progress=lambda line: print(line, file=sys.stderr, flush=True))
    env["load_average_end"] = load_average()
    record = {"benchmark": "expert_kernels", "command": "benchmarks/expert_kernels.py " + " ".join(sys.argv[1:] if
              argv is None else argv), "env": env, "dtype": args.dtype, "quick": args.quick,
              "shapes": {s.name: s.__dict__ for s in plan.shapes}, "rounds": plan.rounds, "target_s": plan.target_s,
              **result}
    rows, skews = half_peak_rows(record)
    record["half_peak"] = {f"{r[0]}|{r[1]}|{r[2]}": dict(zip(skews, r[3:], strict=True)) for r in rows}
    print(f"\nexpert kernels, {device} {args.dtype}, {env['torch_threads']} thread(s): share of the matmul peak "
          f"({result['peak']['flops_per_s'] / 1e9:.1f} GFLOP/s, median of {len(result['peak']['samples'])} "
          f"{result['peak']['n']}-square mm, {result['time_basis']} time), useful FLOPs only\n")
    print(table(record))
    print("\nhalf of the peak reached from (tokens per expert)\n")
    print(markdown_table(["shape", "kernel", "direction", *skews], rows))
    for s in result["skipped"]:
        if s["tokens_per_expert"] == min(x["tokens_per_expert"] for x in result["skipped"] if x["kernel"] == s["kernel"]
                                         and x["shape"] == s["shape"] and x["skew"] == s["skew"]):
            print(f"skipped {s['shape']} {s['skew']} {s['kernel']} from {s['tokens_per_expert']}: {s['reason']}")
    print(f"\nthreads {env['torch_threads']}, load average {env['load_average_start']} -> {env['load_average_end']}")
    if args.json_out:
        from glm5lab.io_utils import atomic_write_text

        atomic_write_text(args.json_out, json.dumps(record, indent=1) + "\n")
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        expert_kernels.plot(record, args.png)
    print_json_line({"benchmark": "expert_kernels", "threads": env["torch_threads"],
                     "load_average_start": env["load_average_start"], "load_average_end": env["load_average_end"],
                     "device": str(device), "dtype": args.dtype, "peak_flops_per_s": result["peak"]["flops_per_s"],
                     "half_peak": record["half_peak"], "json_out": str(args.json_out) if args.json_out else None})
    return record


if __name__ == "__main__":
    main()
