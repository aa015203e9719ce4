"""DSA vs dense attention in a long prefill, and IndexCache's shared top-k (issue 5), fp32 CPU.

Model: the `bench` preset's attention widths (GLM-5's per-head shapes at reduced width: 8 heads,
q latent 768, kv latent 512 + RoPE 64, q/k no-RoPE 192, v 256; DSA indexer of 4 heads x 128,
index_topk 256), random init (seed 0), with the rest made light so that attention dominates:
dense MLPs of `--intermediate` (256) wide, no MoE, no MTP layer, vocab 4096, logits for the last
position only. What is timed is the WHOLE forward of that model (embedding, norms, q/kv
projections, attention, o_proj, the small MLPs, one row of logits): everything but attention is
linear in T and small; it is included in both columns alike.

Part 1, DSA vs dense (a 1-layer model, `indexer_types=["full"]`), one prefill of T tokens
(`--lengths`, default 4K, 8K, 16K, 32K; batch 1):
- dense: `model(ids, use_dsa=False, logits_to_keep=1)` in one call: the uncached path, per-head
  K/V expanded from the latent, causal `F.scaled_dot_product_attention(is_causal=True)` (torch's
  CPU flash kernel: no [T, T] tensor);
- DSA: `glm5lab.infer.prefill(model, ids, cache, chunk=--chunk)` (256 tokens per cached forward)
  into a fresh `KVCache.for_model(model, 1, T)`, as `benchmarks/prefill.py` and
  `glm5lab.generate` prefill: per chunk the indexer scores the cache, top-256 per query, and
  absorbed (latent-space) attention over the gathered keys (masked SDPA while the cache holds
  <= 16 x 256 keys, `attn_impl="auto"`).
The crossover is the smallest T where DSA is faster, interpolated linearly in log2 T between the
measured lengths ("below" the first length when DSA already wins there).
Goal: DSA at most half the dense time at 32K.

Part 2, IndexCache (`--ic-length`, default 32K): a 4-layer model, DSA chunked prefill as above,
`indexer_types` all "full" (4 indexers) vs retention 1/4 (["full", "shared", "shared", "shared"]:
one indexer, its top-k reused by the 3 later layers). Whole forward timed (small MLPs included).
Goal: at least 1.5x less time with retention 1/4.

Timing: `common.time_interleaved` (cases alternated), medians over `--repeats` (default 3 below
16K, 2 at 16K and above). Warm-up: one full untimed run of every case below `--full-warmup-below`
(16K); at and above it, a 2K-token run of every case instead (the same code paths and kernels;
a full 32K warm-up would add minutes of dense attention for little).

Memory safety: before a dense case runs, a probe measures the peak-RSS rise of one causal SDPA
over [1, 8, 2048, 256] (`common.PeakMemory`); if it is above a quarter of the [8, 2048, 2048]
fp32 score tensor, SDPA is materialising scores on this build, and dense cases whose [8, T, T]
scores (x 2) would exceed 70% of MemAvailable are skipped with a message (--force runs them).
Otherwise the dense case's memory is ~ 4 x [T, 8, 256] fp32 (q, k, v, out: 256 MiB each at 32K).

    .venv/bin/python benchmarks/dsa_attention.py              # T = 4K..32K, IndexCache at 32K
    .venv/bin/python benchmarks/dsa_attention.py --quick      # T = 1K, 2K; IndexCache at 2K
    .venv/bin/python benchmarks/dsa_attention.py --lengths 4096,8192,16384 --ic-length 16384

Prints markdown tables, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PeakMemory, markdown_table, median, mem_available_bytes, mib, print_json_line,
                    time_interleaved, verdict)

from glm5lab import ModelConfig
from glm5lab.environment import env_facts, load_average

GOALS = {"dsa_over_dense_max": 0.5, "dense_T": 32768, "indexcache_speedup_min": 1.5}
SHORT_WARMUP_TOKENS = 2048
SKIP_ABOVE_AVAILABLE = 0.7


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="prefill lengths T for DSA vs dense")
    p.add_argument("--ic-length", type=int, default=32768, help="IndexCache comparison length (0 = skip)")
    p.add_argument("--chunk", type=int, default=256, help="DSA prefill chunk (tokens per cached forward)")
    p.add_argument("--intermediate", type=int, default=256, help="dense MLP width (kept small: attention dominates)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3 below 16K, 2 at 16K+)")
    p.add_argument("--full-warmup-below", type=int, default=16384,
                   help="a full-length warm-up below this T; a 2K-token warm-up at and above it")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="run dense cases the memory check would skip")
    p.add_argument("--quick", action="store_true", help="T = 1K, 2K; IndexCache at 2K (validates the script)")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.ic_length = "1024,2048", 2048
    args.length_list = [int(x) for x in args.lengths.split(",") if x]
    return args


def repeats_for(args, T: int) -> int:
    return args.repeats if args.repeats else (2 if T >= 16384 else 3)


def make_model(args, n_layers: int, indexer_types: list[str], max_T: int):
    from glm5lab import GLM5ForCausalLM

    cfg = ModelConfig.from_preset("bench", num_hidden_layers=n_layers, indexer_types=indexer_types,
                                  mlp_layer_types=["dense"] * n_layers, intermediate_size=args.intermediate,
                                  num_nextn_predict_layers=0, max_position_embeddings=max(16384, max_T))
    torch.manual_seed(args.seed)
    return GLM5ForCausalLM(cfg).eval(), cfg


def dsa_prefill(model, ids, chunk: int):
    from glm5lab.infer import prefill
    from glm5lab.model.cache import KVCache

    return prefill(model, ids, KVCache.for_model(model, 1, ids.shape[1]), chunk=chunk).logits_BV[0]


def dense_prefill(model, ids):
    return model(ids, use_dsa=False, logits_to_keep=1).logits[0, -1]


def sdpa_materialises(device) -> tuple[bool, int]:
    """Whether causal SDPA on this build allocates [H, T, T] scores: the peak-RSS rise of one call
    at T = 2048 vs a quarter of the [8, T, T] fp32 score tensor (128 MiB)."""
    T, H, D = 2048, 8, 256
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True)  # warm
    peak = PeakMemory(device)
    peak.reset()
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rise = peak.rise_bytes()
    return rise > H * T * T * 4 / 4, rise


def crossover(rows: list[tuple[int, float]]) -> str:
    """rows: (T, dsa/dense) sorted by T. The smallest T where the ratio drops below 1."""
    if not rows:
        return "n/a"
    if rows[0][1] < 1:
        return f"below {rows[0][0]}"
    for (t0, r0), (t1, r1) in zip(rows, rows[1:], strict=False):
        if r0 >= 1 > r1:
            f = (r0 - 1) / (r0 - r1)
            return f"~{round(2 ** (math.log2(t0) + f * (math.log2(t1) - math.log2(t0))))}"
    return f"above {rows[-1][0]}"


def fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    device = torch.device("cpu")
    env = env_facts(device)
    max_T = max(args.length_list + [args.ic_length])
    gen = torch.Generator().manual_seed(args.seed)
    ids_all = torch.randint(0, 4096, (1, max_T), generator=gen)
    available = mem_available_bytes()
    materialises, probe_rise = sdpa_materialises(device)
    print(f"SDPA causal probe at T=2048: peak rise {mib(probe_rise)} MiB -> "
          f"{'materialises scores' if materialises else 'no [T, T] scores (flash kernel)'}; "
          f"MemAvailable {mib(available)} MiB", file=sys.stderr, flush=True)

    # -- part 1: DSA vs dense, 1 layer -------------------------------------------------------------
    model1, cfg1 = make_model(args, 1, ["full"], max_T)
    part1 = []
    for T in args.length_list:
        ids = ids_all[:, :T]
        dense_scores = 2 * cfg1.num_attention_heads * T * T * 4
        skip = (materialises and not args.force and available is not None
                and dense_scores > SKIP_ABOVE_AVAILABLE * available)
        if skip:
            print(f"T={T}: dense SKIPPED (SDPA materialises scores: ~{mib(dense_scores)} MiB > 70% of "
                  f"MemAvailable)", file=sys.stderr, flush=True)
        cases = {"dsa": lambda ids=ids, m=model1: dsa_prefill(m, ids, args.chunk)}
        if not skip:
            cases["dense"] = lambda ids=ids, m=model1: dense_prefill(m, ids)
        reps = repeats_for(args, T)
        if T < args.full_warmup_below:
            warm = 1
        else:
            warm = 0
            w = ids_all[:, :SHORT_WARMUP_TOKENS]
            dsa_prefill(model1, w, args.chunk)
            if not skip:
                dense_prefill(model1, w)
        res = time_interleaved(cases, device=device, warmup=warm, repeats=reps)
        entry = {"T": T, "repeats": reps, "warmup": "full" if warm else f"{SHORT_WARMUP_TOKENS} tokens",
                 "dsa_s": median([s for s, _ in res["dsa"]]), "dsa_s_repeats": [round(s, 3) for s, _ in res["dsa"]],
                 "dense_s": None, "dense_s_repeats": None, "dense_skipped": skip}
        if not skip:
            entry["dense_s"] = median([s for s, _ in res["dense"]])
            entry["dense_s_repeats"] = [round(s, 3) for s, _ in res["dense"]]
            entry["dsa_over_dense"] = entry["dsa_s"] / entry["dense_s"]
        part1.append(entry)
        print(f"T={T}: dsa {entry['dsa_s_repeats']} s, dense {entry['dense_s_repeats']} s (load {load_average()})",
              file=sys.stderr, flush=True)
    del model1
    ratios = [(e["T"], e["dsa_over_dense"]) for e in part1 if e.get("dsa_over_dense") is not None]
    cross = crossover(ratios)

    # -- part 2: IndexCache, 4 layers --------------------------------------------------------------
    part2 = None
    if args.ic_length:
        T = args.ic_length
        ids = ids_all[:, :T]
        full, _ = make_model(args, 4, ["full"] * 4, max_T)
        shared, _ = make_model(args, 4, ["full", "shared", "shared", "shared"], max_T)
        cases = {"full": lambda: dsa_prefill(full, ids, args.chunk),
                 "retain_1_4": lambda: dsa_prefill(shared, ids, args.chunk)}
        reps = repeats_for(args, T)
        if T < args.full_warmup_below:
            warm = 1
        else:
            warm = 0
            for m in (full, shared):
                dsa_prefill(m, ids_all[:, :SHORT_WARMUP_TOKENS], args.chunk)
        res = time_interleaved(cases, device=device, warmup=warm, repeats=reps)
        part2 = {"T": T, "repeats": reps, "warmup": "full" if warm else f"{SHORT_WARMUP_TOKENS} tokens",
                 "full_s": median([s for s, _ in res["full"]]),
                 "full_s_repeats": [round(s, 3) for s, _ in res["full"]],
                 "retain_1_4_s": median([s for s, _ in res["retain_1_4"]]),
                 "retain_1_4_s_repeats": [round(s, 3) for s, _ in res["retain_1_4"]]}
        part2["speedup"] = part2["full_s"] / part2["retain_1_4_s"]
        print(f"IndexCache T={T}: full {part2['full_s_repeats']} s, 1/4 {part2['retain_1_4_s_repeats']} s "
              f"(load {load_average()})", file=sys.stderr, flush=True)
        del full, shared

    # -- report -------------------------------------------------------------------------------------
    env["load_average_end"] = load_average()
    print("### DSA vs dense: one prefill of T tokens, 1-layer bench-width model (whole forward, small MLP)\n")
    rows = [[e["T"], fmt(e["dense_s"]) if not e["dense_skipped"] else "skipped (memory)", fmt(e["dsa_s"]),
             fmt(e.get("dsa_over_dense"), 2), e["repeats"], e["warmup"]] for e in part1]
    print(markdown_table(["T", "dense s (SDPA causal, whole)", f"DSA s (chunks of {args.chunk}, cache)",
                          "DSA / dense", "repeats", "warm-up"], rows))
    goal_T = GOALS["dense_T"]
    at_goal = next((e for e in part1 if e["T"] == goal_T and e.get("dsa_over_dense") is not None), None)
    goal1 = None if at_goal is None else at_goal["dsa_over_dense"] <= GOALS["dsa_over_dense_max"]
    print(f"\nCrossover (DSA faster): {cross}. Goal at {goal_T}: DSA/dense <= {GOALS['dsa_over_dense_max']}: "
          + ("not measured" if goal1 is None else f"{at_goal['dsa_over_dense']:.2f} -> {verdict(goal1)}"))
    goal2 = None
    if part2:
        print(f"\n### IndexCache: 4-layer DSA prefill of {part2['T']} tokens (chunks of {args.chunk}; whole forward, "
              f"small MLPs)\n")
        print(markdown_table(["indexer_types", "seconds", "speedup vs all full", "repeats", "warm-up"], [
            ["full x4", fmt(part2["full_s"]), "1.00", part2["repeats"], part2["warmup"]],
            ["full, shared x3 (1/4)", fmt(part2["retain_1_4_s"]), f"{part2['speedup']:.2f}", part2["repeats"],
             part2["warmup"]]]))
        goal2 = part2["speedup"] >= GOALS["indexcache_speedup_min"]
        print(f"\nGoal: >= {GOALS['indexcache_speedup_min']}x with retention 1/4: {part2['speedup']:.2f}x -> "
              f"{verdict(goal2)}")
    print()
    record = {"benchmark": "dsa_attention", "args": {k: v for k, v in vars(args).items() if k != "length_list"},
              "model": {"hidden": 1024, "heads": cfg1.num_attention_heads, "kv_lora_rank": cfg1.kv_lora_rank,
                        "qk_rope": cfg1.qk_rope_head_dim, "qk_nope": cfg1.qk_nope_head_dim, "v": cfg1.v_head_dim,
                        "index_heads": cfg1.index_n_heads, "index_head_dim": cfg1.index_head_dim,
                        "index_topk": cfg1.index_topk, "intermediate": args.intermediate, "vocab": cfg1.vocab_size},
              "sdpa_probe": {"materialises": materialises, "rise_bytes": probe_rise},
              "dsa_vs_dense": part1, "crossover": cross, "indexcache": part2, "goals": GOALS,
              "goal_dsa_half_dense_met": goal1, "goal_indexcache_met": goal2, "env": env}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
