"""From a corpus to the token folder a run trains from (`glm5lab train` and the ablation studies' one data path:
a text corpus is tokenized once into the cache, `glm5lab.data.tokenize.cached_token_folder`); and back from a
trained checkpoint to its run's held-out text (`held_out_prompts`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from glm5lab.data.shards import ShardedTokens, is_token_folder, open_token_folder, tokenizer_sha256
from glm5lab.data.tokenize import cached_token_folder
from glm5lab.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from glm5lab.validate import refuse


@dataclass
class TrainingData:
    """A run's tokenizer and token streams, `ShardedTokens` read on demand from a token folder (`glm5lab tokenize`'s,
    or the cached one of a text corpus); `source` the corpus or folder given; `index` the folder's index.json; `val_set`
    what val_tokens are when they are not the folder's validation split (`glm5lab train --val-data`)."""

    tokenizer: Tokenizer
    train_tokens: ShardedTokens
    val_tokens: ShardedTokens
    source: str
    index: dict
    val_set: dict | None = None  # --val-data's record (`glm5lab.data.heldout`): val_tokens are that set's


def _stderr(message: str) -> None:
    print(f"glm5lab: {message}", file=sys.stderr, flush=True)


def prepare_data(vocab_size: int, data: str | None, seed: int, *, tokenizer: str | None = None,
                 checkpoint: Path | None = None, say: Callable[[str], None] = _stderr) -> TrainingData:
    """The token folder a run trains from. `data` a token folder (`glm5lab tokenize`): `token_folder_data`,
    whose split seed, when it is not `seed`, is said in one line through `say`. Else a text corpus
    `glm5lab.data.sources` reads (a text, JSONL, parquet or arrow file or a folder of them; None: the Shakespeare
    corpus, fetched and cached), split by document with `seed` and tokenized by `tokenizer` (a tokenizer.json or a
    folder holding one), else by a byte-level BPE trained on the training split at `vocab_size` and cached: its
    token folder in the cache (`cached_token_folder`: tokenized on first use, said in one line through `say`). A
    run that continues from a `checkpoint` folder (resume, `--init`) keeps the tokenizer.json saved there, so its
    weights keep the vocabulary they were trained with: a `tokenizer` that is another is refused
    (`given_tokenizer`, checked before any text is read). Raises ValueError when the tokenizer's vocabulary does
    not fit `vocab_size`, and as `token_folder_data` / `cached_token_folder`."""
    if data is not None and is_token_folder(data):
        return token_folder_data(vocab_size, data, tokenizer=tokenizer, checkpoint=checkpoint, seed=seed, say=say)
    folder = cached_token_folder(data, seed, tokenizer=given_tokenizer(vocab_size, tokenizer, checkpoint),
                                 vocab_size=vocab_size, say=say)
    tokens = token_folder_data(vocab_size, folder)
    return replace(tokens, source=tokens.index["source"])


def given_tokenizer(vocab_size: int, tokenizer: str | None, checkpoint: Path | None) -> Tokenizer | None:
    """The tokenizer a run on a text corpus is given rather than trains: `tokenizer` (a tokenizer.json or a folder
    holding one), else the tokenizer.json of the `checkpoint` it continues (--resume, --init), else None (the run
    trains its BPE on the text). Reads no text: `glm5lab.train.plan.check_run` calls it too, so a dry run refuses
    what the run refuses. Raises FileNotFoundError / ValueError as `load_tokenizer` (a missing or malformed
    `tokenizer`); ValueError when `tokenizer` is not the checkpoint's (`check_kept_tokenizer`) or its vocabulary
    does not fit `vocab_size`."""
    saved = _saved_tokenizer(checkpoint)
    if tokenizer:
        tok = load_tokenizer(Path(tokenizer))
        check_kept_tokenizer(checkpoint, tokenizer_sha256(tok), f"--tokenizer {tokenizer}",
                             "drop --tokenizer (the checkpoint's tokenizer.json is used)")
    elif saved is not None:
        tok = load_tokenizer(saved)
    else:
        return None
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is "
                         f"{vocab_size}: use a model config with vocab_size >= the tokenizer's")
    return tok


def check_kept_tokenizer(checkpoint: Path | None, sha256: str, other: str, fix: str) -> None:
    """The rule of a run that continues a checkpoint (--resume, --init), on a text corpus or a token folder: it
    keeps the tokenizer the checkpoint was trained with. Raises ValueError, one line naming both, when
    `checkpoint` holds a tokenizer.json whose `tokenizer_sha256` (of the canonical JSON: the same tokenizer however
    its file is formatted) is not `sha256`, that of `other` (e.g. "--tokenizer PATH", "the token folder DIR's");
    the line ends with `fix`. Nothing to check without a checkpoint or its tokenizer.json."""
    saved = _saved_tokenizer(checkpoint)
    if saved is None:
        return
    have = tokenizer_sha256(load_tokenizer(saved))
    if have != sha256:
        raise ValueError(f"checkpoint {checkpoint} was trained with another tokenizer (sha256 {have[:12]}) than "
                         f"{other} ({sha256[:12]}): resume with another tokenizer is not allowed; {fix}")


def _saved_tokenizer(checkpoint: Path | None) -> Path | None:
    saved = Path(checkpoint) / TOKENIZER_FILE if checkpoint is not None else None
    return saved if saved is not None and saved.is_file() else None


def token_folder_data(vocab_size: int, folder, *, tokenizer: str | None = None, checkpoint: Path | None = None,
                      seed: int | None = None, say: Callable[[str], None] = _stderr) -> TrainingData:
    """TrainingData of a token folder (`glm5lab.data.shards`): its train/val splits as `ShardedTokens` (read on
    demand, never loaded) and its tokenizer.json. The split and its seed are the folder's (fixed when it was
    tokenized); a run `seed` other than the folder's split seed is said in one line through `say`. Raises
    ValueError (one line each) for a bad folder (`open_token_folder`), a tokenizer.json that is missing or differs
    from the index's sha256, a `tokenizer` or a `checkpoint`'s tokenizer.json (resume, --init) other than the
    folder's, and a vocabulary that does not fit `vocab_size`."""
    folder = Path(folder)
    tokens = open_token_folder(folder)
    want = tokens.index["tokenizer_sha256"]
    if not tokens.tokenizer_file.is_file():
        raise ValueError(f"token folder {folder} has no {TOKENIZER_FILE}: tokenize the corpus again")
    tok = load_tokenizer(tokens.tokenizer_file)
    if tokenizer_sha256(tok) != want:
        raise ValueError(f"token folder {folder}: its {TOKENIZER_FILE} (sha256 {tokenizer_sha256(tok)[:12]}) is not "
                         f"the one its shards were written with (index.json: {want[:12]}): tokenize the corpus again")
    if tokenizer:
        given = tokenizer_sha256(load_tokenizer(Path(tokenizer)))
        if given != want:
            refuse("--tokenizer", tokenizer, f"token folder {folder} holds another tokenizer's shards (sha256 "
                   f"{want[:12]}, this one {given[:12]}): drop --tokenizer (the folder's tokenizer.json is used), "
                   "or tokenize the corpus with this tokenizer")
    saved = _saved_tokenizer(checkpoint)
    check_kept_tokenizer(checkpoint, want, f"the token folder {folder}'s",
                         f"tokenize the corpus with --tokenizer {saved}")
    split_seed = tokens.index.get("split", {}).get("seed")
    if seed is not None and split_seed is not None and split_seed != seed:
        say(f"token folder {folder} was split into training and validation with seed {split_seed} (glm5lab tokenize "
            f"--seed {split_seed}); --seed {seed} seeds the initialisation and the batch order only")
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"token folder {folder}: its tokenizer has {tok.get_vocab_size()} tokens but the model's "
                         f"vocab_size is {vocab_size}: use a model config with vocab_size >= the tokenizer's")
    return TrainingData(tok, tokens.train, tokens.val, str(folder), tokens.index)


def run_folder_of(folder) -> Path | None:
    """The folder of the `glm5lab train` run a model folder belongs to: FOLDER (a run folder, holding run.json), else
    up to two levels up (RUN/checkpoints/step-N -> RUN); None when there is no run.json."""
    folder = Path(folder)
    return next((place for place in (folder, folder.parent, folder.parent.parent) if (place / "run.json").is_file()),
                None)


def run_json_of(folder) -> dict | None:
    """The run.json of the `glm5lab train` run a model folder belongs to (`run_folder_of`); None when there is none."""
    place = run_folder_of(folder)
    return None if place is None else json.loads((place / "run.json").read_text())


def held_out_prompts(checkpoint, count: int, length: int, *, data=None,
                     split_seed: int | None = None) -> tuple[list[list[int]], dict]:
    """`count` prompts of `length` tokens of held-out text for a trained checkpoint: the validation split of
    its run (`prepare_data` with the corpus and seed of the run's run.json, `run_json_of`; `data` /
    `split_seed` override them; without a run.json, the default corpus and seed 0), encoded with the
    checkpoint's tokenizer.json (a text corpus: its cached token folder), cut into non-overlapping windows of
    `length` tokens (`pack`), of which `count` are taken evenly spaced over the split (first and last included).
    Returns (prompts, info: corpus, split_seed, val_documents, val_tokens, windows, rows taken, run_json found).
    Raises ValueError when the checkpoint has no tokenizer.json or the split holds fewer than `count` windows. A
    token folder as the corpus gives its own validation split and seed (refused when the checkpoint's tokenizer is
    another)."""
    import torch

    from glm5lab.data.batches import pack

    checkpoint = Path(checkpoint)
    run = run_json_of(checkpoint) or {}
    run_args = run.get("args", {})
    seed = split_seed if split_seed is not None else run_args.get("seed", 0)
    if not (checkpoint / TOKENIZER_FILE).is_file():
        raise ValueError(f"{checkpoint} has no tokenizer.json: cannot encode held-out text for it")
    data = prepare_data(1 << 62, data or run_args.get("data"), seed, checkpoint=checkpoint)
    windows = pack(data.val_tokens, length - 1)
    n = windows.shape[0]
    if n < count:
        raise ValueError(f"the validation split holds {n} windows of {length} tokens; fewer than the {count} "
                         "prompts asked for")
    rows = torch.linspace(0, n - 1, count).round().long()
    info = {"corpus": data.source, "split_seed": data.index["split"]["seed"],
            "val_documents": data.index["splits"]["val"]["documents"], "val_tokens": len(data.val_tokens),
            "windows": n, "rows": rows.tolist(), "run_json": bool(run)}
    return [windows[r].tolist() for r in rows], info
