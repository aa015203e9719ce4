"""What a run folder holds, read and checked: run.json, config.json, summary.json, metrics.jsonl,
the latest checkpoint, and evaluation / ablation results beside it.

Ablation results are the `results.json` (+ `table.md`) folders of `glm5lab ablate`, looked for
in RUN_DIR/ablate/* and in the sibling runs/ablate/* (the default layout: runs/small next to
runs/ablate). Evaluation results are any RUN_DIR/evals/*.json a user wrote, and RUN_DIR/blimp.json
(`glm5lab eval blimp`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from glm5lab.report import blimp


class NotARunError(ValueError):
    """The folder is not a finished `glm5lab train` run; the message says what is missing."""


@dataclass
class RunRecord:
    """run_dir: the folder. run: run.json (args, stages, git commit, torch, world size, device). config: the
    HF config.json dict. summary: summary.json. metrics: one dict per step. checkpoint: the latest checkpoint
    folder. ablations: {study: results.json dict + "table"}. evals: {file stem: its JSON}. blimp: RUN_DIR/blimp.json
    (`glm5lab eval blimp`), None when absent."""

    run_dir: Path
    run: dict
    config: dict
    summary: dict
    metrics: list[dict]
    checkpoint: Path
    ablations: dict[str, dict] = field(default_factory=dict)
    evals: dict[str, dict] = field(default_factory=dict)
    blimp: dict | None = None


def load_run(run_dir: Path, name: str = "RUN_DIR") -> RunRecord:
    """Read the run folder. Raises NotARunError naming the missing or unreadable file (an
    unfinished or interrupted run has no summary.json: finish it with `glm5lab train --resume`), or
    saying that an older glm5lab wrote it (run.json without eval_tokens); ValueError (`resolve_checkpoint`) when its
    checkpoints/latest is missing or names an incomplete checkpoint (named `name`: RUN_DIR, or --compare)."""
    from glm5lab.checkpoints.export import resolve_checkpoint

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotARunError(f"{run_dir} is not a folder: give the run folder of `glm5lab train --out` (e.g. runs/small)")
    need = {"run.json": "is it a `glm5lab train` run folder?", "config.json": "is it a `glm5lab train` run folder?",
            "metrics.jsonl": "the run logged no step",
            "summary.json": "the run has not finished (interrupted?): continue it with `glm5lab train --resume "
                            "--out RUN_DIR` and the arguments it started with"}
    for file, why in need.items():
        if not (run_dir / file).is_file():
            raise NotARunError(f"{run_dir} has no {file}: {why}")
    run, config, summary = (_json((run_dir / n).read_bytes(), run_dir / n)
                            for n in ("run.json", "config.json", "summary.json"))
    if not isinstance(run, dict) or not isinstance(run.get("args"), dict):
        raise NotARunError(f"{run_dir}/run.json is not a `glm5lab train` run record (a JSON object with args)")
    if "eval_tokens" not in run["args"]:
        raise NotARunError(f"{run_dir}/run.json has no eval_tokens: an older glm5lab trained this run (its "
                           "validation subset was counted in batches), and this version does not read its folders; "
                           "train it again")
    metrics = [_json(line, f"{run_dir / 'metrics.jsonl'} line {i}")
               for i, line in enumerate((run_dir / "metrics.jsonl").read_bytes().splitlines(), 1) if line.strip()]
    return RunRecord(run_dir, run, config, summary, metrics, resolve_checkpoint(run_dir, name=name),
                     _ablations(run_dir), _evals(run_dir), blimp.load_record(run_dir))


def _json(data: bytes, where) -> dict:
    """`data` (a file's or a line's bytes) parsed; NotARunError naming `where` when it is not JSON."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotARunError(f"{where} is not valid JSON ({e})") from None


def _ablations(run_dir: Path) -> dict[str, dict]:
    found = {}
    for root in (run_dir / "ablate", run_dir.parent / "ablate"):
        for results, info in _json_files(root, "*/results.json"):
            key = info.get("study", results.parent.name) + (" (--quick)" if info.get("quick") else "")
            table = results.parent / "table.md"
            found.setdefault(key, {**info, "folder": str(results.parent),
                                   "table": table.read_text() if table.is_file() else ""})
    return found


def _evals(run_dir: Path) -> dict[str, dict]:
    return {path.stem: data for path, data in _json_files(run_dir / "evals", "*.json")}


def _json_files(folder: Path, pattern: str):
    """(path, parsed JSON) of each file matching `pattern` in `folder`, sorted by path; files that are not JSON are
    left out (nothing when the folder is absent)."""
    for path in sorted(folder.glob(pattern)):
        try:
            yield path, json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
