"""MTP speculative decoding vs plain decoding on the trained model: tokens/s and acceptance.

The model trained by `glm5lab train` (default `--model runs/small`: its `checkpoints/latest`),
with its MTP layer as the draft head, on held-out text: `--prompts` prompts of `--prompt-len`
tokens from the validation split of the training corpus (`glm5lab.data.pipeline.held_out_prompts`:
the run's `run.json` gives the corpus and split seed; the checkpoint's tokenizer.json encodes it;
windows evenly spaced over the split), `--new-tokens` greedy tokens each, batch 1, timed
interleaved:
- plain: `glm5lab.generate(model, prompt, N)`;
- speculative: `glm5lab.generate(..., speculative="mtp", draft_steps=k)` for k in --draft-steps
  (headline k = 3): the MTP layer drafts k tokens, one main forward verifies them;
each eager and with `compile=True` (--modes; `glm5lab.infer.compiled`: the decode, verification
and draft steps as compiled graphs, compiled in the warm-up call; compile seconds reported
apart). Speedups are against plain decoding in the same mode (the goal: compiled k = 3 vs
compiled plain).
tokens/s = new tokens / `stats.decode_seconds` summed over the prompts (decode only: the prefill
is the same cached prefill in both, reported apart). Greedy speculative output must equal plain
greedy output token for token (checked for every prompt and k; a mismatch fails the run on fp32 CPU, and is reported on bf16 CUDA).
Acceptance length = mean tokens per verification forward (accepted drafts + 1); acceptance rate
per draft position i = fraction of verifications whose draft i was accepted with every earlier one.
Also one sampled run (temperature 1.0, seeded, k = 3): acceptance only (sampled speculative
output is distributed as plain sampling, not equal to it).

The byte model (decoding is memory bound): a plain step reads the main model's activated weights
W(1); a round of k drafts reads the verification's W(k+1) (k+1 tokens pick more routed experts),
the MTP layer over k+1 pending pairs and k-1 chained drafts, each with the output head
(`common.weight_bytes_read`). Speculation can then be at most acceptance length x W(1) / round
bytes faster than plain decoding: the "byte bound" column, at the measured acceptance length.

Economics columns (on by default, `--no-economics` drops them): per case, a verification of k+1 tokens and a
whole round timed in units of one decode step (same mode, batch 1, one held-out row in a cache of the capacity the
compiled calls used), and the speedup the byte model (`glm5lab.infer.economics`: weights with the distinct routed
experts, cache reads, the MTP layer and its output head, a per-forward overhead) predicts at the case's measured
acceptance length, beside the measured speedup; bandwidth and overhead calibrated in this process first
(`speculative_map.calibrate_bandwidth`, `speculative_map.overheads`), never fitted to a speedup.

`--map`: the regime map instead (`speculative_map.py`, `speculative_map_report.py`): batch x context x dense/DSA
attention, compiled, k = 3, measured and predicted speedups, acceptance against context, GLM-5's predicted speedup.

    .venv/bin/python benchmarks/speculative.py                          # runs/small, 8 x 128 -> 128
    .venv/bin/python benchmarks/speculative.py --model /tmp/bench_quick_run --quick
    .venv/bin/python benchmarks/speculative.py --map --threads 1        # the regime map (see BENCHMARKS.md)
    .venv/bin/python benchmarks/speculative.py --map --quick --model /tmp/bench_quick_run

Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (counting_compile, load_ours, markdown_table, median, print_json_line, resolve_checkpoint,
                    setup_device, time_interleaved, verdict, weight_bytes_read)

import glm5lab
from glm5lab.environment import env_facts, load_average
from glm5lab.data.pipeline import held_out_prompts

GOALS = {"speedup": 1.6, "acceptance_length": 2.5, "draft_steps": 3}
"""Targets at 3 draft steps: speculative decode tokens/s >= 1.6x plain (compiled, both), acceptance
length >= 2.5."""
MODES = ("eager", "compiled")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="runs/small", help="run folder (latest checkpoint) or checkpoint folder")
    p.add_argument("--data", default=None, help="corpus (default: the run's, from run.json; else glm5lab's default)")
    p.add_argument("--split-seed", type=int, default=None, help="train/val split seed (default: the run's)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--draft-steps", default="1,2,3,4", help="k values to run (the goal is read at k=3)")
    p.add_argument("--modes", default="eager,compiled", help="eager and/or compiled (generate(compile=True))")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per case; the median is reported")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the temperature-1.0 run")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda runs bf16 weights")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes to validate the script (< 1 min)")
    p.add_argument("--economics", default=None, action=argparse.BooleanOptionalAction,
                   help="time a verification of k+1 tokens in decode steps and print the byte model's predicted "
                        "speedup beside the measured one (glm5lab.infer.economics; calibrated in this process by "
                        "the CPU's memory bandwidth: default on with --device cpu, off with cuda, where it is "
                        "refused)")
    p.add_argument("--map", action="store_true",
                   help="the regime map instead (speculative_map.py): batch x context x dense/DSA, compiled, measured "
                        "and predicted by the byte model (glm5lab.infer.economics)")
    p.add_argument("--batches", default="1,4,16", help="--map: batch sizes")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="--map: contexts (cache capacities) timed")
    p.add_argument("--compiled-contexts", default=None, help="--map: contexts of the compiled map (default --contexts)")
    p.add_argument("--compiled-batches", default=None, help="--map: batches of the compiled map (default --batches)")
    p.add_argument("--eager-map", action="store_true",
                   help="--map: also time every (--contexts x --batches) regime eagerly (no graphs to compile)")
    p.add_argument("--acceptance-contexts", default="512,2048,8192,32768",
                   help="--map: contexts where acceptance is measured (eager, 16 rows; no graphs to compile)")
    p.add_argument("--attention", default="dense,dsa", help="--map: dense (use_dsa=False) and/or dsa")
    p.add_argument("--from-json", default=None,
                   help="--map: print the report of saved measurements (comma-separated --save files or JSON lines of "
                        "--map runs, their attention kinds merged) instead of measuring")
    p.add_argument("--save", default=None, help="--map: also write the measurements (JSON) here after each attention kind")
    p.add_argument("--map-k", type=int, default=3, help="--map: drafts per round")
    p.add_argument("--rounds", type=int, default=12, help="--map: plain steps / rounds per timed run")
    p.add_argument("--check-generate", default=True, action=argparse.BooleanOptionalAction,
                   help="--map: confirm the map's formula against generate() at batch 1, context 512 (DSA)")
    p.add_argument("--strict", default=None, action=argparse.BooleanOptionalAction,
                   help="fail when greedy speculative output differs from plain (default: on for fp32 CPU; bf16 "
                        "CUDA only reports it: the verify forward of k+1 tokens and the 1-token step round "
                        "differently, which can flip a near-tie)")
    args = p.parse_args(argv)
    if args.strict is None:
        args.strict = args.device == "cpu"
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.draft_steps = 2, 32, 24, "1,3"
        args.repeats, args.warmup = 1, 1  # the compiled cases compile in the warm-up
        args.batches, args.contexts, args.acceptance_contexts, args.rounds = "1", "512", "512,1024", 4
        args.attention = "dsa" if args.attention == "dense,dsa" else args.attention  # compiling dominates: 6 graphs
    args.mode_list = [m for m in args.modes.split(",") if m]
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        p.error(f"--modes must be a comma-separated subset of {MODES}, got {args.modes!r}")
    args.k_list = [int(k) for k in args.draft_steps.split(",") if k]
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    args.context_list = [int(c) for c in args.contexts.split(",") if c]
    args.compiled_context_list = [int(c) for c in (args.compiled_contexts or args.contexts).split(",") if c]
    args.compiled_batch_list = [int(b) for b in (args.compiled_batches or args.batches).split(",") if b]
    args.acceptance_context_list = sorted({int(c) for c in args.acceptance_contexts.split(",") if c}
                                          | set(args.context_list) | set(args.compiled_context_list))
    args.attention_list = [a for a in args.attention.split(",") if a]
    if any(a not in ("dense", "dsa") for a in args.attention_list) or not args.attention_list:
        p.error(f"--attention must be a comma-separated subset of dense,dsa, got {args.attention!r}")
    if any(c % 256 or c < 512 for c in args.context_list + args.compiled_context_list):
        p.error(f"--contexts must be multiples of 256 (the compiled cache bucket), at least 512, got {args.contexts!r}")
    if args.map and args.device != "cpu":
        p.error("--map runs on CPU (fp32) only")
    args.margin = args.rounds * (args.map_k + 1) + args.map_k + 2  # room for the timed tokens
    if any(k < 1 for k in args.k_list):
        p.error("--draft-steps must be >= 1")
    if args.economics and args.device == "cuda":
        p.error("--economics runs on CPU only (its byte model is calibrated by the CPU's memory bandwidth)")
    args.economics = args.device == "cpu" if args.economics is None else args.economics
    return args


def make_case(model, prompts, n: int, k: int | None, *, temperature: float = 0.0, seed: int | None = None,
              compile: bool = False):
    """One call = every prompt at batch 1; returns the summed stats and the tokens."""
    def run():
        tokens, stats = [], []
        for i, p in enumerate(prompts):
            out = glm5lab.generate(model, [p], n, temperature=temperature, seed=None if seed is None else seed + i,
                                   speculative="mtp" if k else None, draft_steps=k or 3, compile=compile)
            tokens.append(out.tokens[0])
            stats.append(out.stats)
        return {"tokens": tokens, **combine(stats, k)}
    return run


def combine(stats, k: int | None) -> dict:
    new = sum(s.new_tokens for s in stats)
    dec = sum(s.decode_seconds for s in stats)  # compile time is apart (stats.compile_seconds)
    out = {"new_tokens": new, "decode_s": dec, "prefill_s": sum(s.prefill_seconds for s in stats),
           "tokens_per_s": new / dec if dec else 0.0, "compile_s": sum(s.compile_seconds for s in stats)}
    if k:
        steps = sum(s.verify_steps for s in stats)
        accepted = [sum(s.acceptance_rate[i] * s.verify_steps for s in stats) for i in range(k)]
        out.update(verify_steps=steps, acceptance_rate=[a / steps for a in accepted],
                   acceptance_length=1.0 + sum(accepted) / steps)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = setup_device(args)
    path = Path(args.model)
    if not path.exists():
        raise SystemExit(f"no trained model at {path}: run `.venv/bin/glm5lab train` first (it writes runs/small; "
                         f"`--quick --out DIR` makes a one-minute model), or pass --model DIR")
    checkpoint = resolve_checkpoint(path)
    env = env_facts(device)
    if args.map:
        from speculative_map_report import render_saved, run_map

        record = render_saved(args, checkpoint) if args.from_json else run_map(args, checkpoint, env)
        print_json_line(record)
        return record
    model = load_ours(checkpoint, device, mtp=True)
    prompts, data_info = held_out_prompts(checkpoint, args.prompts, args.prompt_len, data=args.data,
                                          split_seed=args.split_seed)
    n = args.new_tokens
    cases = {}
    for mode in args.mode_list:
        suffix, flag = ("", False) if mode == "eager" else (" compiled", True)
        cases[f"plain{suffix}"] = make_case(model, prompts, n, None, compile=flag)
        cases.update({f"k={k}{suffix}": make_case(model, prompts, n, k, compile=flag) for k in args.k_list})
    spent = []
    cases = {name: counting_compile(case, spent, key=lambda r: r["compile_s"]) for name, case in cases.items()}
    runs = time_interleaved(cases, device=device, warmup=args.warmup, repeats=args.repeats)
    env["compile_s"] = sum(spent)
    sampled = make_case(model, prompts, n, GOALS["draft_steps"], temperature=1.0, seed=args.sample_seed)()
    env["load_average_end"] = load_average()
    res, mismatches = summarise(runs)
    for name, r in res.items():
        if "acceptance_length" in r:
            k = int(name.split("=")[1].split()[0])
            r["round_weight_mib"] = round(round_bytes(model, k) / 2**20, 2)
            r["byte_bound_speedup"] = round(byte_bound(model, k, r["acceptance_length"]), 3)
    env["plain_step_weight_mib"] = round(weight_bytes_read(model, 1) / 2**20, 2)
    if args.economics:
        economics_columns(model, checkpoint, args, res, env)
    record = report(res, sampled, mismatches, args, model.config, checkpoint, data_info, env)
    print_json_line(record)
    if mismatches and args.strict:
        raise SystemExit(f"greedy speculative output differs from plain greedy: {mismatches[:5]}")
    return record


def economics_columns(model, checkpoint, args, res: dict, env: dict) -> None:
    """Per case, in its mode: a verification of k+1 tokens and a round timed in decode steps, and the byte
    model's predicted speedup at the case's measured acceptance length (`speculative_map`: one held-out row at
    batch 1, in a cache of the capacity the compiled `generate` calls used; bandwidth and per-forward overhead
    calibrated here first, `speculative_map.calibrate_bandwidth` / `overheads`)."""
    import speculative_map as sm

    from glm5lab.infer.compiled import CompiledSteps, capacity_for

    cap = capacity_for(args.prompt_len + args.new_tokens + max(args.k_list) + 1, model.config.max_position_embeddings)
    (ids,), _ = held_out_prompts(checkpoint, 1, cap, data=args.data, split_seed=args.split_seed)
    stream, n = sm.prefill_stream(model, ids), 8
    env["bandwidth_bytes_per_s"] = bw = sm.calibrate_bandwidth()
    env["economics_context"] = cap
    for mode in args.mode_list:
        compiled = CompiledSteps(model) if mode == "compiled" else None
        points = sm.overheads(model, bw, [1] + [k + 1 for k in args.k_list], compiled, steps=n, repeats=args.repeats)
        over = sm.interpolate(points)
        env[f"overhead_s_{mode}"] = points
        for name, r in res.items():
            if "acceptance_length" not in r or (name.endswith(" compiled") != (mode == "compiled")):
                continue
            k = int(name.split("=")[1].split()[0])
            st = sm.regime_state(model, stream, batch=1, context=cap, margin=n * (k + 1) + k + 2, k=k)
            t = sm.time_cases(model, st, k, n, args.repeats, compiled)
            p = sm.predict(model.config, batch=1, context=cap, k=k, acceptance_length=r["acceptance_length"],
                           bandwidth=bw, overhead=over)
            r.update(verify_in_steps=t["verify"] / t["plain"], round_in_steps=t["round"] / t["plain"],
                     predicted_speedup=p["speedup"], step_times_s=t)


def round_bytes(model, k: int) -> float:
    """Weight bytes of one speculative round of k drafts (see the module docstring)."""
    return (weight_bytes_read(model, k + 1) + weight_bytes_read(model, k + 1, part="mtp")
            + (k - 1) * weight_bytes_read(model, 1, part="mtp"))


def byte_bound(model, k: int, acceptance_length: float) -> float:
    """The speedup over plain decoding that reading the round's weights allows."""
    return acceptance_length * weight_bytes_read(model, 1) / round_bytes(model, k)


def summarise(runs):
    plain_tokens = runs[next(iter(runs))][0][1]["tokens"]
    res, mismatches = {}, []
    for name, samples in runs.items():
        last = samples[-1][1]
        tps = [r["tokens_per_s"] for _, r in samples]
        res[name] = {"tokens_per_s": median(tps), "tokens_per_s_repeats": [round(x, 1) for x in tps],
                     "decode_s_repeats": [round(r["decode_s"], 4) for _, r in samples],
                     "prefill_s_repeats": [round(r["prefill_s"], 4) for _, r in samples],
                     "new_tokens": last["new_tokens"]}
        for key in ("acceptance_length", "acceptance_rate", "verify_steps"):
            if key in last:
                res[name][key] = last[key]
        for _, r in samples:
            for i, (a, b) in enumerate(zip(r["tokens"], plain_tokens)):
                if a != b:
                    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    mismatches.append({"case": name, "prompt": i, "first_difference": first})
    for name, r in res.items():
        plain = "plain compiled" if name.endswith(" compiled") else "plain"
        r["speedup"] = r["tokens_per_s"] / res[plain]["tokens_per_s"] if plain in res else None
    return res, mismatches


def report(res, sampled, mismatches, args, cfg, checkpoint, data_info, env) -> dict:
    k_goal = GOALS["draft_steps"]
    rows = []
    for name, r in res.items():
        rate = r.get("acceptance_rate")
        rows.append([name.replace("plain", "plain (no drafts)"), f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup']:.2f}x" if r["speedup"] else "-", f"{r['acceptance_length']:.2f}" if rate else "-",
                     " / ".join(f"{x:.2f}" for x in rate) if rate else "-",
                     r.get("verify_steps", "-"),
                     f"{r['round_weight_mib']:.1f}" if rate else f"{env['plain_step_weight_mib']:.1f}",
                     f"{r['byte_bound_speedup']:.2f}x" if rate else "-",
                     f"{r['verify_in_steps']:.2f}" if "verify_in_steps" in r else "-",
                     f"{r['round_in_steps']:.2f}" if "round_in_steps" in r else "-",
                     f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"])
    print(f"speculative decoding: {checkpoint}, {args.prompts} held-out prompts x {args.prompt_len} tokens -> "
          f"{args.new_tokens} greedy tokens, batch 1, {args.device} {'bf16' if args.device == 'cuda' else 'fp32'}, "
          f"{env['torch_threads']} threads\n")
    print(markdown_table(["decoding", "tokens/s", "speedup", "acceptance length",
                          "acceptance rate per draft position", "verify steps", "weights read per round MiB",
                          "byte bound", "verify k+1 (decode steps)", "round (decode steps)", "predicted speedup"], rows))
    print(f"\n- tokens/s = new tokens / decode seconds (prefill and compilation excluded), summed over the prompts; "
          f"median of {args.repeats} repeats after {args.warmup} warm-up (the compiled cases compiled there: "
          f"{env['compile_s']:.1f} s in all), cases interleaved; speedup vs plain in the same mode; byte bound = "
          "acceptance length x plain step weights / round weights (module docstring); load average at start "
          f"{env['load_average_start']}, end {env['load_average_end']}\n"
          + (f"- verify / round in decode steps: timed at batch 1 on one held-out row in a {env.get('economics_context')}"
             f"-slot cache (speculative_map.py); predicted speedup: glm5lab.infer.economics at the measured acceptance, "
             f"bandwidth {env['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (1 GiB x.sum()), overhead per forward "
             + "; ".join(f"{m} " + ", ".join(f"n={n}: {o * 1e3:.3f} ms" for n, o in env[f'overhead_s_{m}'].items())
                         for m in args.mode_list)
             + " (a decode step of n rows at a 256-slot cache minus its bytes / bandwidth; an MTP forward pays "
               "as much, speculative_map.DRAFT_SHARE)\n" if args.economics else "")
          + f"- prompts: validation split of {data_info['corpus']} (split seed {data_info['split_seed']}, "
          f"{data_info['val_tokens']} tokens), windows {data_info['rows']} of {data_info['windows']}\n"
          f"- greedy speculative == plain greedy: "
          + ("yes, every prompt and k" if not mismatches else f"NO, {len(mismatches)} differences: {mismatches[:3]}")
          + f"\n- sampled (temperature 1.0, seed {args.sample_seed}, k={k_goal}): acceptance length "
          f"{sampled['acceptance_length']:.2f}, rate per position "
          + " / ".join(f"{x:.2f}" for x in sampled["acceptance_rate"]))
    g = res.get(f"k={k_goal} compiled") or res.get(f"k={k_goal}")
    met = {}
    if g:
        met = {"speedup": g["speedup"] >= GOALS["speedup"],
               "acceptance_length": g["acceptance_length"] >= GOALS["acceptance_length"]}
        print(f"- goal speculative speedup >= {GOALS['speedup']}x at k={k_goal} ({goal_mode(res, k_goal)}): "
              f"{g['speedup']:.2f}x "
              f"({verdict(met['speedup'])})\n- goal acceptance length >= {GOALS['acceptance_length']} at k={k_goal}: "
              f"{g['acceptance_length']:.2f} ({verdict(met['acceptance_length'])})\n")
    else:
        print(f"- goals at k={k_goal}: not measured (k={k_goal} not in --draft-steps)\n")
    return {
        "benchmark": "speculative",
        "goals": {"draft_steps": k_goal, "mode": goal_mode(res, k_goal),
                  "speedup": {"target": GOALS["speedup"], "value": g and round(g["speedup"], 3),
                              "met": met.get("speedup")},
                  "acceptance_length": {"target": GOALS["acceptance_length"],
                                        "value": g and round(g["acceptance_length"], 3),
                                        "met": met.get("acceptance_length")}},
        "cases": res,
        "greedy_equal": not mismatches, "mismatches": mismatches,
        "sampled": {"temperature": 1.0, "seed": args.sample_seed, "draft_steps": k_goal,
                    "acceptance_length": sampled["acceptance_length"], "acceptance_rate": sampled["acceptance_rate"],
                    "verify_steps": sampled["verify_steps"], "tokens_per_s": sampled["tokens_per_s"]},
        "data": data_info,
        "config": {"model": str(checkpoint), "model_config": cfg.to_dict(), "prompts": args.prompts,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "draft_steps": args.k_list,
                   "modes": args.mode_list,
                   "repeats": args.repeats, "warmup": args.warmup, "device": args.device,
                   "dtype": "bf16" if args.device == "cuda" else "fp32", "quick": args.quick},
        "env": env,
    }


def goal_mode(res: dict, k: int) -> str:
    """Which mode the goals are read in: compiled when it ran."""
    return "compiled" if f"k={k} compiled" in res else "eager"


if __name__ == "__main__":
    main()
