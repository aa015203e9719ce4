"""From the run's arguments to token arrays: corpus, split, tokenizer, encoding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from glm5lab.config import ModelConfig
from glm5lab.train.corpus import cache_root, fetch_default_corpus, load_documents, split_documents
from glm5lab.train.tokenizer import cached_tokenizer, encode_documents, load_tokenizer


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    source: str


def prepare_data(args, cfg: ModelConfig, *, checkpoint: Path | None = None) -> TrainingData:
    """Documents from `args.data` (a text file, a folder, or JSONL with a `text` field; default:
    the Shakespeare corpus, fetched and cached), split by document (seeded), tokenized by
    `args.tokenizer` (a tokenizer.json or a checkpoint folder holding one), else by a byte-level BPE
    trained on the training split at `cfg.vocab_size` and cached beside the data. A run that
    continues from a `checkpoint` folder (resume, `--init`) uses the tokenizer.json saved there,
    so its weights keep the vocabulary they were trained with.
    Raises ValueError when the tokenizer's vocabulary does not fit `cfg.vocab_size`."""
    source = Path(args.data) if args.data else fetch_default_corpus()
    train_docs, val_docs = split_documents(load_documents(source), seed=args.seed)
    saved = checkpoint / "tokenizer.json" if checkpoint is not None else None
    if args.tokenizer:
        tokenizer = load_tokenizer(Path(args.tokenizer))
    elif saved is not None and saved.is_file():
        tokenizer = load_tokenizer(saved)
    else:
        tokenizer = cached_tokenizer((d.text for d in train_docs), cfg.vocab_size, cache_root() / "tokenizers")
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
                         f"{cfg.vocab_size}: use a model config with vocab_size >= the tokenizer's")
    return TrainingData(tokenizer, encode_documents(tokenizer, train_docs), encode_documents(tokenizer, val_docs),
                        str(source))
