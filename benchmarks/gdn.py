"""Gated DeltaNet: the chunked form vs the token-by-token recurrence, forward, at T = 1K..8K.

    .venv/bin/python benchmarks/gdn.py                 # T = 1K, 2K, 4K, 8K; B 1, H 8, K = V = 128
    .venv/bin/python benchmarks/gdn.py --quick         # tiny: validates the script

Both are `glm5lab.model.gdn` functions on the same random inputs (q, k L2-normalised, g =
-softplus, beta = sigmoid, as a Gated DeltaNet layer feeds them), fp32, no grad; the outputs are
checked equal (max |diff|) before timing. Goal (issue 5): chunked at least 5x faster at 4K.
Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, median, print_json_line, time_interleaved

from glm5lab.environment import env_facts, load_average
from glm5lab.model.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent, l2_normalize

GOAL = {"T": 4096, "speedup": 5.0}


def inputs(T: int, args, device):
    g = torch.Generator().manual_seed(0)
    B, H, K, V = 1, args.heads, args.head_dim, args.head_dim
    q, k = (l2_normalize(torch.randn(B, T, H, K, generator=g)) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    decay = -F.softplus(torch.randn(B, T, H, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    return [t.to(device) for t in (q, k, v, decay, beta)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated T")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", dest="head_dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64, help="chunk size of the chunked form (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="T = 128, 256; 1 repeat")
    args = p.parse_args(argv)
    lengths = [128, 256] if args.quick else [int(t) for t in args.lengths.split(",")]
    repeats = 1 if args.quick else args.repeats
    env, rows, record = env_facts(args.device), [], {}
    with torch.no_grad():
        for T in lengths:
            x = inputs(T, args, args.device)
            cases = {"recurrent": lambda x=x: gated_delta_rule_recurrent(*x),
                     "chunked": lambda x=x: gated_delta_rule_chunked(*x, chunk_size=args.chunk)}
            (o_r, s_r), (o_c, s_c) = (fn() for fn in cases.values())
            diff = max(float((o_r - o_c).abs().max()), float((s_r - s_c).abs().max()))
            runs = time_interleaved(cases, device=args.device, warmup=0 if args.quick else 1, repeats=repeats)
            sec = {name: median([s for s, _ in r]) for name, r in runs.items()}
            speedup = sec["recurrent"] / sec["chunked"]
            rows.append([T, f"{sec['recurrent']:.3f}", f"{sec['chunked']:.3f}", f"{speedup:.1f}x", f"{diff:.1e}"])
            record[str(T)] = {"recurrent_s": sec["recurrent"], "chunked_s": sec["chunked"], "speedup": speedup,
                              "max_abs_diff": diff,
                              "repeats_s": {n: [s for s, _ in r] for n, r in runs.items()}}
            print(f"T={T}: recurrent {sec['recurrent']:.3f} s, chunked {sec['chunked']:.3f} s", flush=True)
    print(f"\nGated DeltaNet forward, B 1, H {args.heads}, K = V = {args.head_dim}, chunk {args.chunk}, "
          f"{args.device} fp32, {torch.get_num_threads()} threads\n")
    print(markdown_table(["T", "recurrent s", "chunked s", "speedup", "max |diff|"], rows))
    met = str(GOAL["T"]) in record and record[str(GOAL["T"])]["speedup"] >= GOAL["speedup"]
    if str(GOAL["T"]) in record:
        print(f"\n- goal chunked >= {GOAL['speedup']}x recurrent at T={GOAL['T']}: "
              f"{record[str(GOAL['T'])]['speedup']:.1f}x ({'met' if met else 'MISSED'})")
    env["load_average_end"] = load_average()
    print_json_line({"benchmark": "gdn", "goal": {**GOAL, "met": met}, "lengths": record,
                     "config": vars(args), "env": env})


if __name__ == "__main__":
    main()
