"""Token folders: flat binary token shards plus `index.json`, read lazily through numpy memmap.

A token folder (written by `glm5lab tokenize`, `glm5lab.data.tokenize`) holds, per split S in
("train", "val"), shards `S-000000.bin`, `S-000001.bin`, ...: raw little-endian arrays of `dtype`
(uint16 when every id of the tokenizer is < 65536, else uint32), `shard_size` tokens each but
the last. Concatenated in order they are the split's token stream: its documents (`split_documents`)
encoded whole, joined by `<|endoftext|>`. Beside them `tokenizer.json` and `index.json` (`INDEX_FILE`, written last and
atomically: a folder without it is not a token folder):

    {"format": "glm5lab-tokens", "version": 1, "dtype": "uint16", "vocab_size": V,
     "tokenizer_sha256": hex, "shard_size": S,
     "splits": {"train": {"documents": D, "tokens": N, "shards": [{"file": ..., "tokens": n}, ...]},
                "val": {...}},
     "split": {"by": "document", "val_fraction": 0.05, "seed": 0, "moved": NAME | null, "single": bool},
     "source": PATH, "text_field": "text", "glm5lab_version": ...}

Reading: `open_token_folder` checks the index and every shard's size on disk, and returns the
splits as `ShardedTokens` (a 1-D token sequence that reads only the ranges asked for). `pack`
(`glm5lab.data.batches`) turns one into `TokenWindows`, rows read on demand, so BatchStream,
validation and the unigram baseline never load a split. Shapes: N windows, W = seq_len + 1.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm5lab.data.tokenizer import TOKENIZER_FILE

FORMAT = "glm5lab-tokens"
VERSION = 1
INDEX_FILE = "index.json"
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")
CHUNK_TOKENS = 1 << 22  # tokens per read when a whole split is streamed (unigram counts): 8-16 MB


def shard_name(split: str, index: int) -> str:
    """File name of shard `index` of `split`: `train-000000.bin`."""
    return f"{split}-{index:06d}.bin"


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds ids in [0, vocab_size): uint16 up to 65536 ids, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 (hex) of a `tokenizers.Tokenizer`'s canonical JSON (`to_str()`): the same for one tokenizer
    however its file was formatted (a training run's pretty file, a checkpoint's compact one)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


_SHARD_FILE = re.compile(r"^(train|val)-\d{6}\.bin(\.tmp)?$")


def is_token_folder(path) -> bool:
    """True when `path` is a folder holding `index.json` or shard files (`train-000000.bin`, `.bin.tmp`): what
    `glm5lab train --data` reads as token shards (`open_token_folder` then refuses one without index.json)."""
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / INDEX_FILE).is_file() or any(_SHARD_FILE.match(p.name) for p in path.iterdir())


class ShardedTokens:
    """A split's tokens: the concatenation of its shards, read on demand (nothing is loaded at open).

    `len(t)` tokens; `t[a:b]` (step 1) is a numpy array of the shards' dtype, read through a memmap that is
    dropped after the read (so pages read once do not stay mapped and counted in RSS); `np.asarray(t)` reads
    the whole split (small consumers only); `t.chunks()` yields consecutive arrays of at most CHUNK_TOKENS
    tokens read with plain file reads. Immutable."""

    def __init__(self, files: list[Path], counts: list[int], dtype: str):
        self.files, self.counts, self.dtype = list(files), list(counts), np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])
        self.ndim = 1

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __repr__(self) -> str:
        return f"ShardedTokens({len(self):,} {self.dtype} tokens in {len(self.files)} shards)"

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"ShardedTokens supports contiguous slices t[a:b] only, not {key!r}")
        start, stop, _ = key.indices(len(self))
        return self.read(start, max(start, stop))

    def __array__(self, dtype=None, copy=None):
        data = self.read(0, len(self))
        return data if dtype is None else data.astype(dtype)

    def read(self, start: int, stop: int, maps: dict | None = None) -> np.ndarray:
        """Tokens [start, stop) (0 <= start <= stop <= len) as a new array of the shards' dtype. `maps`: a dict
        to reuse memmaps in across calls of one batch (dropped by the caller)."""
        maps = {} if maps is None else maps
        parts = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo, hi = start - self.starts[shard], min(stop, self.starts[shard + 1]) - self.starts[shard]
            if shard not in maps:
                maps[shard] = np.memmap(self.files[shard], dtype=self.dtype, mode="r", shape=(self.counts[shard],))
            parts.append(np.array(maps[shard][lo:hi]))
            start, shard = int(self.starts[shard] + hi), shard + 1
        if not parts:
            return np.empty(0, dtype=self.dtype)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def chunks(self, size: int = CHUNK_TOKENS):
        """Yield the split's tokens in order, as arrays of at most `size` tokens (plain reads, no mapping)."""
        for file, count in zip(self.files, self.counts):
            with open(file, "rb") as f:
                for lo in range(0, count, size):
                    yield np.fromfile(f, dtype=self.dtype, count=min(size, count - lo))


class TokenWindows:
    """`pack` of a `ShardedTokens`: N = len(tokens) // W non-overlapping windows of W = seq_len + 1 tokens,
    row i being tokens[i*W : (i+1)*W] (a window may span two shards), read when indexed.

    Behaves as the int64 tensor [N, W] `pack` returns for an in-memory stream where the training code needs
    it: `len`, `shape`, `ndim`, and `w[key]` for an int, a slice, or an index tensor / array / list of rows,
    returning the int64 tensor of those rows (`w[i]` is [W], otherwise [k, W])."""

    def __init__(self, tokens: ShardedTokens, seq_len: int):
        import torch

        self.tokens, self.width = tokens, seq_len + 1
        self.shape = torch.Size((len(tokens) // self.width, self.width))
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"TokenWindows({self.shape[0]:,} x {self.width} over {self.tokens!r})"

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)) or (hasattr(key, "ndim") and key.ndim == 0):
            return self.rows(np.array([int(key)]))[0]
        if isinstance(key, slice):
            return self.rows(np.arange(*key.indices(len(self))))
        return self.rows(np.asarray(key, dtype=np.int64).reshape(-1))

    def rows(self, rows: np.ndarray):
        """int64 [len(rows), W]: the windows of `rows` (each in [-N, N), else IndexError), in that order."""
        n = len(self)
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"window rows must lie in [-{n}, {n}), got [{rows.min()}, {rows.max()}]")
        out = np.empty((rows.size, self.width), dtype=np.int64)
        maps: dict = {}
        for j, r in enumerate(rows % n if n else rows):
            out[j] = self.tokens.read(int(r) * self.width, (int(r) + 1) * self.width, maps)
        import torch

        return torch.from_numpy(out)


@dataclass(frozen=True)
class TokenFolder:
    """An opened token folder: its path, parsed index, and per-split `ShardedTokens`."""

    path: Path
    index: dict
    train: ShardedTokens
    val: ShardedTokens

    @property
    def tokenizer_file(self) -> Path:
        return self.path / TOKENIZER_FILE


def open_token_folder(path) -> TokenFolder:
    """Open the token folder at `path`, checking `index.json` (format, version, dtype, splits) and that every
    shard exists with exactly tokens x itemsize bytes. Raises ValueError (one line naming the file, field or
    shard, what was found and what is allowed) for a missing or malformed index, an unknown format/version/
    dtype, a missing shard or one whose size on disk differs from the index (truncated or overwritten)."""
    path = Path(path)
    index = read_index(path)
    dtype = np.dtype(index["dtype"])
    splits = {}
    for split in SPLITS:
        files, counts = [], []
        for shard in index["splits"][split]["shards"]:
            file, tokens = path / shard["file"], shard["tokens"]
            size = file.stat().st_size if file.is_file() else None
            if size is None:
                raise ValueError(f"token folder {path}: shard {shard['file']} listed in {INDEX_FILE} is missing")
            if size != tokens * dtype.itemsize:
                raise ValueError(f"token folder {path}: shard {shard['file']} holds {size:,} bytes but {INDEX_FILE} "
                                 f"says {tokens:,} {dtype} tokens = {tokens * dtype.itemsize:,} bytes (truncated or "
                                 "overwritten): tokenize the corpus again")
            files.append(file)
            counts.append(tokens)
        splits[split] = ShardedTokens(files, counts, index["dtype"])
    return TokenFolder(path, index, splits["train"], splits["val"])


def read_index(path: Path) -> dict:
    """The parsed, checked `index.json` of token folder `path` (errors as `open_token_folder`)."""
    file = Path(path) / INDEX_FILE
    if not file.is_file():
        raise ValueError(f"{path} has no {INDEX_FILE}: not a token folder (an interrupted `glm5lab tokenize`?); "
                         "run `glm5lab tokenize DATA --out DIR` to make one")
    try:
        index = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}): tokenize the corpus again") from None
    _check_index(file, index)
    return index


def _check_index(file: Path, index) -> None:
    def bad(field: str, value, allowed: str):
        raise ValueError(f"{file}: {field} = {value!r} is not allowed: {allowed}")

    if not isinstance(index, dict):
        bad("the index", type(index).__name__, "a JSON object")
    if index.get("format") != FORMAT:
        bad("format", index.get("format"), f"{FORMAT!r}")
    if index.get("version") != VERSION:
        bad("version", index.get("version"), f"{VERSION} (this glm5lab reads version {VERSION})")
    if index.get("dtype") not in DTYPES:
        bad("dtype", index.get("dtype"), " or ".join(DTYPES))
    for key in ("vocab_size", "tokenizer_sha256", "splits"):
        if key not in index:
            bad(key, None, "present")
    for split in SPLITS:
        entry = index["splits"].get(split) if isinstance(index["splits"], dict) else None
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("file"), str)
                                                   and isinstance(s.get("tokens"), int) and s["tokens"] >= 0
                                                   for s in shards):
            bad(f"splits.{split}.shards", shards, "a list of {\"file\": NAME, \"tokens\": COUNT >= 0}")
        if any("/" in s["file"] or s["file"].startswith(".") for s in shards):
            bad(f"splits.{split}.shards", [s["file"] for s in shards], "plain file names inside the folder")
