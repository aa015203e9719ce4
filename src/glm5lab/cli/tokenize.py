"""`glm5lab tokenize DATA --out DIR`: a corpus to a token folder that `glm5lab train --data DIR` streams
(`glm5lab.data.tokenize`; the format in `glm5lab.data.shards`, docs/data.md)."""

from __future__ import annotations

import argparse
import sys


def cmd_tokenize(args: argparse.Namespace) -> int:
    from glm5lab.data.tokenize import tokenize_corpus

    index = tokenize_corpus(args.data, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                            text_field=args.text_field, shard_size=args.shard_size, seed=args.seed,
                            progress=not args.no_progress)
    splits = index["splits"]
    print(f"tokenize: {args.out}: " + "; ".join(
        f"{name} {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['shards'])} shard"
        f"{'s' * (len(s['shards']) != 1)}" for name, s in splits.items())
        + f" ({index['dtype']}, vocabulary {index['vocab_size']:,}); train with: glm5lab train --data {args.out}")
    sys.stdout.flush()
    return 0


def add_tokenize_parser(sub) -> None:
    from glm5lab.presets import PRESETS
    from glm5lab.data.tokenize import DEFAULT_SHARD_SIZE

    small_vocab = PRESETS["small"]()["vocab_size"]
    p = sub.add_parser("tokenize", help="tokenize a corpus into token shards for `glm5lab train --data DIR`",
                       description="Read a corpus as a stream, split it into training and validation by document "
                       "(as `glm5lab train --data` does, with --seed), encode it (a long document in pieces, so memory "
                       "does not follow the largest one) and write flat uint16 (uint32 for "
                       "vocabularies over 65536 ids) token shards per split, tokenizer.json and index.json (last) "
                       "into --out. `glm5lab train --data DIR` then reads windows through numpy memmap without "
                       "loading the corpus (docs/data.md).")
    p.add_argument("data", metavar="DATA", nargs="?", help="a .txt/.md file, a .jsonl file, a .parquet/.arrow file, or "
                   "a folder of such files (its other, empty and hidden files are named and skipped; parquet/arrow "
                   "need `pip install -e .[data]`; default: the Shakespeare corpus, fetched and cached)")
    p.add_argument("--out", metavar="DIR", required=True, help="the token folder to write (new or empty)")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json or a folder holding one (default: byte-level "
                   "BPE trained on the training split at --vocab-size, cached: the one `glm5lab train` trains). Long "
                   "documents are encoded in pieces with the whole document's tokens; a tokenizer whose pre-token "
                   "boundaries glm5lab does not know has its documents encoded whole, and is named (docs/data.md)")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=small_vocab, metavar="V",
                   help=f"vocabulary of the trained tokenizer (default {small_vocab}: the small preset's)")
    p.add_argument("--text-field", dest="text_field", default="text", metavar="NAME",
                   help="the JSONL field or parquet/arrow column holding the text (default text)")
    p.add_argument("--shard-size", dest="shard_size", type=int, default=DEFAULT_SHARD_SIZE, metavar="N",
                   help=f"tokens per shard (default {DEFAULT_SHARD_SIZE:,}); the last shard of a split is shorter")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split, as `glm5lab train --seed` "
                   "(default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tokenize)
