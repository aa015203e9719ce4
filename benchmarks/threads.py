"""Thread policy before and after (issue 16): generate, train and a benchmark, on the machine as it
is and beside one busy process.

Every case runs as a child process, because libgomp reads its environment when torch is loaded:
- generate: `glm5lab generate --model M --prompt "ROMEO:" --max-new-tokens 64` (decode tokens/s
  from its statistics line);
- train: `glm5lab train --quick --steps S --out TMP --no-progress` (the small preset; wall seconds
  and the median step time from metrics.jsonl; a child that runs past --child-timeout is killed
  and reported as "> limit");
- speculative: `benchmarks/speculative.py --modes eager --draft-steps 3 --prompts 2 --new-tokens 32
  --repeats 1` (plain and k = 3 decode tokens/s from its JSON line).
Policies: before = torch's default, one thread per CPU with libgomp's ACTIVE wait (`--threads
CPUS`, the environment cleared of OMP_* / GOMP_*); after = `glm5lab.threads` (the CLI without
--threads; the benchmark script, which does not apply the policy itself, gets the thread count
`choose_threads` picks from a fresh `busy_cpus` sample). Busy: a `python -c "while True: pass"`
child started 1 s before the first busy case and killed after the last. Each row records the
1-minute load average and the busy CPUs sampled just before it.

Without a trained model at --model (runs/small), generate uses a random-init small model
(`--prompt-ids`) and speculative is skipped (it needs the run's corpus and tokenizer).

    .venv/bin/python benchmarks/threads.py              # quiet and busy: about 7 minutes on 2 cores
    .venv/bin/python benchmarks/threads.py --busy no    # the machine as it is only (about 2 minutes)

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, print_json_line, save_random_model

from glm5lab import ModelConfig
from glm5lab.threads import busy_cpus, choose_threads, usable_cpus

GLM5LAB = [sys.executable, "-m", "glm5lab"]
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "GLM5LAB_BUSY_CPUS")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--busy", choices=("no", "yes", "both"), default="both",
                   help="run beside one busy process: no, yes, or both (default: the machine as it is, then busy)")
    p.add_argument("--model", default="runs/small", help="run or checkpoint folder for generate and speculative")
    p.add_argument("--train-steps", type=int, default=6, help="steps of the train case (default 6, as in issue 16)")
    p.add_argument("--child-timeout", type=int, default=150, help="seconds before a case is killed (default 150)")
    p.add_argument("--cases", default="generate,train,speculative", help="comma-separated subset")
    args = p.parse_args(argv)
    if args.train_steps < 3:
        p.error("--train-steps must be >= 3 (glm5lab train --quick runs three stages)")
    return args


def run_child(cmd: list[str], threads: int | None, timeout: int) -> tuple[float, str, bool]:
    """(wall seconds, stdout + stderr, timed out) of `cmd` with the OMP_* environment cleared,
    plus `--threads N` when given. Raises SystemExit with the child's last line when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    cmd = cmd + ([] if threads is None else ["--threads", str(threads)])
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout or "", e.stderr or ""))
        return time.perf_counter() - t0, out, True
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip() or "(no output)").splitlines()[-1]
        raise SystemExit(f"{' '.join(cmd)}: exit status {r.returncode}: {last}")
    return time.perf_counter() - t0, r.stdout + r.stderr, False


def case_generate(model: Path, ids: bool, threads, timeout) -> dict:
    prompt = ["--prompt-ids", "1 2 3 4"] if ids else ["--prompt", "ROMEO:"]
    wall, out, late = run_child(GLM5LAB + ["generate", "--model", str(model), *prompt, "--max-new-tokens", "64"],
                                threads, timeout)
    m = re.search(r"decode ([\d.]+) tok/s", out)
    return {"wall_s": wall, "timed_out": late, "decode_tok_s": float(m.group(1)) if m else None,
            "notice": "other processes keep" in out}


def case_train(steps: int, threads, timeout) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        wall, out, late = run_child(GLM5LAB + ["train", "--quick", "--steps", str(steps), "--out", f"{tmp}/run",
                                               "--no-progress"], threads, timeout)
        path = Path(tmp, "run", "metrics.jsonl")
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    times = sorted(r["step_time_s"] for r in rows if "step_time_s" in r)
    return {"wall_s": wall, "timed_out": late, "steps_done": len(times),
            "median_step_s": times[len(times) // 2] if times else None, "notice": "other processes keep" in out}


def case_speculative(model: Path, threads, timeout) -> dict:
    wall, out, late = run_child([sys.executable, str(ROOT / "benchmarks/speculative.py"), "--model", str(model),
                                 "--modes", "eager", "--draft-steps", "3", "--prompts", "2", "--new-tokens", "32",
                                 "--repeats", "1"], threads, timeout)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    rec = json.loads(last) if last.startswith("{") else {}
    cases = rec.get("cases", {})
    return {"wall_s": wall, "timed_out": late, "plain_tok_s": cases.get("plain", {}).get("tokens_per_s"),
            "k3_tok_s": cases.get("k=3", {}).get("tokens_per_s")}


def summary(name: str, r: dict) -> str:
    late = " (killed)" if r["timed_out"] else ""
    if name == "generate":
        return f"{r['decode_tok_s']} tok/s decode; {r['wall_s']:.1f} s wall{late}"
    if name == "train":
        step = "-" if r["median_step_s"] is None else f"{r['median_step_s']:.2f}"
        return f"{'>' if late else ''}{r['wall_s']:.1f} s wall; {r['steps_done']} steps, median {step} s/step"
    plain, k3 = ("-" if x is None else f"{x:.1f}" for x in (r["plain_tok_s"], r["k3_tok_s"]))
    return f"plain {plain}, k=3 {k3} tok/s; {r['wall_s']:.1f} s wall{late}"


def main() -> None:
    args = parse_args()
    cpus, trained = usable_cpus(), (ROOT / args.model / "checkpoints").is_dir()
    cases = [c for c in args.cases.split(",") if c and (c != "speculative" or trained)]
    tmp = tempfile.TemporaryDirectory()
    model = ROOT / args.model if trained else save_random_model(ModelConfig.from_preset("small"), f"{tmp.name}/model")
    machines = {"no": ["as is"], "yes": ["busy"], "both": ["as is", "busy"]}[args.busy]
    rows, records, t_start = [], [], time.perf_counter()
    for machine in machines:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if machine == "busy" else None
        try:
            time.sleep(1.0 if hog else 0.0)
            for name in cases:
                for policy in ("before", "after"):
                    load, busy = os.getloadavg()[0], busy_cpus(cpus)
                    if policy == "before":
                        threads, shown = cpus, cpus
                    else:  # the CLI applies the policy itself; the benchmark script is given its choice
                        shown = choose_threads(requested=None, env={}, cpus=cpus, busy=busy)[0]
                        threads = shown if name == "speculative" else None
                    if name == "generate":
                        r = case_generate(model, not trained, threads, args.child_timeout)
                    elif name == "train":
                        r = case_train(args.train_steps, threads, args.child_timeout)
                    else:
                        r = case_speculative(model, threads, args.child_timeout)
                    rec = {"case": name, "machine": machine, "policy": policy, "threads": shown,
                           "load_1min": round(load, 2), "busy_cpus": None if busy is None else round(busy, 2), **r}
                    records.append(rec)
                    rows.append([name, machine, policy, shown, rec["load_1min"], rec["busy_cpus"], summary(name, r)])
                    print(f"  {name} {machine} {policy}: {summary(name, r)}", file=sys.stderr, flush=True)
        finally:
            if hog:
                hog.kill()
                hog.wait()
    tmp.cleanup()
    print(f"Thread policy, {cpus} usable CPUs; before = {cpus} threads, libgomp ACTIVE wait; after = glm5lab.threads"
          f"{'' if trained else '; random-init small model (no trained model at ' + args.model + ')'}\n")
    print(markdown_table(["case", "machine", "policy", "threads", "load 1-min", "busy CPUs", "result"], rows))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s\n")
    print_json_line({"benchmark": "threads", "cpus": cpus, "trained_model": trained, "cases": records})


if __name__ == "__main__":
    main()
