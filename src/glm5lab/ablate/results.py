"""What a study leaves behind, and the helpers that format it.

A study returns a `StudyResult`; `write_result` puts it in its folder:
  table.md      the markdown table(s), the report's figures beside ours, and the notes
  results.json  study, quick, seeds, data (the --data corpus; null: the default), settings (model configs,
                sizes), raw numbers, notes, elapsed seconds (summed over runs), git commit and torch version
                (the newest run's), and "runs": one record per invocation that added seeds (`run_record`;
                `glm5lab ablate STUDY --seeds N` extends a folder: `runner.extend_study`)
  <study>.png   the study's plot
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from glm5lab.io_utils import atomic_write, atomic_write_text


@dataclass
class StudyResult:
    """study: its name. table: markdown (may hold several tables). raw: JSON numbers per variant and seed,
    keyed by strings (str(seed), str(length)) as results.json holds them, so `readme_row` reads them back
    as `run` built them. settings: JSON-able sizes and model configs. seeds: the seeds run. plot: writes the
    PNG to the path it is given (`save_png`). notes: one line each, in particular every place where our
    result is the opposite of the report's or inconclusive."""

    study: str
    table: str
    raw: dict
    settings: dict
    seeds: list[int]
    plot: Callable[[Path], None]
    notes: list[str] = field(default_factory=list)


def run_record(seeds: list[int], elapsed_s: float, settings: dict) -> dict:
    """One entry of results.json's "runs" history: the seeds one invocation ran, its wall seconds (rounded to
    0.1), git commit, torch version, UTC date, and the device and threads its settings name (where they do)."""
    import datetime

    import torch

    from glm5lab.environment import git_commit

    record = {"seeds": list(seeds), "elapsed_s": round(elapsed_s, 1), "git_commit": git_commit(),
              "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    return record | {k: settings[k] for k in ("device", "threads") if k in settings}


def short_commit(commit) -> str:
    """A `git_commit()` string shortened to 7 hex, '+dirty' when its tree had uncommitted changes ('?' if None)."""
    commit = str(commit or "?")
    return commit[:7] + ("+dirty" if "uncommitted" in commit or "dirty" in commit else "")


def seeds_header(result: StudyResult, runs: list[dict]) -> str:
    """table.md's seed line: the seeds, and which came from which commit when more than one run made them."""
    line = f"Seeds {result.seeds} (n = {len(result.seeds)})"
    if len(runs) > 1:
        line += f" from {len(runs)} runs: " + "; ".join(
            f"{r['seeds']} at commit {short_commit(r.get('git_commit'))}"
            + (f" ({r['date']})" if r.get("date") else "") for r in runs)
    return line + "."


def write_result(result: StudyResult, out: Path, *, quick: bool, elapsed_s: float | None = None,
                 runs: list[dict] | None = None, data: str | None = None) -> Path:
    """Write table.md, results.json and <study>.png into `out` (created); returns out/table.md. runs: the
    history (`run_record` per invocation, oldest first; their seeds make up result.seeds; default: one run of
    result.seeds that took elapsed_s, recorded now): results.json's
    "elapsed_s" is their sum, "git_commit" and "torch" the newest one's. data: the --data corpus as an absolute
    path (None: the default corpus). Each file is written to a temporary name and renamed (`io_utils`), so a
    reader never sees half a file."""
    if runs is None:
        if elapsed_s is None:
            raise ValueError("write_result: give elapsed_s (one run) or runs (the history)")
        runs = [run_record(result.seeds, elapsed_s, result.settings)]
    header = (f"# Ablation `{result.study}`{' (--quick)' if quick else ''}\n\n"
              f"{seeds_header(result, runs)} Per-arm cells: mean ± sd [95% t-interval] over "
              "the seeds; differences: mean [95% interval], paired by seed, with the verdict of "
              "`glm5lab.ablate.stats` (reproduced / opposite / inconclusive at n seeds).\n\n")
    notes = "".join(f"- {n}\n" for n in result.notes)
    atomic_write_text(out / "table.md", header + result.table.rstrip() + "\n" + (f"\nNotes:\n{notes}" if notes else ""))
    info = {"study": result.study, "quick": quick, "seeds": result.seeds, "data": data, "settings": result.settings,
            "raw": result.raw, "notes": result.notes,
            "elapsed_s": round(sum(float(r.get("elapsed_s") or 0) for r in runs), 1),
            "git_commit": runs[-1].get("git_commit"), "torch": runs[-1].get("torch"), "runs": runs}
    atomic_write_text(out / "results.json", json.dumps(info, indent=2) + "\n")
    atomic_write(out / f"{result.study}.png", lambda tmp: result.plot(Path(tmp)))  # `save_png` names the format
    return out / "table.md"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub markdown table; floats with 3 decimals (3 significant digits below 0.01), None as '-'."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            if not math.isfinite(v):
                return str(v)
            return f"{v:.3f}" if v == 0 or abs(v) >= 0.01 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def figure():
    """matplotlib.pyplot on the headless Agg backend: every PNG of the studies and of `glm5lab report`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path, dpi: int = 110, *, layout: bool = True, tight: bool = False):
    """Lay `fig` out (unless not `layout`), write it to `path` as PNG (whatever the name:
    `write_result` passes a temporary one; `tight`: cropped to its contents) and close it; returns `path`."""
    import matplotlib.pyplot as plt

    if layout:
        fig.tight_layout()
    fig.savefig(path, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    plt.close(fig)
    return path
