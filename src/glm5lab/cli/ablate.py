"""`glm5lab ablate STUDY`: the report's ablations at CPU scale (library: `glm5lab.ablate`)."""

from __future__ import annotations

import argparse

from glm5lab.ablate.runner import STUDIES


def cmd_ablate(args: argparse.Namespace) -> int:
    from glm5lab.ablate.runner import StudyArgs, run_study

    study = StudyArgs(args.study, quick=args.quick, out=args.out, seeds=args.seeds, progress=not args.no_progress,
                      data=args.data)
    path, table = run_study(study)
    print(table.rstrip())
    print(f"\nwritten: {path.parent} (table.md, results.json, {args.study}.png)")
    return 0


def add_ablate_parser(sub) -> None:
    studies = "\n".join(f"  {name:<11} {what}" for name, what in STUDIES.items())
    p = sub.add_parser("ablate", help="re-run one of the report's ablations at CPU scale",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train and score small models for one of the report's comparisons; print a "
                       "markdown table with the report's figures beside ours and write table.md, results.json "
                       "(config, seeds, raw numbers) and a PNG into --out.\n\nstudies:\n" + studies)
    p.add_argument("study", choices=list(STUDIES), metavar="STUDY", help="one of: " + ", ".join(STUDIES))
    p.add_argument("--quick", action="store_true", help="the smoke size: under two minutes on 2 CPU cores "
                   "(numbers are not meaningful); default: the study size, under an hour")
    p.add_argument("--out", metavar="DIR", help="results folder (default runs/ablate/STUDY, or runs/ablate/STUDY-quick)")
    p.add_argument("--seeds", type=int, metavar="N", help="number of seeds 0..N-1 (default: the study's own, 3 for mla)")
    p.add_argument("--data", metavar="PATH", help="text corpus: a file, a folder of .txt/.md/.jsonl files, or JSONL "
                   "with a `text` field (default: the Shakespeare corpus, fetched and cached)")
    p.add_argument("--no-progress", action="store_true", help="no per-variant progress lines")
    p.set_defaults(func=cmd_ablate)
