"""`glm5lab report RUN_DIR [--compare RUN ...]`: a training run as one markdown file with PNGs
(`glm5lab.report`), optionally beside other runs (a Comparison section)."""

from __future__ import annotations

import argparse


def cmd_report(args: argparse.Namespace) -> int:
    from glm5lab.report import write_report

    path = write_report(args.run_dir, out=args.out, measure=not args.no_measure, quick=args.quick,
                        compare=args.compare or ())
    print(f"report: {path}")
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="write a markdown report with plots for a training run",
                       description="Turn a `glm5lab train` run folder (and `glm5lab ablate` results in RUN_DIR/ablate/ "
                       "or beside it in ../ablate/, and RUN_DIR/evals/*.json) into RUN_DIR/report/report.md with PNGs: "
                       "loss per stage, validation perplexity, expert load over time, retrieval accuracy by context "
                       "length, MTP acceptance by draft position, expert kernels' share of a matmul's peak at the run's expert "
                       "shape, parameters under every counting convention, state "
                       "bytes per token, prefill/decode throughput with batch and length, library versions, "
                       "hardware, seeds. Measuring loads the latest checkpoint (about a minute for `small` on 2 CPU cores). "
                       "With --compare RUN_B [RUN_C ...], the report also holds a Comparison section: one table "
                       "(whole-split validation loss, perplexity, bits per byte, steps, tokens, training wall time, "
                       "preset, optimizer, seed and the other run.json arguments that differ) and the runs' loss "
                       "curves overlaid in compare.png; e.g. `glm5lab report runs/small --compare runs/adamw "
                       "--no-measure`.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder of `glm5lab train --out` (e.g. runs/small)")
    p.add_argument("--out", metavar="DIR", help="report folder (default RUN_DIR/report)")
    p.add_argument("--no-measure", action="store_true", help="skip loading the checkpoint and timing the "
                   "expert kernels (no throughput, retrieval, acceptance or expert-kernel figures)")
    p.add_argument("--compare", nargs="+", action="extend", metavar="RUN", help="other run folders to compare "
                   "this run with (a table and overlaid curves in a Comparison section); each must be a finished "
                   "`glm5lab train` run folder")
    p.add_argument("--quick", action="store_true", help="tiny measurement sizes (tests; numbers not meaningful)")
    p.set_defaults(func=cmd_report)
