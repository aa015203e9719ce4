"""Token folders stream (issue 27's goals): peak RSS of `glm5lab train --data DIR` on a 1 GB token folder
against a 10 MB one, and the rate the memmap loader delivers windows against the rate a training step
consumes them.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_streaming.py            # small, 3 steps, 1 thread
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_streaming.py --big-mb 50 --preset tiny   # a smoke run

Setup: two synthetic token folders in a temp dir, written with `glm5lab tokenize`'s writer and index
(`ShardWriter`, `finish_folder`): uniform random ids below the vocabulary of a byte-level BPE (its
tokenizer.json in the folder), `--small-mb` and `--big-mb` MB of uint16 training tokens, and the same
validation split (`--val-tokens`) in both, so the two runs differ only in the size of the training split.
Each run is a fresh subprocess (`--child`) that runs `glm5lab train --data DIR --preset P --steps 3` in
process (one step per stage, its final whole-split validation and unigram baseline included) and reports
`resource.getrusage(RUSAGE_SELF).ru_maxrss`. Goal: big - small < 200 MB.

Loader rate: `BatchStream(pack(tokens, seq_len), batch)` over the big folder's training split, batches of
`--batch-size` windows of `--seq-len` + 1 tokens at consecutive steps (random rows), timed warm (the shards
just written, in the page cache) and cold (each shard's pages evicted first with posix_fadvise DONTNEED,
so rows are read from disk); against the windows per second one training step of the child runs consumed
(batch / median step_time_s of its metrics.jsonl). Goal: >= 100x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, median, print_json_line  # noqa: E402

MB = 1 << 20
REFERENCE_STEP_S = 1.11  # BENCHMARKS.md, "The default training run": small's dense step, median, 2 threads, quiet


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset of the training runs (default small)")
    p.add_argument("--small-mb", type=float, default=10.0, help="training tokens of the small folder, MB (default 10)")
    p.add_argument("--big-mb", type=float, default=1024.0, help="training tokens of the big folder, MB (default 1024)")
    p.add_argument("--val-tokens", type=int, default=20_000, help="validation tokens of both folders (default 20000)")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step (default 8)")
    p.add_argument("--loader-batches", type=int, default=300, help="batches timed per loader case (default 300)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training runs (default 1)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_streaming.json"))
    p.add_argument("--child", nargs=2, metavar=("DIR", "RUN"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_folder(path: Path, tok, train_tokens: int, val_tokens: int, seed: int) -> dict:
    """A token folder of uniform random ids < the tokenizer's vocabulary, written as `glm5lab tokenize` writes."""
    from glm5lab.data.shards import dtype_for
    from glm5lab.data.tokenize import ShardWriter, finish_folder

    path.mkdir(parents=True)
    rng, vocab = np.random.default_rng(seed), tok.get_vocab_size()
    writers = {s: ShardWriter(path, s, dtype_for(vocab), 100_000_000) for s in ("train", "val")}
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        for lo in range(0, n, 1 << 24):
            writers[split].append(rng.integers(0, vocab, size=min(1 << 24, n - lo), dtype=np.uint16))
        writers[split].documents = 1
    return finish_folder(path, tok, writers, source="synthetic: uniform random ids", split=None)


def child(folder: str, run: str, args) -> None:
    """One training run in this process; prints {"maxrss_mb", "step_time_s", "wall_s"} as its last line."""
    from glm5lab.cli import main

    t0 = time.perf_counter()
    rc = main(["train", "--preset", args.preset, "--data", folder, "--steps", "3", "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--eval-every", "0", "--out", run, "--no-progress",
               "--threads", str(args.threads)])
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"rc": rc, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "step_times_s": [r["step_time_s"] for r in rows], "wall_s": wall}))


def run_child(folder: Path, run: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", str(folder), str(run), "--preset", args.preset, "--seq-len",
           str(args.seq_len), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loader_rate(folder: Path, args, cold: bool) -> float:
    """Windows per second of BatchStream over the folder's training split (batches at consecutive steps)."""
    from glm5lab.data.batches import BatchStream, pack
    from glm5lab.data.shards import open_token_folder

    tokens = open_token_folder(folder).train
    if cold:
        for file in tokens.files:
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    stream = BatchStream(pack(tokens, args.seq_len), args.batch_size, seed=1 if cold else 2)
    stream.batch(0)  # the epoch's permutation, drawn once per epoch
    t0 = time.perf_counter()
    for step in range(1, args.loader_batches + 1):
        stream.batch(step)
    return args.loader_batches * args.batch_size / (time.perf_counter() - t0)


def main() -> None:
    args = parse_args()
    if args.child:
        return child(*args.child, args)
    from glm5lab.environment import env_facts
    from glm5lab.data.corpus import Document, cache_root
    from glm5lab.data.tokenizer import cached_tokenizer
    from glm5lab.presets import PRESETS

    vocab = PRESETS[args.preset]()["vocab_size"]
    words = [f"w{i} " * (1 + i % 3) for i in range(4 * vocab)]
    docs = [Document(str(i), w) for i, w in enumerate(words)]
    tok = cached_tokenizer(lambda: iter(docs), vocab, cache_root() / "tokenizers")
    facts = env_facts("cpu")
    facts["load_average_start"] = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="glm5lab-data-streaming-") as tmp:
        tmp = Path(tmp)
        sizes = {"small": int(args.small_mb * MB / 2), "big": int(args.big_mb * MB / 2)}
        t0 = time.perf_counter()
        for i, (name, n) in enumerate(sizes.items()):
            write_folder(tmp / name, tok, n, args.val_tokens, seed=i)
        write_s = time.perf_counter() - t0
        runs = {name: run_child(tmp / name, tmp / f"run-{name}", args) for name in sizes}
        warm, cold = loader_rate(tmp / "big", args, cold=False), loader_rate(tmp / "big", args, cold=True)
    step_s = median([t for r in runs.values() for t in r["step_times_s"]])
    consumed = args.batch_size / step_s
    delta = runs["big"]["maxrss_mb"] - runs["small"]["maxrss_mb"]
    rows = [[name, f"{sizes[name] * 2 / MB:,.0f} MB ({sizes[name]:,} tokens)", f"{r['maxrss_mb']:.1f}",
             " / ".join(f"{t:.2f}" for t in r["step_times_s"]), f"{r['wall_s']:.1f}"] for name, r in runs.items()]
    print(f"Token folders, `glm5lab train --preset {args.preset} --steps 3 --seq-len {args.seq_len} --batch-size "
          f"{args.batch_size}`, {args.threads} torch thread(s); folders written in {write_s:.1f} s\n")
    print(markdown_table(["folder", "training split", "peak RSS MB", "step s (3 stages)", "wall s"], rows))
    print(f"\npeak RSS big - small: {delta:+.1f} MB (goal < 200 MB: {'met' if delta < 200 else 'MISSED'})")
    print(markdown_table(["loader", "windows/s", "x a step's consumption"],
                         [["BatchStream, warm page cache", f"{warm:,.0f}", f"{warm / consumed:,.0f}x"],
                          ["BatchStream, cold (pages evicted)", f"{cold:,.0f}", f"{cold / consumed:,.0f}x"],
                          [f"a {args.preset} step (median {step_s:.2f} s)", f"{consumed:.2f}", "1x"]]))
    reference = args.batch_size / REFERENCE_STEP_S
    ratio = min(warm, cold) / max(consumed, reference)
    print(f"\nloader / step consumption, the colder loader case against the faster of this run's step and "
          f"BENCHMARKS.md's {REFERENCE_STEP_S} s small step ({reference:.2f} windows/s): {ratio:,.0f}x "
          f"(goal >= 100x: {'met' if ratio >= 100 else 'MISSED'})")
    facts["load_average_end"] = list(os.getloadavg())
    record = {"benchmark": "data_streaming", "preset": args.preset, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "threads": args.threads, "sizes_tokens": sizes, "runs": runs,
              "rss_delta_mb": delta, "rss_goal_met": delta < 200, "loader_windows_per_s": {"warm": warm, "cold": cold},
              "step_windows_per_s": consumed, "reference_step_s": REFERENCE_STEP_S, "loader_ratio": ratio, "loader_goal_met": ratio >= 100, **facts}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print_json_line(record)


if __name__ == "__main__":
    main()
