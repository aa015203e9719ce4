"""The one-table summary of the latest study runs, generated from their `results.json`.

The README's "Ablations" table, the same table in docs/ablations.md and the summary at the top of
`glm5lab report`'s ablation section all come from `summary_table`, so they cannot drift from the
runs: each study module has `readme_row(info) -> {"paper", "ours", "verdict"}`, computed from the
parsed results.json alone (its raw per-seed numbers, re-judged by `glm5lab.ablate.stats`), never
by training. `glm5lab ablate summary` rewrites the marked block of each file:

    <!-- ablations:begin -->
    ...generated...
    <!-- ablations:end -->
"""

from __future__ import annotations

import json
from pathlib import Path

from glm5lab.ablate.results import markdown_table, short_commit
from glm5lab.ablate.runner import STUDIES, study_module
from glm5lab.io_utils import atomic_write_all

BEGIN, END = "<!-- ablations:begin -->", "<!-- ablations:end -->"


def load_results(root: str | Path = "runs/ablate") -> dict[str, dict]:
    """{study: parsed results.json} of root/<study>/results.json for every study in STUDIES that has one: the
    default-size runs (`--quick` and `--scale gpu` runs live in other folders and are refused here). Raises
    ValueError naming `root` when it is not a folder or holds no study results, and naming the file when one is
    not valid JSON, not a JSON object, or not a default-size (quick false, scale "cpu") run of its study."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--root {root}: {'not a folder' if root.exists() else 'no such folder'} "
                         "(the study results live in runs/ablate/STUDY/results.json)")
    out = {}
    for study in STUDIES:
        path = root / study / "results.json"
        if not path.is_file():
            continue
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(info, dict):
            raise ValueError(f"{path}: a JSON object with study, seeds, settings and raw expected, "
                             f"got {type(info).__name__}")
        scale = (info.get("settings") or {}).get("scale", "cpu")
        if info.get("study") != study or info.get("quick") or scale != "cpu":
            raise ValueError(f"{path}: holds study {info.get('study')!r} quick={info.get('quick')} "
                             f"scale={scale!r}, not the default-size {study!r} run")
        out[study] = {**info, "path": str(path)}
    if not out:
        raise ValueError(f"--root {root}: no STUDY/results.json for any of {', '.join(STUDIES)}: run "
                         "`glm5lab ablate STUDY` first")
    return out


def row(info: dict) -> dict:
    """The study's `readme_row(info)`: {"paper": str, "ours": str, "verdict": str}. Raises
    ValueError naming the file (info["path"], else the study) when its numbers do not have the
    shape the study writes (a results.json from another version, or edited by hand)."""
    module = study_module(info["study"])
    try:
        return module.readme_row(info)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        where = info.get("path", f"study {info['study']!r}")
        raise ValueError(f"{where}: cannot summarise it ({type(e).__name__}: {e}); re-run "
                         f"`glm5lab ablate {info['study']}`") from e


def summary_table(infos: dict[str, dict], kept: dict[str, list[str]] | None = None) -> str:
    """Markdown: one row per study (name with seed count and commit; the report's figures; ours;
    verdicts by the rule of `glm5lab.ablate.stats`), in STUDIES order; kept: {study: its cells} for studies
    without results in `infos`, whose rows stay as they were (`block_rows`). Raises ValueError when
    `infos` is empty or a study's results cannot be summarised (`row`)."""
    if not infos:
        raise ValueError("no study results: run `glm5lab ablate STUDY` first (runs/ablate/STUDY/results.json)")
    rows, kept = [], kept or {}
    for study in (s for s in STUDIES if s in infos or s in kept):
        if study not in infos:
            rows.append(kept[study])
            continue
        info, r = infos[study], row(infos[study])
        rows.append([f"`{study}` [{len(info.get('seeds') or [])}] ({_commit(info)}, {_minutes(info)})",
                     r["paper"], r["ours"], r["verdict"]])
    return markdown_table(["study [seeds] (commit, time)", "paper", "ours", "verdict (95% paired interval)"], rows)


def block_rows(text: str, *, where: str = "text") -> dict[str, list[str]]:
    """{study: the cells of its row} in the marked block of `text` (rows whose first cell names a study of
    STUDIES as `` `study` [n] (...) ``; others are dropped). Raises ValueError as `replace_block`, and naming the
    row when a study's row has other than the table's 4 cells (it would be lost)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where}: needs exactly one {BEGIN} ... {END} block")
    out = {}
    for line in text.split(BEGIN)[1].split(END)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        name = cells[0].split("`")[1] if cells[0].startswith("`") and cells[0].count("`") >= 2 else None
        if name in STUDIES:
            if len(cells) != 4:
                raise ValueError(f"{where}: the ablations row of {name!r} has {len(cells)} cells, not 4 (a '|' inside "
                                 f"a cell?): {line[:80]}")
            out[name] = cells
    return out


def _commit(info: dict) -> str:
    """Short commit, marked '+dirty' when the run's tree had uncommitted changes; for a folder whose seeds came
    from several runs (its "runs" history, `glm5lab ablate STUDY --seeds N` extending it), each distinct commit
    in run order, joined by ' / '."""
    runs = info.get("runs") if isinstance(info.get("runs"), list) else []
    commits = [r.get("git_commit") for r in runs if isinstance(r, dict)] or [info.get("git_commit")]
    return " / ".join(dict.fromkeys(short_commit(c) for c in commits))


def _minutes(info: dict) -> str:
    """results.json's elapsed_s in minutes: the sum over its runs when --seeds extended it."""
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
    """Rewrite the marked block of each file with `summary_table(load_results(root), kept)`; returns the (first
    file's) table. A study with no results under `root` keeps the row the file's block has for it (`block_rows`:
    re-run one study, the others' rows stay); a study in neither has no row. All or nothing (`io_utils.atomic_write_all`): every new text is checked and written to a temporary file beside
    its target first, and only then are they renamed over the targets (symlinks are followed; file modes,
    UTF-8 and line endings are kept). Raises ValueError as `load_results`, `summary_table` and `replace_block`
    do, and OSError when a temporary file cannot be written, before any target changes."""
    infos = load_results(root)
    targets = [Path(f).resolve() for f in files]
    texts, tables = {}, []
    for f, path in zip(files, targets, strict=True):
        raw = path.read_bytes().decode("utf-8")
        crlf = "\r\n" in raw
        plain = raw.replace("\r\n", "\n")
        tables.append(summary_table(infos, block_rows(plain, where=str(f))))
        text = replace_block(plain, tables[-1], where=str(f))
        texts[path] = (text.replace("\n", "\r\n") if crlf else text).encode("utf-8")
    atomic_write_all({path: lambda tmp, data=data: Path(tmp).write_bytes(data) for path, data in texts.items()})
    return tables[0] if tables else summary_table(infos)
