"""Byte-level BPE tokenizers (HF `tokenizers`): train, cache and load (`glm5lab.data.tokenize` encodes a corpus).

The trained tokenizer is GPT-2 style: ByteLevel pre-tokenizer (GPT-2 split regex, no prefix
space) and decoder, the 256 byte symbols always in the vocabulary (so any text round-trips), and
one special token `<|endoftext|>` (id 0) that separates documents. `load_tokenizer` also reads a
real GLM-5 checkpoint folder's `tokenizer.json` unchanged; its `<|endoftext|>` is used the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm5lab.io_utils import atomic_write

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB_SIZE = 257  # 256 byte symbols + EOT
BPE_RECIPE = 1  # bump when train_tokenizer's recipe changes, so old cache entries are not reused


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` and save it atomically.

    `path` is a folder (the file is `path/tokenizer.json`) or a path ending in `.json`. Deterministic: the
    same texts and vocab_size give byte-identical tokenizer.json files. The vocabulary has at most
    `vocab_size` entries (fewer when the texts run out of merges); read the real size with
    `tokenizer.get_vocab_size()`. Raises ValueError if vocab_size < 257 (256 bytes + `<|endoftext|>`).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size = {vocab_size} is too small: byte-level BPE needs at least "
                         f"{MIN_VOCAB_SIZE} (256 bytes + {EOT})")
    tokenizer = untrained_bpe()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    path = Path(path)
    atomic_write(path if path.suffix == ".json" else path / TOKENIZER_FILE, lambda tmp: tokenizer.save(tmp))
    return tokenizer


def untrained_bpe() -> Tokenizer:
    """glm5lab's byte-level BPE before training: an empty BPE with the ByteLevel pre-tokenizer (GPT-2 pattern) and
    decoder."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a `tokenizer.json` file, or the `tokenizer.json` inside a folder (e.g. a GLM-5 checkpoint folder).
    Raises FileNotFoundError naming the path looked at, ValueError when the file is not a `tokenizers` JSON."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {file}: expected a {TOKENIZER_FILE} file or a folder "
                                f"containing one")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{file} is not a tokenizers tokenizer.json: {e}") from None


def cached_tokenizer(train_docs: Callable[[], Iterable], vocab_size: int, cache_dir: Path) -> Tokenizer:
    """Load the tokenizer trained on the training documents at `vocab_size` from `cache_dir`, training and saving it
    first if absent. `train_docs()` returns a fresh iterator over the same documents each call (`Document`s or
    `glm5lab.data.sources.TextFile`s; only their `chunks()` are read, twice for the cache key, once more to train on
    a miss), so no text is held whole, and the trainer is fed `glm5lab.data.pieces` pieces of at most
    `PIECE_CHARS` characters: the whole texts' pre-tokens, so their counts and merges.

    The entry is `cache_dir/tokenizer-v<vocab_size>-<key>/tokenizer.json`, `key` a SHA-256 of the texts
    (length-prefixed, in order) and the recipe version (`BPE_RECIPE`), so other data or another vocab size never
    reuses a stale tokenizer. Errors as `train_tokenizer`."""
    from glm5lab.data.pieces import Cutter

    folder = Path(cache_dir) / f"tokenizer-v{vocab_size}-{_texts_key(d.chunks for d in train_docs())}"
    if (folder / TOKENIZER_FILE).is_file():
        return load_tokenizer(folder)
    cutter, _ = Cutter.of(untrained_bpe())
    return train_tokenizer((p for d in train_docs() for p in cutter.pieces(d.chunks())), vocab_size, folder)


def _texts_key(texts: Iterable[Callable[[], Iterable[str]]]) -> str:
    """SHA-256 (16 hex digits) of the recipe version and the texts in order, each length-prefixed (UTF-8 bytes); a
    text is a function returning its chunks (called twice: for the length, then the bytes)."""
    h = hashlib.sha256(f"glm5lab-bpe-{BPE_RECIPE}".encode())
    for text in texts:
        h.update(sum(len(c.encode("utf-8")) for c in text()).to_bytes(8, "little"))
        for c in text():
            h.update(c.encode("utf-8"))
    return h.hexdigest()[:16]


def eot_id(tokenizer: Tokenizer) -> int:
    """Id of `<|endoftext|>`. Raises ValueError if the tokenizer has no such token."""
    token_id = tokenizer.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOT} token, needed as the document separator")
    return token_id


def save_for_transformers(tokenizer: Tokenizer, folder: Path) -> None:
    """Write `tokenizer.json` plus what transformers' `AutoTokenizer` and serving stacks (vLLM,
    SGLang) read to know the end of text: `tokenizer_config.json` (PreTrainedTokenizerFast, eos
    `<|endoftext|>`) and `generation_config.json` (its id as `eos_token_id`). Atomic per file.
    Raises ValueError when the tokenizer has no `<|endoftext|>`."""
    from glm5lab.io_utils import atomic_write_text

    folder = Path(folder)
    eos = eot_id(tokenizer)
    atomic_write_text(folder / TOKENIZER_FILE, tokenizer.to_str())
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "pad_token": EOT,
         "model_max_length": 1_000_000_000, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    atomic_write_text(folder / "generation_config.json", json.dumps({"eos_token_id": eos}, indent=2) + "\n")
