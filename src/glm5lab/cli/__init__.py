"""The `glm5lab` command: one entry point, one subcommand per task, thin over the library.

    glm5lab ledger [--preset NAME | --config PATH] [--dtype bf16|fp16|fp32|fp8] [--context N] [--json]
    glm5lab train  [--preset NAME | --config FILE] [--data PATH] [--steps N] [--out DIR] [--resume]
                   [--optimizer adamw|muon|muon-split] [--quick] [--compile] ...
    glm5lab generate --model DIR (--prompt TEXT | --prompt-ids "ID ...") [--max-new-tokens N]
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop TEXT_OR_ID ...]
                   [--speculative mtp [--draft-steps N]] [--tokenizer FILE] [--device cpu|cuda]
                   [--dtype fp32|bf16] [--prefill-chunk N] [--compile] [--json]
    glm5lab ablate STUDY [--quick] [--scale cpu|gpu] [--out DIR] [--seeds N]   (mla, dsa, swa, efficient,
                   mtp, indexcache, baseline; `glm5lab ablate summary` rebuilds the README table)
    glm5lab report RUN_DIR [--out DIR] [--no-measure] [--quick]

Errors a user can cause (unknown preset, missing or malformed config.json, wrong model_type, a
bad --context or other number, a missing model folder, a prompt too long for the model) print one
line `glm5lab <command>: error: ...` to stderr and exit with status 2; argparse's own usage
errors also exit with 2. A RuntimeError (a run that diverged, a checkpoint whose weights do not
match its config) exits with 1; Ctrl-C during train or generate exits with 130.

ledger and train are defined here; generate, ablate and report in `glm5lab.cli.generate`,
`glm5lab.cli.ablate` and `glm5lab.cli.report`. Torch is imported by a command's body, not here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from glm5lab.cli.ablate import add_ablate_parser
from glm5lab.cli.generate import add_generate_parser
from glm5lab.cli.report import add_report_parser
from glm5lab.config import ConfigError, ModelConfig
from glm5lab.ledger import DTYPE_BYTES, ledger, render
from glm5lab.presets import PRESETS

USER_ERRORS = (ConfigError, OSError, ValueError)
DESCRIPTION = ("Work with GLM-5-family language models (MLA, DSA sparse attention, MoE, multi-token "
               "prediction): count their parameters, cache bytes and FLOPs, train one, generate "
               "text with one (plain or MTP-speculative decoding), re-run the report's ablations at "
               "CPU scale, or write a run's reproduction report. Run "
               "`glm5lab COMMAND -h` for a command's options.")


def load_config(preset: str | None, config: str | None) -> tuple[ModelConfig, str]:
    """(config, label) from a preset name or an HF config.json (file or checkpoint folder).

    Raises ConfigError (unknown preset, bad or foreign config.json), FileNotFoundError."""
    if config is None:
        name = preset or "glm5"
        return ModelConfig.from_preset(name), name
    return ModelConfig.from_hf(config), config


def cmd_ledger(args: argparse.Namespace) -> int:
    cfg, label = load_config(args.preset, args.config)
    d = ledger(cfg, dtype=args.dtype, context=args.context, name=label)
    print(render(d))
    if args.json:
        print(json.dumps(d))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from glm5lab.train.loop import TrainArgs, train

    fields = {k: v for k, v in vars(args).items() if k in TrainArgs.__dataclass_fields__ and v is not None}
    fields["progress"] = not args.no_progress
    if args.out is None:
        fields["out"] = f"runs/{args.preset or 'small'}" if not (args.config or args.init) else "runs/custom"
    try:
        summary = train(TrainArgs(**fields))
    except KeyboardInterrupt:
        from pathlib import Path

        if (Path(fields["out"]) / "checkpoints" / "latest").is_file():
            print(f"glm5lab train: interrupted; the latest checkpoint in {fields['out']} is kept: continue with "
                  "the same arguments plus --resume", file=sys.stderr)
        else:
            print(f"glm5lab train: interrupted before the first checkpoint; nothing to resume in {fields['out']}: "
                  "delete it and start again", file=sys.stderr)
        return 130
    print(format_summary(summary))
    return 0


def format_summary(summary: dict) -> str:
    lines = [f"run: {summary['run_dir']}  ({summary['steps']} steps)"]
    for st in summary["stages"]:
        change = "(resumed after this stage)" if st["first"] is None else f"{st['first']:.3f} -> {st['last']:.3f}"
        lines.append(f"  {st['stage']:<18} {st['steps']:>5} steps {st['tokens']:>10,} tokens  dsa={st['use_dsa']!s:<5} "
                     f"trains {st['trainable']:<7} {st['reported']:<10} {change}")
    bpb = summary.get("val_bits_per_byte")
    per_byte = "bits per byte not recorded" if bpb is None else f"{bpb:.3f} bits/byte"
    lines.append(f"validation loss {summary['val_loss']:.3f} nats/token (perplexity {summary['val_perplexity']:.1f}, "
                 f"{per_byte}); unigram baseline {summary['unigram_val_loss']:.3f}")
    return "\n".join(lines)


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (default: the small preset on the Shakespeare corpus)",
                       description="Train with Muon Split, the MTP loss and the DSA stages (dense, indexer "
                       "warm-up, sparse adaptation); writes metrics.jsonl, checkpoints (HF layout), loss.png "
                       "and summary.json into --out. Under torchrun the model is sharded with FSDP2.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=f"model preset: one of {', '.join(PRESETS)} (default small)")
    src.add_argument("--config", metavar="FILE", help="a model config.json (HF glm_moe_dsa layout)")
    src.add_argument("--init", metavar="DIR", help="start from this checkpoint folder's (or run folder's latest "
                     "checkpoint's) weights and config "
                     "(e.g. a dense run, then --stages indexer_warmup,sparse_adaptation)")
    p.add_argument("--data", metavar="PATH", help="a text file, a folder of .txt/.md/.jsonl files, or JSONL with a "
                   "`text` field (default: the Shakespeare corpus, fetched and cached)")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json or a folder holding one (default: "
                   "byte-level BPE trained on the training split at the model's vocab_size, cached)")
    p.add_argument("--out", metavar="DIR", help="run folder (default runs/PRESET, or runs/custom with --config/--init)")
    p.add_argument("--steps", type=int, metavar="N", help="total steps, split over the stages in the default "
                   "proportions (default 420; 17 with --quick)")
    p.add_argument("--stages", type=lambda s: s.split(","), metavar="A,B",
                   help="run only these default stages, in order: dense, indexer_warmup, sparse_adaptation")
    p.add_argument("--optimizer", choices=["adamw", "muon", "muon-split"], help="default muon-split")
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run of every stage (tests, CI)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--seed", type=int, help="seed for init, data split and batch order (default 0)")
    p.add_argument("--seq-len", dest="seq_len", type=int, metavar="T", help="training sequence length (default 256)")
    p.add_argument("--batch-size", dest="batch_size", type=int, metavar="B", help="sequences per step and process (default 8)")
    p.add_argument("--eval-every", dest="eval_every", type=int, metavar="N",
                   help="validation every N steps and at each stage end (default 50; 0 = none during training, the final evaluation still runs)")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, metavar="N",
                   help="checkpoint every N steps and at each stage end (default 100; 0 = at stage ends only); "
                   "the newest two are kept")
    p.add_argument("--bias-update-rate", dest="bias_update_rate", type=float, metavar="R",
                   help="aux-loss-free router bias step per update (default 1.5e-2, chosen for the default 420-step run: BENCHMARKS.md; 0 disables)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the training step's forward and backward (inductor); the first step of "
                   "each stage then includes compiling (minutes on a CPU with an empty cache); one process only "
                   "(refused under torchrun); default eager")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5lab", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_parser(sub)
    p = sub.add_parser("ledger", help="parameters, state bytes and FLOPs per token, from the config alone",
                       description="Parameters by component and counting convention, inference state "
                       "bytes and FLOPs per token, computed from the config alone (no model is built).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=f"a named config: one of {', '.join(PRESETS)} (default glm5)")
    src.add_argument("--config", metavar="PATH", help="an HF config.json, or a checkpoint folder holding one")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16",
                   help="element type of the cached state, for its bytes (default bf16)")
    p.add_argument("--context", type=int, metavar="N",
                   help="context length in tokens for state bytes and FLOPs (default: the model's "
                   "max_position_embeddings; larger values are refused)")
    p.add_argument("--json", action="store_true", help="also print the whole ledger as one JSON line, last")
    p.set_defaults(func=cmd_ledger)
    add_generate_parser(sub)
    add_ablate_parser(sub)
    add_report_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # commands that keep partial work say so themselves first
        print(f"glm5lab {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`glm5lab generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except USER_ERRORS as e:
        print(f"glm5lab {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a run that diverged, or a checkpoint that cannot be resumed
        print(f"glm5lab {args.command}: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: Exception, limit: int = 1500) -> str:
    """The message on one line, cut after `limit` characters (a checkpoint of another model lists
    every mismatching key; the API's exception keeps the whole list)."""
    message = " ".join(str(e).split())
    return message if len(message) <= limit else f"{message[:limit]} ... ({len(message) - limit} more characters)"
