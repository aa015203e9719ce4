"""The one-table summary of the latest study runs, generated from their `results.json`.

The README's "Ablations" table, the same table in docs/ablations.md and the summary at the top of
`glm5lab report`'s ablation section all come from `summary_table`, so they cannot drift from the
runs: each study module has `readme_row(info) -> {"report", "ours", "verdict"}`, computed from the
parsed results.json alone (its raw per-seed numbers, re-judged by `glm5lab.ablate.stats`), never
by training. `glm5lab ablate summary` rewrites the marked block of each file:

    <!-- ablations:begin -->
    ...generated...
    <!-- ablations:end -->
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from glm5lab.ablate.results import markdown_table
from glm5lab.ablate.runner import STUDIES

BEGIN, END = "<!-- ablations:begin -->", "<!-- ablations:end -->"


def load_results(root: str | Path = "runs/ablate") -> dict[str, dict]:
    """{study: parsed results.json} of root/<study>/results.json for every study in STUDIES that has
    a folder (the default-size runs: `--quick` and `--scale gpu` runs live in other folders).
    Raises ValueError naming the file when one is not valid JSON or not a full-size run of its study."""
    out = {}
    for study in STUDIES:
        path = Path(root) / study / "results.json"
        if not path.is_file():
            continue
        try:
            info = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if info.get("study") != study or info.get("quick"):
            raise ValueError(f"{path}: holds study {info.get('study')!r} quick={info.get('quick')}, "
                             f"not the default-size {study!r} run")
        out[study] = info
    return out


def row(info: dict) -> dict:
    """The study's `readme_row(info)`: {"report": str, "ours": str, "verdict": str}."""
    module = importlib.import_module(f"glm5lab.ablate.study_{info['study']}")
    return module.readme_row(info)


def summary_table(infos: dict[str, dict]) -> str:
    """Markdown: one row per study (name with seed count and commit; the report's figures; ours;
    verdicts by the rule of `glm5lab.ablate.stats`), in STUDIES order. Raises ValueError when
    `infos` is empty."""
    if not infos:
        raise ValueError("no study results: run `glm5lab ablate STUDY` first (runs/ablate/STUDY/results.json)")
    rows = []
    for study in (s for s in STUDIES if s in infos):
        info, r = infos[study], row(infos[study])
        commit = str(info.get("git_commit") or "?")[:7]
        rows.append([f"`{study}` [{len(info['seeds'])}] ({commit}, {_minutes(info)})", r["report"], r["ours"],
                     r["verdict"]])
    return markdown_table(["study [seeds] (commit, time)", "report", "ours", "verdict (95% paired interval)"], rows)


def _minutes(info: dict) -> str:
    s = info.get("elapsed_s")
    return "?" if s is None else f"{float(s) / 60:.0f} min"


def replace_block(text: str, block: str, *, where: str = "text") -> str:
    """`text` with everything between the BEGIN and END markers replaced by `block`. Raises
    ValueError naming `where` when the markers are missing, repeated or out of order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where}: needs exactly one {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block.rstrip()}\n{END}{tail}"


def write_summary(root: str | Path = "runs/ablate", files=("README.md", "docs/ablations.md")) -> str:
    """Rewrite the marked block of each file with `summary_table(load_results(root))` (each file
    written to a temporary name and renamed); returns the table. Raises ValueError as
    `load_results`, `summary_table` and `replace_block` do, before any file is written."""
    table = summary_table(load_results(root))
    texts = {Path(f): replace_block(Path(f).read_text(), table, where=str(f)) for f in files}
    for path, text in texts.items():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return table


def int_keys(obj):
    """JSON turns int dict keys into strings: the same structure with digit-string keys as ints
    (for studies whose raw numbers are keyed by seed or length as ints)."""
    if isinstance(obj, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): int_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [int_keys(v) for v in obj]
    return obj
