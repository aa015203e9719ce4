"""Facts a measurement is recorded with: the source tree's git commit, the machine, the libraries.

One module for every writer of such facts: training runs (run.json), ablation results (results.json), the report,
and the benchmarks' JSON lines (`env_facts`). torch is imported only inside the functions that need it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "matplotlib")
_SOURCE = Path(__file__).resolve().parent  # inside the git checkout for an editable install


def environment() -> dict:
    """{python, platform, cpu, cpu_count, gpu, cuda, libraries: {name: version or None}}."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "gpu": gpu, "cuda": torch.version.cuda if gpu else None,
            "libraries": {name: _version(name) for name in LIBRARIES}}


def env_facts(device) -> dict:
    """What a reader needs to compare a benchmark figure with theirs: date, versions, CPU/GPU,
    threads, load at the start, git commit, device."""
    import torch

    facts = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_average(),
        "git_commit": git_commit(),
        "device": str(device),
        "transformers": _version("transformers"),
    }
    if torch.device(device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
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


def git_commit(repo: Path | None = None) -> str:
    """HEAD's hash of the git checkout holding `repo` (default: this package's source); when tracked files
    differ from it, "+uncommitted:" and the first 12 hex of the sha1 of `git diff HEAD`, so two runs on the
    same uncommitted tree can be matched. "unknown" outside a checkout or without git."""
    repo = _SOURCE if repo is None else Path(repo)
    try:
        commit, diff = _git(repo, "rev-parse", "HEAD"), _git(repo, "diff", "HEAD")
        tag = f"+uncommitted:{hashlib.sha1(diff.encode()).hexdigest()[:12]}" if diff else ""
        return (commit or "unknown") + tag
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], check=False, capture_output=True, text=True, cwd=repo,
                          timeout=10).stdout.strip()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
