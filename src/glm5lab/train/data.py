"""From a corpus to token arrays: split, tokenizer, encoding (`glm5lab train` and the ablation studies' one
data path); and back from a trained checkpoint to its run's held-out text (`held_out_prompts`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from glm5lab.tokenizer import cached_tokenizer, encode_documents, load_tokenizer
from glm5lab.train.corpus import cache_root, fetch_default_corpus, load_documents, split_documents


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    source: str


def prepare_data(vocab_size: int, data: str | None, seed: int, *, tokenizer: str | None = None,
                 checkpoint: Path | None = None) -> TrainingData:
    """Documents from `data` (a text file, a folder, or JSONL with a `text` field; None: the Shakespeare
    corpus, fetched and cached), split by document with `seed` (`split_corpus`), tokenized by `tokenizer` (a
    tokenizer.json or a checkpoint folder holding one), else by a byte-level BPE trained on the training split
    at `vocab_size` and cached beside the data. A run that continues from a `checkpoint` folder (resume,
    `--init`) uses the tokenizer.json saved there, so its weights keep the vocabulary they were trained with.
    Raises ValueError when the tokenizer's vocabulary does not fit `vocab_size`."""
    source, train_docs, val_docs = split_corpus(data, seed)
    saved = checkpoint / "tokenizer.json" if checkpoint is not None else None
    if tokenizer:
        tok = load_tokenizer(Path(tokenizer))
    elif saved is not None and saved.is_file():
        tok = load_tokenizer(saved)
    else:
        tok = cached_tokenizer((d.text for d in train_docs), vocab_size, cache_root() / "tokenizers")
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is "
                         f"{vocab_size}: use a model config with vocab_size >= the tokenizer's")
    return TrainingData(tok, encode_documents(tok, train_docs), encode_documents(tok, val_docs), str(source))


def split_corpus(data, seed: int) -> tuple[Path, list, list]:
    """(source, train documents, validation documents): the corpus at `data` (None: the default
    corpus, fetched and cached) split by document with `seed` (`split_documents`). The one
    definition of a held-out split: training, its validation loss, `held_out_prompts` and the
    ablation studies (`glm5lab.ablate.workbench`, seed 0)."""
    source = Path(data) if data else fetch_default_corpus()
    train_docs, val_docs = split_documents(load_documents(source), seed=seed)
    return source, train_docs, val_docs


def run_json_of(folder) -> dict | None:
    """The run.json of the `glm5lab train` run a model folder belongs to: FOLDER/run.json (a run
    folder), else two levels up (RUN/checkpoints/step-N -> RUN/run.json); None when there is none."""
    folder = Path(folder)
    for place in (folder, folder.parent, folder.parent.parent):
        if (place / "run.json").is_file():
            return json.loads((place / "run.json").read_text())
    return None


def held_out_prompts(checkpoint, count: int, length: int, *, data=None,
                     split_seed: int | None = None) -> tuple[list[list[int]], dict]:
    """`count` prompts of `length` tokens of held-out text for a trained checkpoint: the validation split of
    its run (`split_corpus` with the corpus and seed of the run's run.json, `run_json_of`; `data` /
    `split_seed` override them; without a run.json, the default corpus and seed 0), encoded with the
    checkpoint's tokenizer.json, cut into non-overlapping windows of `length` tokens (`pack`), of which
    `count` are taken evenly spaced over the split (first and last included). Returns (prompts, info: corpus,
    split_seed, val_documents, val_tokens, windows, rows taken, run_json found). Raises ValueError when the
    checkpoint has no tokenizer.json or the split holds fewer than `count` windows."""
    import torch

    from glm5lab.train.batches import pack

    checkpoint = Path(checkpoint)
    run = run_json_of(checkpoint) or {}
    run_args = run.get("args", {})
    seed = split_seed if split_seed is not None else run_args.get("seed", 0)
    tok_path = checkpoint / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"{checkpoint} has no tokenizer.json: cannot encode held-out text for it")
    source, _, val_docs = split_corpus(data or run_args.get("data"), seed)
    val = encode_documents(load_tokenizer(tok_path), val_docs)
    windows = pack(val, length - 1)
    n = windows.shape[0]
    if n < count:
        raise ValueError(f"the validation split holds {n} windows of {length} tokens; fewer than the {count} "
                         "prompts asked for")
    rows = torch.linspace(0, n - 1, count).round().long()
    info = {"corpus": str(source), "split_seed": seed, "val_documents": len(val_docs), "val_tokens": len(val),
            "windows": n, "rows": rows.tolist(), "run_json": bool(run)}
    return [windows[r].tolist() for r in rows], info
