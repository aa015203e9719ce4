"""Cached prefill against the uncached forward (issue 39, item 3): dense MLA, one `bench` layer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cached_prefill.py --threads 1 --baseline /tmp/old   # 4K-32K
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cached_prefill.py --lengths 1024 --chunks auto --threads 1  # smoke

The model is `long_context.py --costs`'s dense MLA (`mixer_costs.make_models(["dense"])`: the bench preset's
widths, one layer, a 256-wide dense MLP, vocab 4096, seed 0, fp32 CPU). Per T (`--lengths`), interleaved:
- cached: `glm5lab.infer.prefill(model, ids, KVCache.for_model(model, 1, T + 1), chunk=c)` for each c in
  `--chunks` (the first, "auto", is what `generate` runs: `prefill_chunk_for(model)`, 4096 for this all-dense
  model since issue 39; the cache allocated inside the timed call);
- baseline: the call at `--baseline-chunk` (256: `generate`'s before issue 39) in a subprocess whose `glm5lab` is
  `--baseline`/src (a worktree of the code before the change), the same model (same seed) and ids;
- uncached: `model(ids, logits_to_keep=1)` (per-head K/V, causal SDPA): the goal's denominator.
Each figure: process CPU seconds (one thread: the time the call ran, which waiting for a core does not
inflate) and wall seconds. `--repeats` calls each, the minimum CPU time kept. The cached logits are checked
against the uncached ones (max |diff| printed). Goal: cached (the first chunk, generate's) <= 1.25 x uncached
(CPU seconds) at every T.
Prints a table, then one JSON line (`glm5lab.environment.env_facts`: threads, load average at the start, git
commit; the load average at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, print_json_line  # noqa: E402

GOAL = 1.25


def _model_and_ids(T: int):
    from mixer_costs import make_models

    model = make_models(["dense"], window=64, max_T=T, seed=0, device=torch.device("cpu"))["dense"]
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
    return model, ids


def _timed(fn, repeats: int) -> dict:
    """{"cpu": min process seconds, "wall": wall seconds of that call, "out": its result}."""
    best = None
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        if best is None or cpu < best["cpu"]:
            best = {"cpu": cpu, "wall": wall, "out": out}
    return best


def _chunk(arg: str):
    return arg if arg == "auto" else int(arg)


def _cached(model, ids, chunk):
    from glm5lab.infer import prefill
    from glm5lab.model.cache import KVCache

    return prefill(model, ids, KVCache.for_model(model, 1, ids.shape[1] + 1), chunk=chunk).logits_BV[0]


def worker(T: int, chunk: int, repeats: int) -> dict:
    """The cached prefill of T tokens in this process's `glm5lab` (the baseline's, under its PYTHONPATH)."""
    import glm5lab

    model, ids = _model_and_ids(T)
    with torch.no_grad():
        _cached(model, ids[:, :512], chunk)  # warm-up
        got = _timed(lambda: _cached(model, ids, chunk), repeats)
    return {"cpu": got["cpu"], "wall": got["wall"], "logits": got["out"].tolist(), "glm5lab": glm5lab.__file__}


def baseline(src: Path, T: int, chunk: int, repeats: int) -> dict:
    """`worker` in a subprocess importing glm5lab from `src` (one thread, as this process)."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--lengths", str(T), "--chunks", str(chunk), "--repeats", str(repeats)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    rec = json.loads(out.strip().splitlines()[-1])
    if not rec["glm5lab"].startswith(str(src)):
        raise RuntimeError(f"the baseline imported {rec['glm5lab']}, not from {src}")
    return rec


def point(args, T: int) -> dict:
    """Every figure at T: cached (this code), baseline (subprocess), uncached; ratios to uncached."""
    model, ids = _model_and_ids(T)
    with torch.no_grad():
        model(ids[:, :512], logits_to_keep=1)
        _cached(model, ids[:, :512], args.chunks[0])
        new = {c: _timed(lambda c=c: _cached(model, ids, c), args.repeats) for c in args.chunks}
        old = baseline(args.baseline / "src", T, args.baseline_chunk, args.repeats) if args.baseline else None
        ref = _timed(lambda: model(ids, logits_to_keep=1).logits[0, -1], args.repeats)
    rec = {"T": T, "uncached": {k: ref[k] for k in ("cpu", "wall")},
           "cached": {c: {"cpu": r["cpu"], "wall": r["wall"], "over_uncached": r["cpu"] / ref["cpu"],
                          "max_abs_diff": float((r["out"] - ref["out"]).abs().max())} for c, r in new.items()}}
    if old is not None:
        rec["baseline"] = {k: old[k] for k in ("cpu", "wall")}
        rec["baseline_max_abs_diff"] = float((torch.tensor(old["logits"]) - ref["out"]).abs().max())
        rec["baseline_over_uncached"] = old["cpu"] / ref["cpu"]
    print(f"T={T}: {json.dumps(rec)}", file=sys.stderr, flush=True)
    return rec


def _auto_chunk(T: int) -> int | None:
    """What chunk="auto" means for the model here (None: this glm5lab has no `prefill_chunk_for`)."""
    import glm5lab.infer

    pick = getattr(glm5lab.infer, "prefill_chunk_for", None)
    return None if pick is None else pick(_model_and_ids(T)[0])


def _row(p: dict, chunks: list) -> list:
    def f(r):
        return f"{r['cpu']:.2f} ({r['wall']:.2f})" if r else "-"

    base = p.get("baseline")
    row = [p["T"], f(p["uncached"]), f(base), f"{p['baseline_over_uncached']:.2f}" if base else "-"]
    for c in chunks:
        r = p["cached"][c]
        row += [f(r), f"{r['over_uncached']:.2f}", f"{r['max_abs_diff']:.1e}"]
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="context lengths T, comma-separated")
    p.add_argument("--chunks", default="auto,2048",
                   help="prefill chunks (integers or auto), comma-separated; the first is the goal's (auto: "
                   "generate's)")
    p.add_argument("--baseline-chunk", type=int, default=256, help="the baseline's chunk (generate's before issue 39)")
    p.add_argument("--repeats", type=int, default=1, help="calls per figure (the minimum CPU time kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 when anything else runs)")
    p.add_argument("--baseline", type=Path, default=None, help="a worktree of the code before the change")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    lengths, args.chunks = [int(t) for t in args.lengths.split(",")], [_chunk(c) for c in args.chunks.split(",")]
    if (min(lengths) < 513 or min(c for c in (*args.chunks, 1) if c != "auto") < 1 or args.baseline_chunk < 1
            or args.repeats < 1 or args.threads < 1):
        p.error(f"--lengths must be > 512, --chunks, --repeats and --threads >= 1, got {args.lengths}, "
                f"{args.chunks}, {args.repeats}, {args.threads}")
    torch.set_num_threads(args.threads)
    if args.worker:
        rec = worker(lengths[0], args.chunks[0], args.repeats)  # the baseline's call: --chunks <baseline-chunk>
        print_json_line(rec)
        return rec
    from glm5lab.environment import env_facts, load_average

    env = env_facts("cpu")
    points = [point(args, T) for T in lengths]
    env["load_average_end"] = load_average()
    print(f"\ncached prefill vs the uncached forward, dense MLA, one bench layer, fp32, {args.threads} thread(s); "
          f"CPU seconds (wall); the baseline at chunk {args.baseline_chunk}\n")
    auto = _auto_chunk(lengths[0])
    heads = [h for c in args.chunks for h in (f"cached, chunk {c}" + (f" ({auto})" if c == "auto" else ""),
                                              "/ uncached", "max |diff| logit")]
    print(markdown_table(["T", "uncached", "baseline cached", "/ uncached", *heads],
                         [_row(pt, args.chunks) for pt in points]))
    met = all(pt["cached"][args.chunks[0]]["over_uncached"] <= GOAL for pt in points)
    rec = {"benchmark": "cached_prefill", "env": env, "chunks": args.chunks, "baseline_chunk": args.baseline_chunk,
           "auto_chunk": auto, "repeats": args.repeats,
           "baseline": str(args.baseline) if args.baseline else None, "goal": GOAL, "goal_met": met, "points": points}
    print(f"\ngoal cached (chunk {args.chunks[0]}) <= {GOAL} x uncached at every T: {'met' if met else 'missed'}; "
          f"load average {env['load_average_start']} -> {env['load_average_end']}")
    print_json_line(rec)
    return rec


if __name__ == "__main__":
    main()
