"""`glm5lab ablate STUDY`: the report's ablations at CPU scale (library: `glm5lab.ablate`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from glm5lab.ablate.runner import SCALES, STUDIES

WRITE = ("README.md", "docs/ablations.md")


def cmd_ablate(args: argparse.Namespace) -> int:
    from glm5lab.ablate.runner import StudyArgs, run_study

    if args.study == "summary":
        from glm5lab.ablate.summary import write_summary

        given = [f for f, on in (("--quick", args.quick), ("--seeds", args.seeds is not None), ("--out", args.out),
                                 ("--scale", args.scale != "cpu"), ("--data", args.data)) if on]
        if given:
            raise ValueError(f"{', '.join(given)}: not used by `glm5lab ablate summary` (it reads --root and "
                             "writes --write); run the study itself with them")

        print(write_summary(args.root, args.write).rstrip())
        missing = [s for s in STUDIES if not (Path(args.root) / s / "results.json").is_file()]
        print(f"\nwritten: the ablations block of {', '.join(args.write)}"
              + (f"; no results under {args.root} (their rows, if the files had them, kept): {', '.join(missing)}"
                 if missing else ""))
        return 0
    if args.root != "runs/ablate" or args.write != list(WRITE):
        raise ValueError(f"--root / --write are for `glm5lab ablate summary`, not for the study {args.study!r}")
    study = StudyArgs(args.study, quick=args.quick, out=args.out, seeds=args.seeds, progress=not args.no_progress,
                      data=args.data, scale=args.scale)
    path, table = run_study(study)
    print(table.rstrip())
    print(f"\nwritten: {path.parent} (table.md, results.json, {args.study}.png)")
    return 0


def add_ablate_parser(sub) -> None:
    studies = "\n".join(f"  {name:<11} {study.what}" for name, study in STUDIES.items())
    p = sub.add_parser("ablate", help="re-run one of the report's ablations at CPU scale",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train and score small models for one of the report's comparisons; print a "
                       "markdown table with the report's figures beside ours and write table.md, results.json "
                       "(config, seeds, raw numbers) and a PNG into --out; --seeds N adds seeds to an --out that holds "
                       "fewer.\n\nstudies:\n" + studies
                       + "\n  summary     rebuild the one-table summary in README.md and docs/ablations.md from "
                       "--root/STUDY/results.json (a study without one there keeps its row)")
    p.add_argument("study", choices=[*STUDIES, "summary"], metavar="STUDY", help="one of: " + ", ".join(STUDIES)
                   + "; or summary")
    p.add_argument("--quick", action="store_true", help="the smoke size: under two minutes on 2 CPU cores "
                   "(numbers are not meaningful); default: the study size, 8-72 minutes (the README's table has "
                   "each time)")
    p.add_argument("--scale", choices=SCALES, default="cpu", help="cpu (default): CPU-sized models, the eight "
                   "default studies in about three hours on 2 cores; gpu: ~50-100M-parameter models at 2K-8K "
                   "tokens, for a GPU (hours; each study's docstring estimates them); with --quick, the gpu shapes "
                   "for a step or two (runs on a CPU)")
    p.add_argument("--out", metavar="DIR", help="results folder (default runs/ablate/STUDY[-gpu][-quick])")
    p.add_argument("--seeds", type=int, metavar="N", help="number of seeds 0..N-1, N at most 1000 (default: the "
                   "study's own: 3, 2 for baseline); into an --out holding this study's results with seeds 0..m-1 "
                   "(same size and --data) and N > m: runs only seeds m..N-1 and re-writes the table from all N "
                   "(docs/ablations.md)")
    p.add_argument("--data", metavar="PATH", help="text corpus: a .txt/.md file, a .jsonl file (`text` field), a "
                   ".parquet/.arrow file (`text` column), or a folder of such files (docs/data.md) (default: the "
                   "Shakespeare corpus, fetched and cached)")
    p.add_argument("--no-progress", action="store_true", help="no per-variant progress lines")
    p.add_argument("--root", metavar="DIR", default="runs/ablate", help="summary: the folder of study results "
                   "(default runs/ablate)")
    p.add_argument("--write", metavar="FILE", nargs="+", default=list(WRITE),
                   help="summary: files whose <!-- ablations:begin/end --> block is rewritten (default README.md "
                   "docs/ablations.md)")
    p.set_defaults(func=cmd_ablate)
