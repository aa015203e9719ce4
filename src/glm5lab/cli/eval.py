"""`glm5lab eval SUBCOMMAND`: score a model on a benchmark (a command group; each subcommand is one entry of
`SUBCOMMANDS`, name -> function adding its parser, and takes --threads).

- `glm5lab eval blimp RUN_OR_CHECKPOINT | --hf FOLDER`: BLiMP minimal pairs (`glm5lab.evals.blimp`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from glm5lab.threads import add_threads_flag


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="score a model on a benchmark (blimp)",
                       description="Score a glm5lab run (or any transformers causal LM) on a benchmark. "
                       "`glm5lab eval SUBCOMMAND -h` for its options.")
    evals = p.add_subparsers(dest="eval_command", required=True, metavar="SUBCOMMAND")
    for add in SUBCOMMANDS.values():
        add_threads_flag(add(evals))


def add_blimp_parser(evals) -> argparse.ArgumentParser:
    p = evals.add_parser(
        "blimp", help="BLiMP: 67 x 1,000 English minimal pairs, beside the published 5-gram/LSTM/TXL/GPT-2",
        description="Score BLiMP (Warstadt et al., TACL 2020; CC BY 4.0, a copy ships with glm5lab) by the paper's "
        "simple LM method: a pair is right when the whole good sentence has a higher total log-probability than "
        "the bad one (every token scored, the first given the start-of-text token: <|endoftext|> for glm5lab, the "
        "tokenizer's BOS else EOS for --hf; a tie is wrong). Prints accuracy per phenomenon (the paper's 12) and "
        "overall (mean over the 67 paradigms) with a 95% normal-approximation interval, the published models "
        "beside; writes blimp.json (blimp-limitN.json with --limit) into the folder given, or --out. fp32. The "
        "whole benchmark on the default run: about 14 minutes at one CPU thread on a shared 2-core machine "
        "(BENCHMARKS.md); --limit 50: about 30 s.")
    p.add_argument("model", nargs="?", metavar="RUN_OR_CHECKPOINT", help="a `glm5lab train` run folder (its latest "
                   "checkpoint), a checkpoint folder, or an HF GLM-5 folder")
    p.add_argument("--hf", metavar="FOLDER", help="instead: any transformers causal LM folder "
                   "(AutoModelForCausalLM + AutoTokenizer), e.g. a GPT-2 download, on the same code path")
    p.add_argument("--data", metavar="DIR", help="a folder with blimp.jsonl.gz and models_summary.jsonl (default: "
                   "the copy in the package)")
    p.add_argument("--limit", type=int, metavar="N", help="score only the first N pairs of each paradigm (a subset, "
                   "marked so in the output and written to blimp-limitN.json; default: all 1,000)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64, metavar="B",
                   help="sentences per forward, length-sorted and right-padded (default 64)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument("--out", metavar="FILE", help="the JSON file to write (default FOLDER/blimp.json)")
    p.add_argument("--no-progress", dest="no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_blimp)
    return p


SUBCOMMANDS = {"blimp": add_blimp_parser}


def cmd_blimp(args: argparse.Namespace) -> int:
    from glm5lab import validate
    from glm5lab.evals import blimp

    if (args.model is None) == (args.hf is None):
        raise ValueError("give exactly one model: RUN_OR_CHECKPOINT (a glm5lab run or checkpoint folder) or --hf "
                         f"FOLDER (a transformers one); got {'both' if args.model else 'neither'}")
    if args.model is not None:  # the folders first: a wrong one is the likelier mistake
        from glm5lab.checkpoints.export import resolve_checkpoint

        resolve_checkpoint(args.model, "RUN_OR_CHECKPOINT")
    else:
        from glm5lab.evals.causal_lm import check_hf_folder

        check_hf_folder(args.hf)
    data = blimp.DATA_DIR if args.data is None else blimp.check_data_dir(args.data)
    validate.int_at_least("--batch-size", args.batch_size, 1)
    pairs = blimp.load_pairs(data, args.limit)
    given = Path(args.hf or args.model)
    out = Path(args.out) if args.out else given / ("blimp.json" if args.limit is None else f"blimp-limit{args.limit}.json")
    if not os.access(out.parent if out.parent.is_dir() else given, os.W_OK):
        raise ValueError(f"{'--out ' + args.out if args.out else str(given)}: cannot write {out} there (read-only "
                         "or missing folder); give --out FILE in a writable folder")
    device = validate.torch_device(args.device, "--device")

    import torch

    from glm5lab.evals.causal_lm import glm5lab_lm, hf_lm

    lm = hf_lm(args.hf, device=device) if args.hf else glm5lab_lm(args.model, device=device)
    start, load = time.perf_counter(), os.getloadavg()[0]
    good, bad = blimp.score_pairs(lm, pairs, batch_size=args.batch_size, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    result = blimp.summarize(pairs, good, bad, blimp.load_published(data))
    result |= {"model": lm.name, "kind": "hf" if args.hf else "glm5lab", "prefix_token": lm.prefix_token,
               "subset": None if args.limit is None else f"first {args.limit} pairs of each paradigm",
               "data": str(data), "device": str(device), "threads": torch.get_num_threads(),
               "batch_size": args.batch_size, "seconds": seconds, "load_average_1min": load,
               "citation": blimp.CITATION}
    print(format_result(result))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out}", file=sys.stderr)
    return 0


def format_result(result: dict) -> str:
    """The table and the overall line as `glm5lab eval blimp` prints them."""
    o = result["overall"]
    subset = f" (SUBSET: {result['subset']}; not comparable with the published figures)" if result["subset"] else ""
    return (f"BLiMP{subset}: {result['model']}, {result['pairs']} pairs, each sentence scored after "
            f"{result['prefix_token']!r}\n\n" + blimp_table(result)
            + f"\noverall {100 * o['accuracy']:.1f}% (95% CI {100 * o['ci95'][0]:.1f}-{100 * o['ci95'][1]:.1f}, "
            f"normal approximation over pairs), {result['ties']} ties counted wrong; {result['seconds']:.0f} s on "
            f"{result['device']}, {result['threads']} thread(s), load average {result['load_average_1min']:.2f}")


def blimp_table(result: dict) -> str:
    from glm5lab.evals.blimp import render_table

    return render_table(result)
