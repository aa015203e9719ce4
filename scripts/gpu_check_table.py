"""The one table at the end of `scripts/gpu_check.sh`, read from its output folder.

    python scripts/gpu_check_table.py OUTDIR [SMOKE]

OUTDIR holds, per step NAME (tests, train, experts, context, fp8, decode): NAME.log (its output, the
benchmark's JSON record as the last line starting with "{"), NAME.status ("ok", "FAILED (exit N)",
"TIMEOUT (N s)", or "not present" for a benchmark file that does not exist) and NAME.seconds. A step that did
not finish gives one row with its status; one that finished gives its figures, or "ok, output not read: ..."
where its record lacks a field (the expert-kernel row is read tolerantly: its record's fields are still
changing). SMOKE = 1 marks the table as the CPU smoke run's (tiny sizes, fp32: no figure to quote). Prints a
markdown table: step (seconds), check, result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = ("tests", "train", "experts", "context", "fp8", "decode")


def last_json(log: Path) -> dict | None:
    """The last line of `log` that parses as a JSON object, or None."""
    if not log.exists():
        return None
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def tests_rows(out: Path, rec) -> list[tuple[str, str]]:
    lines = [l for l in (out / "tests.log").read_text(errors="replace").splitlines() if l.strip()]
    return [("CUDA tests (`pytest -m cuda`: inference and training)", lines[-1].strip("= ") if lines else "no output")]


def train_rows(out: Path, rec) -> list[tuple[str, str]]:
    cfg, cases = rec["config"], rec["cases"]
    what = f"{cfg['preset']} {cfg['batch_size']} x {cfg['seq_len']}, {cfg['dtype']}"
    comp = cases["ours-compiled"]
    return [(f"train step tokens/s eager / compiled ({what})",
             f"{cases['ours']['tokens_per_s']:.0f} / {comp['tokens_per_s']:.0f} (compile {comp['compile_s']:.0f} s)"),
            (f"train step MFU eager / compiled (matmul peak {_flops(rec['matmul_peak_gflops'])}, "
             f"{cfg['mm_dtype']} {cfg['mm_size']}^3)", f"{rec['mfu']:.1%} / {rec['mfu_compiled']:.1%}"),
            ("train step Muon Split share of the eager step", f"{rec['muon_split_share']:.1%}")]


def _flops(gflops: float) -> str:
    return f"{gflops / 1e3:.1f} TFLOP/s" if gflops >= 1e3 else f"{gflops:.1f} GFLOP/s"


def experts_rows(out: Path, rec) -> list[tuple[str, str]]:
    """Tolerant: the best share of peak per kernel and direction when the record lists points with "kernel",
    "direction" and "share" (the JSON file, else the JSON line), and the half-peak text when given."""
    full = json.loads((out / "expert_kernels.json").read_text()) if (out / "expert_kernels.json").exists() else rec
    rows = []
    points = (full or {}).get("points") or []
    best: dict[str, float] = {}
    for p in points:
        if isinstance(p, dict) and "share" in p and p["share"] is not None:
            key = f"{p.get('kernel', '?')} {p.get('direction', '')}".strip()
            best[key] = max(best.get(key, 0.0), float(p["share"]))
    if best:
        rows.append(("expert kernels: best share of the matmul peak (--quick)",
                     ", ".join(f"{k} {v:.0%}" for k, v in best.items())))
    half = (full or {}).get("half_peak") or (rec or {}).get("half_peak")
    if isinstance(half, dict):
        for key, by_skew in half.items():
            rows.append((f"expert kernels: tokens per expert at half the peak ({key})", json.dumps(by_skew)))
    return rows or [("expert kernels", "ran (no points in the record: see experts.log)")]


def context_rows(out: Path, rec) -> list[tuple[str, str]]:
    rows = []
    order = [k for k in ("dense", "dsa", "dsa_indexcache") if k in rec["mixers"]]
    names = " / ".join(rec["mixers"][k]["label"] for k in order)
    fmt = lambda r, key, scale, spec: "-" if not r else format(r[key] * scale, spec)  # noqa: E731
    for p in rec["points"]:
        T = f"{p['T'] // 1024}K" if p["T"] >= 1024 else str(p["T"])
        ref = p.get("dense_reference")
        pre = " / ".join(fmt(p["prefill"][k], "per_layer_s", 1, ".3f") for k in order)
        rows.append((f"prefill {T} s per layer: {names} ({rec['dtype']}; uncached dense forward)",
                     f"{pre} ({fmt(ref, 's', 1, '.3f')})"))
        dec = " / ".join(fmt(p["decode"][k], "per_layer_s", 1e3, ".2f")
                         + ("" if p["decode"][k].get("cache") == "prefill" else " (z)") for k in order)
        rows.append((f"decode {T} ms per layer: {names}", dec))
    return rows


def fp8_rows(out: Path, rec) -> list[tuple[str, str]]:
    d = rec["decode"]
    rows = [(f"fp8 index keys: bytes per decode step fp32 / fp8 at {d['context']}",
             f"{d['bytes_ratio']:.2f}x fewer")]
    for mode in d["modes"]:
        a, b = d["ms"][f"step_{mode}_fp32"], d["ms"][f"step_{mode}_fp8"]
        rows.append((f"fp8 index keys: decode step ms at {d['context']}, {mode}, fp32 / fp8 keys",
                     f"{a:.2f} / {b:.2f} (fp8 / fp32 {b / a:.2f})"))
    return rows


def decode_rows(out: Path, rec) -> list[tuple[str, str]]:
    rows = []
    for T, r in rec["contexts"].items():
        ct = r.get("compiled_tokens") or {}
        same = "same tokens" if ct.get("equal") else f"tokens differ from new token {ct.get('first_difference')}"
        rows.append((f"decode ctx {T} tok/s eager / compiled / transformers",
                     f"{r['ours_tokens_per_s']:.0f} / {r['compiled_tokens_per_s']:.0f} / {r['hf_tokens_per_s']:.0f}"
                     f" (compile {r['compile_s']:.0f} s; {same})"))
    for B, r in rec["batched"].items():
        ct = r.get("compiled_tokens") or {}
        same = "same tokens" if ct.get("equal") else f"tokens differ from new token {ct.get('first_difference')}"
        rows.append((f"decode batch {B} tok/s eager / compiled",
                     f"{r['ours']['tokens_per_s']:.0f} / {r['compiled']['tokens_per_s']:.0f} ({same})"))
    return rows


def _test_outcomes(log: Path) -> str:
    """How many tests pytest -v reported PASSED / FAILED / SKIPPED / ERROR before it stopped (one line each)."""
    words = [w for line in log.read_text(errors="replace").splitlines() if line.startswith("tests/")
             for w in ("PASSED", "FAILED", "SKIPPED", "ERROR") if f" {w}" in line]
    return ", ".join(f"{words.count(w)} {w.lower()}" for w in ("PASSED", "FAILED", "SKIPPED", "ERROR"))


READERS = {"tests": tests_rows, "train": train_rows, "experts": experts_rows, "context": context_rows,
           "fp8": fp8_rows, "decode": decode_rows}
LABELS = {"tests": "CUDA tests", "train": "train step", "experts": "expert kernels", "context": "long context",
          "fp8": "fp8 index keys", "decode": "decode"}


def step_rows(out: Path, name: str) -> list[tuple[str, str]]:
    """The rows of step `name`: its status where it did not finish, else its figures."""
    status_file = out / f"{name}.status"
    status = status_file.read_text().strip() if status_file.exists() else "not run"
    if status != "ok":
        tail = f" (see {name}.log)" if (out / f"{name}.log").exists() else ""
        if name == "tests" and tail:
            tail += ": " + _test_outcomes(out / "tests.log")
        return [(LABELS[name], status + tail)]
    rec = last_json(out / f"{name}.log")
    if rec is None and name not in ("tests", "experts"):
        return [(LABELS[name], "FAILED (no JSON record in its output)")]
    try:
        return READERS[name](out, rec)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OSError) as e:
        return [(LABELS[name], f"ok, output not read: {type(e).__name__} {e}")]


def table(out: Path, smoke: bool = False) -> str:
    """The markdown table of every step in `out` (see the module docstring)."""
    lines = ["| step | check | result |", "|---|---|---|"]
    for i, name in enumerate(STEPS, start=1):
        sec = out / f"{name}.seconds"
        when = f" ({sec.read_text().strip()} s)" if sec.exists() else ""
        for j, (check, result) in enumerate(step_rows(out, name)):
            lines.append(f"| {f'{i}. {name}{when}' if j == 0 else ''} | {check} | {result} |")
    if smoke:
        lines.append("\nCPU smoke run (GPU_CHECK_CPU_SMOKE=1): tiny sizes, fp32, one thread: the wiring, no figure "
                     "to quote.")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not Path(argv[0]).is_dir():
        raise SystemExit(f"usage: gpu_check_table.py OUTDIR [SMOKE]: OUTDIR must be a folder, got {argv[:1]}")
    print(table(Path(argv[0]), smoke=len(argv) > 1 and argv[1] == "1"))


if __name__ == "__main__":
    main()
