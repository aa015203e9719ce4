"""Prefill of one long sequence: time and peak memory, glm5lab (chunked, latent cache) vs transformers.

One sequence of T random tokens (T = 2K, 4K, 8K; batch 1) through the "wide attention"
`bench` preset model (random init, seed 0; or --model), same weights on both sides:
- ours: `glm5lab.infer.prefill(model, ids, cache, chunk=--chunk)` into a fresh
  `KVCache.for_model(model, 1, T)` (the prefill `glm5lab.generate` runs with `prefill_chunk`):
  one cached forward per chunk of `--chunk` tokens, which attends to the cache + itself, DSA
  top-k per query;
- transformers: `GlmMoeDsaForCausalLM(...)(input_ids=ids, use_cache=True, logits_to_keep=1)` in one
  call, attn_implementation eager (the reference: scores [1, heads, T, T] materialised, keys outside
  the indexer's top-k masked) and, with `--hf-attn eager,sdpa` (the default), also sdpa (transformers
  5.24 applies the same DSA mask there, through torch's fused SDPA).

Each (implementation, T) case runs in a fresh subprocess of this script (`--one-case IMPL T`): it
loads the model, runs a 64-token warm-up, resets the peak, runs the case once, and reports the
seconds and the peak memory rise. CPU: the rise of peak RSS (`ru_maxrss`, KiB on Linux) over the
RSS just before the case, the peak having been reset by writing "5" to /proc/self/clear_refs
(`common.PeakMemory`); CUDA: `torch.cuda.max_memory_allocated` over `memory_allocated` (bf16).
The cases are run interleaved (every case once, then again) `--repeats` times; times are medians,
peaks the median too (they barely move). The rise includes the cache and logits (both sides).

Safety: before anything runs, the estimated biggest transient of each case is printed
(transformers eager: two live [1, heads, T, T] fp32 score tensors, or the indexer's two
[1, T, index_heads, T]; plus the [T, T] masks: ~4.6 GiB at 8K); a case whose estimate x 1.5 is
above 70% of MemAvailable is skipped (--force runs it), and on CPU every child runs under RLIMIT_AS = its address space
after loading + --mem-limit-gib, so an oversized allocation fails in the child instead of
taking the machine down.

    .venv/bin/python benchmarks/prefill.py                    # T = 2K, 4K, 8K; chunk 256
    .venv/bin/python benchmarks/prefill.py --quick            # tiny: validates the script
    .venv/bin/python benchmarks/prefill.py --chunk-sweep 512,1024,2048   # extra rows for ours
    .venv/bin/python benchmarks/prefill.py --lengths 2048 --index-topk 64  # gathered regime at small T

Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PeakMemory, load_ours, markdown_table, median, mem_available_bytes, mib, model_dtype,
                    print_json_line, resolve_checkpoint, save_random_model, timed, verdict)

from glm5lab import ModelConfig
from glm5lab.environment import env_facts, load_average

GOALS = {"speedup": 4.0, "memory_ratio": 8.0, "T": 8192}
"""Targets at T = 8K: ours >= 4x faster than transformers' masked DSA (eager), with >= 8x less
peak memory."""
WARMUP_TOKENS = 64
SKIP_ABOVE_AVAILABLE = 0.7
ESTIMATE_MARGIN = 1.5
"""The estimates count the quadratic tensors only; measured peak rises at T = 1K-2K were 1.2-1.7x
them (transformers eager 454 MiB vs 310 estimated at 2K), so the safety check uses 1.5x."""
MAX_LOGIT_DIFF = 1e-3
"""Last-position logits, ours vs transformers eager (fp32): reported; larger differences are
flagged (exact ties at the DSA top-k boundary may legitimately change a few keys)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192", help="sequence lengths T, comma-separated")
    p.add_argument("--chunk", type=int, default=256, help="ours' prefill chunk (tokens per forward; see "
                                                         "BENCHMARKS.md for why 256)")
    p.add_argument("--chunk-sweep", default="", help="also run ours at these chunks (comma-separated)")
    p.add_argument("--attn-impl", default="auto", choices=("auto", "absorbed", "naive"),
                   help="ours' attn_impl (auto: gathered top-k above 16 x index_topk keys, else masked SDPA)")
    p.add_argument("--hf-attn", default="eager,sdpa", help="transformers attention implementations to run")
    p.add_argument("--repeats", type=int, default=3, help="subprocess runs per case; medians are reported")
    p.add_argument("--model", default=None, help="a checkpoint or run folder instead of the random bench model")
    p.add_argument("--index-topk", type=int, default=None,
                   help="override the bench preset's index_topk (256): e.g. 64 reaches the gathered-top-k regime "
                        "(above 16 x index_topk keys) at small T")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda runs bf16 weights")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every child")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-limit-gib", type=float, default=12.0,
                   help="CPU: address-space headroom each child gets after loading (RLIMIT_AS)")
    p.add_argument("--force", action="store_true", help="run cases whose memory estimate exceeds 70%% of MemAvailable")
    p.add_argument("--child-timeout", type=int, default=3600, help="seconds before a child is killed")
    p.add_argument("--quick", action="store_true", help="tiny sizes to validate the script (< 1 min)")
    # child mode (internal)
    p.add_argument("--one-case", nargs=2, metavar=("IMPL", "T"), default=None,
                   help="(internal) run one case in this process: IMPL ours|hf-eager|hf-sdpa")
    p.add_argument("--folder", default=None, help="(internal) the model folder of --one-case")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats = "512,768", 1
    args.length_list = [int(x) for x in args.lengths.split(",") if x]
    args.sweep = [int(x) for x in args.chunk_sweep.split(",") if x]
    args.hf_list = [x for x in args.hf_attn.split(",") if x]
    bad = [x for x in args.hf_list if x not in ("eager", "sdpa")]
    if bad:
        p.error(f"--hf-attn: {bad} not allowed (eager, sdpa)")
    return args


# -- estimates --------------------------------------------------------------------------------

def estimate_bytes(cfg, impl: str, T: int, chunk: int, elem: int = 4) -> dict:
    """Rough size of the biggest transient tensors of one case (batch 1), for the safety check.

    transformers (per layer; the layers run one after the other): the indexer's [T, I, T] fp32 dots
    (two live: the scaled product and its ReLU); eager attention's [H, T, T] scores (two live:
    scores and the masked sum / softmax); sdpa: a fused kernel, counted as one [T, T] fp32 mask;
    plus the [T, T] masks (causal, index, combined). ours (per chunk of C over S <= T keys): the
    indexer's [C, I, S] fp32 dots (two live), the sort of [C, S] scores (values + int64 indices),
    the gathered top-K latents [C, K, C_kv + R] and values [C, K, C_kv] (when S > 16 K), or on the
    masked path (S <= 16 K) SDPA's math fallback: the latent key/value expanded per head [H, S, .]
    and two [H, C, S] score tensors; plus the cache."""
    H, I, K = cfg.num_attention_heads, cfg.index_n_heads, cfg.index_topk
    if impl == "ours":
        C, S = min(chunk, T), T
        width = cfg.mla_cache_width + cfg.kv_lora_rank  # gathered key (latent + RoPE key) + value (latent)
        indexer = 2 * C * I * S * 4 + C * S * (4 + 8)
        gather = C * K * width * elem if S > 16 * K else 0
        S_m = min(S, 16 * K)  # the longest chunk that takes the masked path: SDPA's math fallback expands
        masked = H * S_m * width * elem + 2 * H * C * S_m * 4  # the latent key/value per head, [H, C, S] scores
        cache = T * (cfg.num_hidden_layers * cfg.mla_cache_width + cfg.index_head_dim) * elem
        parts = {"indexer": indexer, "gathered": gather, "masked": masked, "cache": cache}
        return {"parts": parts, "total": max(indexer, gather, masked) + cache}
    TT = T * T
    indexer = 2 * I * TT * 4
    eager = impl == "hf-eager"
    attention = 2 * H * TT * elem if eager else TT * 4
    masks = TT * ((4 if eager else 1) * 2 + 2)
    return {"parts": {"indexer": indexer, "attention": attention, "masks": masks},
            "total": max(indexer, attention) + masks}


# -- child: one case in this process ------------------------------------------------------------

def child(args) -> None:
    impl, T = args.one_case[0], int(args.one_case[1])
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    folder = Path(args.folder)
    if impl == "ours":
        from glm5lab.infer import prefill
        from glm5lab.model.cache import KVCache

        model = load_ours(folder, device)

        def run(ids):
            cache = KVCache.for_model(model, 1, ids.shape[1])
            return prefill(model, ids, cache, chunk=args.chunk, attn_impl=args.attn_impl).logits_BV[0]
    else:
        from glm5lab.hf import load_transformers_twin

        model = load_transformers_twin(folder, dtype=model_dtype(device), device=device,
                                       attn_implementation=impl.removeprefix("hf-"))

        def run(ids):
            return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1]
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(args.seed)).to(device)
    with torch.no_grad():
        run(ids[:, :WARMUP_TOKENS])
        limit = _limit_address_space(args.mem_limit_gib) if device.type == "cpu" else None
        peak = PeakMemory(device)
        peak.reset()
        error = None
        try:
            seconds, logits = timed(lambda: run(ids), device)
        except (RuntimeError, MemoryError) as e:  # an allocation over RLIMIT_AS, or CUDA OOM
            seconds, logits, error = None, None, f"{type(e).__name__}: {str(e)[:300]}"
        rise = peak.rise_bytes()
    print(json.dumps({"impl": impl, "T": T, "chunk": args.chunk if impl == "ours" else None,
                      "seconds": seconds, "peak_rise_bytes": rise, "baseline_bytes": peak.baseline,
                      "peak_reset": peak.reset_ok, "address_space_limit": limit, "error": error,
                      "logits": None if logits is None else [round(float(x), 6) for x in logits.float().cpu()]}),
          flush=True)
    if error:
        sys.exit(3)


def _limit_address_space(headroom_gib: float) -> int | None:
    """RLIMIT_AS = current address space + headroom (Linux): an allocation past it fails here."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                limit = int(line.split()[1]) * 1024 + int(headroom_gib * 2**30)
                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
                return limit
    except (OSError, ValueError):
        pass
    return None


# -- parent ----------------------------------------------------------------------------------

def run_child(args, folder: Path, impl: str, T: int, chunk: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-case", impl, str(T), "--folder", str(folder),
           "--chunk", str(chunk), "--attn-impl", args.attn_impl, "--device", args.device, "--seed", str(args.seed),
           "--mem-limit-gib", str(args.mem_limit_gib)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.child_timeout,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"impl": impl, "T": T, "error": f"timed out after {args.child_timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr or proc.stdout)[-800:]
        return {"impl": impl, "T": T, "error": f"child exit {proc.returncode} (signal 9 = killed, e.g. out of "
                                               f"memory): {tail}"}
    res = json.loads(lines[-1])
    res["child_wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def case_list(args) -> list[tuple[str, int, int]]:
    cases = []
    for T in args.length_list:
        cases.append(("ours", T, args.chunk))
        cases += [("ours", T, c) for c in args.sweep if c != args.chunk]
        cases += [(f"hf-{a}", T, args.chunk) for a in args.hf_list]
    return cases


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.one_case:
        return child(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    env = env_facts(device)
    if args.threads:
        env["torch_threads"] = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {"index_topk": args.index_topk} if args.index_topk else {}
        if args.model and overrides:
            raise SystemExit("--index-topk applies to the random bench model only, not to --model")
        folder = (resolve_checkpoint(args.model) if args.model
                  else save_random_model(ModelConfig.from_preset("bench", **overrides), tmp, seed=args.seed))

        cfg = ModelConfig.from_hf(folder)
        too_long = [T for T in args.length_list if T > cfg.max_position_embeddings]
        if too_long:
            raise SystemExit(f"lengths {too_long} exceed max_position_embeddings={cfg.max_position_embeddings}")
        cases = case_list(args)
        available = mem_available_bytes()
        elem = 2 if device.type == "cuda" else 4
        estimates = {(i, T, c): estimate_bytes(cfg, i, T, c, elem) for i, T, c in cases}
        print(f"memory estimates (biggest transients; MemAvailable {mib(available)} MiB):", file=sys.stderr)
        skipped = {}
        for (i, T, c), e in estimates.items():
            parts = ", ".join(f"{k} {mib(v)}" for k, v in e["parts"].items())
            too_big = (available is not None and not args.force
                       and ESTIMATE_MARGIN * e["total"] > SKIP_ABOVE_AVAILABLE * available)
            print(f"  {i} T={T}{f' chunk {c}' if i == 'ours' else ''}: ~{mib(e['total'])} MiB ({parts})"
                  + ("  -> SKIPPED (1.5 x estimate above 70% of MemAvailable; --force runs it)" if too_big else ""),
                  file=sys.stderr, flush=True)
            if too_big:
                skipped[(i, T, c)] = (f"1.5 x estimate {mib(e['total'])} MiB > 70% of MemAvailable "
                                      f"{mib(available)} MiB")
        samples: dict[tuple, list[dict]] = {k: [] for k in cases}
        for r in range(args.repeats):
            for case in cases:
                if case in skipped:
                    continue
                res = run_child(args, folder, *case)
                samples[case].append(res)
                print(f"repeat {r + 1}/{args.repeats} {case[0]} T={case[1]}"
                      + (f" chunk {case[2]}" if case[0] == "ours" else "")
                      + (f": {res['seconds']:.3f} s, peak +{mib(res['peak_rise_bytes'])} MiB" if not res.get("error")
                         else f": FAILED {res['error'][:200]}") + f" (load {load_average()})",
                      file=sys.stderr, flush=True)
    env["load_average_end"] = load_average()
    summary = summarise(samples, skipped, estimates)
    record = report(summary, args, cfg, env)
    print_json_line(record)
    return record


def summarise(samples, skipped, estimates) -> dict:
    out = {}
    for (impl, T, c), runs in samples.items():
        ok = [r for r in runs if not r.get("error")]
        entry = {"impl": impl, "T": T, "chunk": c if impl == "ours" else None,
                 "estimate_bytes": estimates[(impl, T, c)]["total"],
                 "errors": [r["error"] for r in runs if r.get("error")]}
        if (impl, T, c) in skipped:
            entry["skipped"] = skipped[(impl, T, c)]
        if ok:
            entry.update(seconds=median([r["seconds"] for r in ok]), seconds_repeats=[round(r["seconds"], 4) for r in ok],
                         peak_rise_bytes=median([r["peak_rise_bytes"] for r in ok]),
                         peak_rise_bytes_repeats=[r["peak_rise_bytes"] for r in ok],
                         baseline_bytes=median([r["baseline_bytes"] for r in ok]),
                         peak_reset=all(r["peak_reset"] for r in ok), logits=ok[-1]["logits"])
        out[(impl, T, c)] = entry
    return out


def report(summary, args, cfg, env) -> dict:
    def get(impl, T, c=None):
        return summary.get((impl, T, c if c is not None else args.chunk))

    rows, per_T = [], {}
    for T in args.length_list:
        o, e = get("ours", T), get("hf-eager", T)
        s = get("hf-sdpa", T)
        fig = {"ours_s": o.get("seconds"), "ours_peak": o.get("peak_rise_bytes")}
        for name, h in (("eager", e), ("sdpa", s)):
            if h is None or h.get("seconds") is None:
                continue
            fig[f"hf_{name}_s"], fig[f"hf_{name}_peak"] = h["seconds"], h["peak_rise_bytes"]
            if fig["ours_s"]:
                fig[f"speedup_vs_{name}"] = h["seconds"] / fig["ours_s"]
                fig[f"memory_ratio_vs_{name}"] = h["peak_rise_bytes"] / max(fig["ours_peak"], 1)
            if o.get("logits") and h.get("logits"):
                fig[f"max_logit_diff_vs_{name}"] = max(abs(a - b) for a, b in zip(o["logits"], h["logits"]))
        per_T[T] = fig
        rows.append([T, _s(fig.get("ours_s")), _s(fig.get("hf_eager_s")), _x(fig.get("speedup_vs_eager")),
                     mib(fig.get("ours_peak")), mib(fig.get("hf_eager_peak")), _x(fig.get("memory_ratio_vs_eager")),
                     _s(fig.get("hf_sdpa_s")), _x(fig.get("speedup_vs_sdpa")), mib(fig.get("hf_sdpa_peak")),
                     _x(fig.get("memory_ratio_vs_sdpa"))])
    model = f"checkpoint {args.model}" if args.model else "bench preset random init (seed 0)"
    print(f"prefill: {model}, batch 1, ours chunk {args.chunk} (attn_impl {args.attn_impl}), {args.device} "
          f"{'bf16' if args.device == 'cuda' else 'fp32'}, {env['torch_threads']} threads, one subprocess per case\n")
    print(markdown_table(["T", "ours s", "transformers eager s", "speedup", "ours peak MiB",
                          "transformers eager peak MiB", "memory ratio", "transformers sdpa s", "speedup vs sdpa",
                          "sdpa peak MiB", "memory ratio vs sdpa"], rows))
    sweep_rows = [[T, c, _s(v.get("seconds")), mib(v.get("peak_rise_bytes"))]
                  for (i, T, c), v in summary.items() if i == "ours" and (args.sweep or c != args.chunk)]
    if sweep_rows:
        print("\nours by chunk:\n")
        print(markdown_table(["T", "chunk", "ours s", "ours peak MiB"], sweep_rows))
    mem = "peak RSS rise (ru_maxrss after a clear_refs reset)" if args.device == "cpu" else "max_memory_allocated rise"
    print(f"\n- seconds: median of {args.repeats} fresh subprocesses per case, cases interleaved; memory: {mem} over "
          f"the state after loading + a {WARMUP_TOKENS}-token warm-up; load average at start "
          f"{env['load_average_start']}, end {env['load_average_end']}")
    for T, fig in per_T.items():
        diffs = {k: v for k, v in fig.items() if k.startswith("max_logit_diff")}
        if diffs:
            print(f"- T={T}: last-position logits, max |ours - transformers|: "
                  + ", ".join(f"{k.removeprefix('max_logit_diff_vs_')} {v:.2e}"
                              + (" (above 1e-3: top-k boundary ties, see BENCHMARKS.md)" if v > MAX_LOGIT_DIFF else "")
                              for k, v in diffs.items()))
    for v in summary.values():
        for err in v["errors"]:
            print(f"- {v['impl']} T={v['T']}: FAILED: {err[:300]}")
        if v.get("skipped"):
            print(f"- {v['impl']} T={v['T']}: skipped: {v['skipped']}")
        if v.get("peak_reset") is False:
            print(f"- {v['impl']} T={v['T']}: peak RSS could not be reset: its rise is a lower bound")
    g = per_T.get(GOALS["T"], {})
    sp, mr = g.get("speedup_vs_eager"), g.get("memory_ratio_vs_eager")
    for label, val, target in (("speedup", sp, GOALS["speedup"]), ("memory ratio", mr, GOALS["memory_ratio"])):
        state = "not measured" if val is None else f"{val:.2f}x ({verdict(val >= target)})"
        print(f"- goal prefill {label} vs transformers eager at T={GOALS['T']} >= {target:.0f}x: {state}")
    print()
    return {
        "benchmark": "prefill",
        "goals": {"T": GOALS["T"],
                  "speedup": {"target": GOALS["speedup"], "value": sp, "met": None if sp is None else sp >= GOALS["speedup"]},
                  "memory_ratio": {"target": GOALS["memory_ratio"], "value": mr,
                                   "met": None if mr is None else mr >= GOALS["memory_ratio"]}},
        "lengths": {str(T): fig for T, fig in per_T.items()},
        "cases": [{k: v for k, v in e.items() if k != "logits"} for e in summary.values()],
        "config": {"model": args.model or "bench", "model_config": cfg.to_dict(), "lengths": args.length_list,
                   "chunk": args.chunk, "chunk_sweep": args.sweep, "attn_impl": args.attn_impl,
                   "hf_attn": args.hf_list, "index_topk_override": args.index_topk, "repeats": args.repeats, "device": args.device,
                   "dtype": "bf16" if args.device == "cuda" else "fp32", "warmup_tokens": WARMUP_TOKENS,
                   "mem_limit_gib": args.mem_limit_gib, "seed": args.seed, "quick": args.quick},
        "env": env,
    }


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


if __name__ == "__main__":
    main()
