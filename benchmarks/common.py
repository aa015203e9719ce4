"""Small helpers shared by the benchmarks: timing, matmul peak, environment facts, output.

Timing contract: wall-clock seconds from `time.perf_counter`, with the device synchronised
before and after (a no-op on CPU). Cases are timed interleaved (A, B, C, A, B, C, ...) after a
warm-up of each, so a burst of load from other processes on a shared machine hits every case
alike rather than one of them; figures are medians over the repeats.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def sync(device: torch.device | str) -> None:
    """Wait for queued device work (CUDA); nothing to do on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | str) -> tuple[float, object]:
    """(seconds, fn's result) of one call, the device synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t0, result


def time_interleaved(cases: dict[str, Callable[[], object]], *, device, warmup: int,
                     repeats: int) -> dict[str, list[tuple[float, object]]]:
    """Run each case `warmup` times untimed, then `repeats` timed rounds of every case in turn.

    Returns {name: [(seconds, result), ...]} with one entry per repeat, in order."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    out: dict[str, list[tuple[float, object]]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            out[name].append(timed(fn, device))
    return out


def median(xs) -> float:
    return float(statistics.median(xs))


def matmul_case(*, n: int, dtype: torch.dtype, device, calls: int = 4) -> tuple[Callable[[], None], float]:
    """(fn, FLOPs of one fn call): fn runs `calls` [n, n] @ [n, n] `torch.mm` (2 n^3 FLOPs each).

    Meant to be timed alongside the cases it is a ceiling for (`time_interleaved`), in the same
    process and thread count, so it sees the same load: an achieved peak, not a vendor figure."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def fn() -> None:
        for _ in range(calls):
            torch.mm(a, b, out=c)
    return fn, 2.0 * n**3 * calls


def cpu_model() -> str:
    """The 'model name' line of /proc/cpuinfo (else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none): other users' load."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], check=False, capture_output=True, text=True, cwd=repo,
                          timeout=10).stdout.strip()


def git_commit(repo: Path) -> str:
    """HEAD's hash; when tracked files differ from it, "+uncommitted:" and the first 12 hex of
    the sha1 of `git diff HEAD`, so two runs on the same uncommitted tree can be matched."""
    try:
        commit, diff = _git(repo, "rev-parse", "HEAD"), _git(repo, "diff", "HEAD")
        tag = f"+uncommitted:{hashlib.sha1(diff.encode()).hexdigest()[:12]}" if diff else ""
        return (commit or "unknown") + tag
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def env_facts(device) -> dict:
    """What a reader needs to compare a figure with theirs: versions, CPU/GPU, threads, load."""
    facts = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_average(),
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "device": str(device),
    }
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        facts["transformers"] = None
    if torch.device(device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_json_line(record: dict) -> None:
    """The benchmark's last line: one JSON object (STYLE.md: 'benchmarks print a JSON last line')."""
    print(json.dumps(record, separators=(",", ":")), flush=True)
