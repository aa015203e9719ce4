"""The `glm5lab` command: one entry point, one subcommand per task, thin over the library.

    glm5lab ledger [--preset NAME | --config PATH] [--dtype bf16|fp16|fp32|fp8] [--context N] [--json]

Errors a user can cause (unknown preset, missing or malformed config.json, wrong model_type, a
bad --context) print one line `glm5lab <command>: error: ...` to stderr and exit with status 2;
argparse's own usage errors also exit with 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from glm5lab.config import ConfigError, ModelConfig
from glm5lab.ledger import DTYPE_BYTES, ledger, render
from glm5lab.presets import PRESETS

USER_ERRORS = (ConfigError, OSError, ValueError)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ledger", help="parameters, state bytes and FLOPs per token, from the config alone",
                       description="Parameters by component and counting convention, inference state "
                       "bytes and FLOPs per token, computed from the config alone (no model is built).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=f"a named config: one of {', '.join(PRESETS)} (default glm5)")
    src.add_argument("--config", metavar="PATH", help="an HF config.json, or a checkpoint folder holding one")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16",
                   help="element type of the cached state, for its bytes (default bf16)")
    p.add_argument("--context", type=int, metavar="N",
                   help="context length in tokens for state bytes and FLOPs (default max_position_embeddings)")
    p.add_argument("--json", action="store_true", help="also print the whole ledger as one JSON line, last")
    p.set_defaults(func=cmd_ledger)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        message = " ".join(str(e).split())
        print(f"glm5lab {args.command}: error: {message}", file=sys.stderr)
        return 2
