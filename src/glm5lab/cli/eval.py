"""`glm5lab eval SUBCOMMAND`: a trained model scored on data nobody here wrote, one subparser per subcommand
(`add_eval_parser` makes the group; each subcommand adds itself: `add_perplexity`, `add_blimp`).

`glm5lab eval perplexity RUN PATH`: the loss, perplexity and bits per byte of a run's model on any text
(`glm5lab.evals.perplexity.run_perplexity`), the numbers training's validation gives on the same text; written to
RUN/evals/perplexity.json, which `glm5lab report` shows.

`glm5lab eval blimp RUN_OR_CHECKPOINT | --hf FOLDER`: BLiMP minimal pairs by the paper's simple LM method
(`glm5lab.evals.blimp`) beside the published models; written to FOLDER/blimp.json, which `glm5lab report` shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def add_eval_parser(sub) -> None:
    """The `eval` command group and its subcommands."""
    p = sub.add_parser("eval", help="score a trained model on a held-out set or benchmark",
                       description="Score a trained model on data nobody here wrote; one subcommand per evaluation.")
    evals = p.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    add_perplexity(evals)
    add_blimp(evals)


def add_perplexity(evals) -> None:
    """`glm5lab eval perplexity RUN PATH [--seq-len T] [--batch-size B] [--device D] [--json]`."""
    p = evals.add_parser("perplexity", help="loss, perplexity and bits per byte of a run's model on any text",
                         description="Score PATH with the model of RUN exactly as training's validation scores its "
                         "held-out set (windows of the run's last stage's seq_len + 1 tokens, the tail that fills "
                         "none dropped, its batch size and DSA switch, fp32): a run trained with --val-data PATH "
                         "prints the same figures in its summary. Prints loss (nats/token), perplexity, bits per "
                         "byte and the tokens scored; writes RUN/evals/perplexity.json (`glm5lab report` shows it).")
    p.add_argument("run", metavar="RUN", help="a `glm5lab train` run folder (its latest checkpoint: the final model "
                   "of a finished run) or a checkpoint folder holding tokenizer.json")
    p.add_argument("data", metavar="PATH", help="a .txt/.md file, a .jsonl file (`text` field), a .parquet/.arrow "
                   "file (`text` column) or a folder of them, scored whole; or a token folder of `glm5lab tokenize` "
                   "written with the run's tokenizer (its validation split)")
    p.add_argument("--seq-len", dest="seq_len", type=int, metavar="T", help="tokens per window (default: the run's "
                   "last stage's seq_len; needed for a folder outside a run)")
    p.add_argument("--batch-size", dest="batch_size", type=int, metavar="B", help="windows per forward (default: "
                   "the run's last stage's batch_size; the figures change only by rounding)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N, or auto "
                   "(cuda when available, else cpu)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line, last")
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from glm5lab.evals.perplexity import PERPLEXITY_FILE, run_perplexity
    from glm5lab.io_utils import atomic_write_text
    from glm5lab.validate import torch_device

    device = torch_device(args.device, "--device")
    result = run_perplexity(args.run, args.data, seq_len=args.seq_len, batch_size=args.batch_size, device=device,
                            say=lambda m: print(f"glm5lab eval perplexity: {m}", file=sys.stderr, flush=True))
    print(format_perplexity(result))
    where = Path(result["run_dir"] or result["model"]) / "evals" / PERPLEXITY_FILE
    where.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(where, json.dumps(result, indent=2) + "\n")
    print(f"written: {where}")
    if args.json:
        print(json.dumps(result))
    return 0


def format_perplexity(r: dict) -> str:
    """The figures of `run_perplexity`'s dict as the lines `glm5lab eval perplexity` prints."""
    bpb = "bits per byte not recorded (the tokenizer is not byte-level)" if r["bits_per_byte"] is None else \
        f"{r['bits_per_byte']:.4f} bits/byte over {r['bytes']:,} UTF-8 bytes"
    return (f"{r['data']} ({r['val_set']['kind']}, {r['val_set']['documents']} documents) scored by {r['model']}\n"
            f"loss {r['loss']:.4f} nats/token, perplexity {r['perplexity']:.2f}, {bpb}\n"
            f"{r['tokens']:,} tokens scored: {r['windows']} windows of seq_len {r['seq_len']} + 1, batch "
            f"{r['batch_size']}, dsa={r['use_dsa']}")


def add_blimp(evals) -> None:
    """`glm5lab eval blimp (RUN_OR_CHECKPOINT | --hf FOLDER) [--data DIR] [--limit N] [--batch-size B] ..."""
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
    if out.is_dir():
        raise ValueError(f"--out {out} is not allowed: a JSON file path (it is a folder: give e.g. {out / 'blimp.json'})")
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
    from glm5lab.io_utils import atomic_write_text

    print(format_result(result))
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    print(f"written: {out}")
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
