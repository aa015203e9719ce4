"""`glm5lab report RUN_A --compare RUN_B [RUN_C ...]`: the report's "Comparison" section, one
table with a row per run (RUN_A first) and the overlaid curves (`plots.compare`).

Columns: the whole-split validation loss, perplexity and bits per byte (summary.json), the last validation-subset
loss, steps, tokens, training wall time (the sum of metrics.jsonl's step_time_s: validation and checkpoints
excluded), preset (or config), optimizer and seed, then every other run.json argument (and the resolved stage
plan, and the git commit) whose value is not the same in all runs. Runs whose held-out splits differ (another
corpus, tokenizer, vocabulary size, seed (it draws the document split and the BPE's training text) or --val-data)
score different text or tokens:
the section says so above the table.
"""

from __future__ import annotations

import json

from glm5lab.ablate.results import markdown_table
from glm5lab.report.series import fmt_duration, wall_time_s

ALWAYS = ("preset", "optimizer", "seed")
IGNORED = {"out", "progress", "resume", "config", "preset", "optimizer", "seed"}  # shown, or not a setting
SPLIT = ("data", "tokenizer", "seed", "val_data")  # decide the held-out text (and, with the first two, its tokens)


def label(rec) -> str:
    return str(rec.run_dir)


def differing(runs: list) -> dict[str, list]:
    """{name: value per run} of run.json arguments (named as their flags, e.g. "--steps", so they do not clash
    with the table's own columns), plus "stages" (the resolved plan in short), "git" (the training commit) and
    "torch threads" (run.json), that are not equal in every run; ALWAYS and IGNORED left out."""
    args = [r.run.get("args", {}) for r in runs]
    out = {}
    for key in sorted(set().union(*args) - IGNORED):
        values = [a.get(key) for a in args]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            out[f"--{key.replace('_', '-')}"] = values
    extra = {"stages": [_plan(r.run.get("stages", [])) for r in runs],
             "git": [str(r.run.get("git_commit", "?"))[:12] for r in runs],
             "torch threads": [r.run.get("torch_threads") for r in runs]}
    out.update({k: v for k, v in extra.items() if len(set(v)) > 1})
    return out


def _plan(stages: list[dict]) -> str:
    return ", ".join(f"{st.get('name')} {st.get('steps')}" for st in stages) or "-"


def _setting(rec, key: str):
    args = rec.run.get("args", {})
    return (args.get("config") or args.get("preset")) if key == "preset" else args.get(key)


def _fixed(v, digits: int):
    return None if v is None else f"{v:.{digits}f}"


def _cell(v):
    return json.dumps(v) if isinstance(v, (list, dict)) else v


def table(runs: list) -> str:
    """The markdown table, one row per run (runs[0]: the report's run)."""
    diff = differing(runs)
    base = runs[0].summary.get("val_loss")
    rows = []
    for i, r in enumerate(runs):
        s = r.summary
        tokens = sum(st.get("tokens", 0) for st in s.get("stages", []))
        delta = None if i == 0 or base is None or s.get("val_loss") is None else s["val_loss"] - base
        rows.append([f"`{label(r)}`" + (" (this report)" if i == 0 else ""), _fixed(s.get("val_loss"), 3), delta,
                     _fixed(s.get("val_perplexity"), 1), s.get("val_bits_per_byte"), s.get("val_subset_loss"),
                     s.get("steps"), f"{tokens:,}", fmt_duration(wall_time_s(r.metrics))]
                    + [_setting(r, k) for k in ALWAYS] + [_cell(values[i]) for values in diff.values()])
    headers = (["run", "val loss (whole split)", "val loss - this run's", "perplexity", "bits per byte",
                "val loss (subset, last)", "steps", "tokens", "training wall time"] + list(ALWAYS) + list(diff))
    return markdown_table(headers, rows)


def section(rec, others: list, png: str | None) -> str:
    """The "## Comparison" markdown of `rec` against `others` (RunRecords); empty without others."""
    if not others:
        return ""
    runs = [rec, *others]
    split = {k: {json.dumps(r.run.get("args", {}).get(k)) for r in runs} for k in SPLIT}
    tokens = {r.summary.get("val_tokens") for r in runs} - {None}
    vocab = {r.config.get("vocab_size") for r in runs}
    differ = ([k for k, v in split.items() if len(v) > 1] + (["vocabulary size"] if len(vocab) > 1 else [])
              + (["held-out token count"] if len(tokens) > 1 else []))
    warning = (f"**The held-out splits differ** ({', '.join(differ)} not the same in every run): the validation "
               "losses score different text and are not directly comparable.\n\n" if differ else
               "Every run was validated on the same held-out split (same corpus, tokenizer, vocabulary size, seed "
               "and token count).\n\n")
    img = (f"\n![runs compared]({png})\n\nOne colour per run: train LM loss (trailing mean), validation-subset "
           "dots, the whole-split final figure as a diamond; dotted lines: the stage boundaries (named: of the "
           "longest run; in a run's colour where its stages end elsewhere).\n" if png else "")
    return ("## Comparison\n\n"
            f"This run against {', '.join(f'`{label(r)}`' for r in others)}. Validation loss: the final model on "
            "the whole held-out split (summary.json); subset: the last periodic validation; training wall time: "
            "the sum of step_time_s (validation and checkpoints excluded); after preset, optimizer and seed, the "
            "run.json arguments that differ.\n\n" + warning + table(runs) + img)
