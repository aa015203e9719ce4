"""`glm5lab report RUN_DIR`: a training run as one markdown file with PNGs (`glm5lab.report`)."""

from __future__ import annotations

import argparse


def cmd_report(args: argparse.Namespace) -> int:
    from glm5lab.report import write_report

    path = write_report(args.run_dir, out=args.out, measure=not args.no_measure, quick=args.quick)
    print(f"report: {path}")
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="write a markdown report with plots for a training run",
                       description="Turn a `glm5lab train` run folder (and `glm5lab ablate` results in RUN_DIR/ablate/ "
                       "or beside it in ../ablate/, and RUN_DIR/evals/*.json) into RUN_DIR/report/report.md with PNGs: "
                       "loss per stage, validation perplexity, expert load over time, retrieval accuracy by context "
                       "length, MTP acceptance by draft position, parameters under every counting convention, state "
                       "bytes per token, prefill/decode throughput with batch and length, library versions, "
                       "hardware, seeds. Measuring loads the latest checkpoint (about a minute for `small` on 2 CPU cores).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder of `glm5lab train --out` (e.g. runs/small)")
    p.add_argument("--out", metavar="DIR", help="report folder (default RUN_DIR/report)")
    p.add_argument("--no-measure", action="store_true", help="skip loading the checkpoint (no throughput, "
                   "retrieval or acceptance sections)")
    p.add_argument("--quick", action="store_true", help="tiny measurement sizes (tests; numbers not meaningful)")
    p.set_defaults(func=cmd_report)
