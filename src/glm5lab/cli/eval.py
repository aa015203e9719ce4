"""`glm5lab eval SUBCOMMAND`: a trained model scored on data nobody here wrote, one subparser per subcommand
(`add_eval_parser` makes the group; each subcommand adds itself: `add_perplexity`).

`glm5lab eval perplexity RUN PATH`: the loss, perplexity and bits per byte of a run's model on any text
(`glm5lab.evals.perplexity.run_perplexity`), the numbers training's validation gives on the same text; written to
RUN/evals/perplexity.json, which `glm5lab report` shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_eval_parser(sub) -> None:
    """The `eval` command group and its subcommands."""
    p = sub.add_parser("eval", help="score a trained model on a held-out set or benchmark",
                       description="Score a trained model on data nobody here wrote; one subcommand per evaluation.")
    evals = p.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    add_perplexity(evals)


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
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N")
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
