"""`glm5lab export CHECKPOINT --out DIR [--max-shard-size 5GB]`: a training checkpoint (a run folder's latest,
a step folder, an HF folder) as the HF safetensors folder transformers, vLLM and SGLang
read (`glm5lab.checkpoints.export`)."""

from __future__ import annotations

import argparse


def cmd_export(args: argparse.Namespace) -> int:
    from glm5lab.checkpoints.export import export_checkpoint, parse_size, resolve_checkpoint

    folder = resolve_checkpoint(args.checkpoint)
    out = export_checkpoint(folder, args.out, max_shard_bytes=parse_size(args.max_shard_size))
    print(f"export: {folder} -> {out}")
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as an HF safetensors folder (transformers, vLLM, "
                       "SGLang)", description="Write CHECKPOINT (a run folder: its latest checkpoint; or a step "
                       "folder) as an HF folder: config.json, tokenizer files and the weights as save_pretrained "
                       "writes them (model.safetensors, or model-0000i-of-0000n.safetensors shards and "
                       "model.safetensors.index.json), read one file's worth at a time (docs/checkpoints.md).")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a run folder (e.g. runs/small) or a checkpoint folder "
                   "(runs/small/checkpoints/step-000420)")
    p.add_argument("--out", metavar="DIR", required=True, help="the folder to write (new, empty, or an earlier export, "
                   "which is replaced whole)")
    p.add_argument("--max-shard-size", dest="max_shard_size", default="5GB", metavar="SIZE",
                   help="largest safetensors file, as transformers' max_shard_size: 5GB, 500MB, 2GiB or bytes "
                   "(default 5GB; a tensor larger than it gets a file of its own)")
    p.set_defaults(func=cmd_export)
